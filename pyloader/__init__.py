"""pyloader: load and stream LLM weights for MLX.

Quick use::

    import pyloader
    weights = pyloader.load("model_dir")            # zero-copy mmap
    weights = pyloader.load("model_dir", "pread")   # parallel pread
    pyloader.save_safetensors("out.safetensors", weights)  # every tensor zero-copy
    ckpt = pyloader.open("model_dir")               # headers only
    model, tok = pyloader.load_model("model_dir", resident=0.5)  # half streamed
    pyloader.stream(my_model, "model_dir", pyloader.StreamOptions(resident=0.5))  # any model
    with pyloader.trace(model, "out.json", png="out.png"):  # a timeline of every read
        ...

The package is layered (docs/architecture.md): ``_util`` and ``errors`` at the bottom,
then ``io`` (checkpoints and readers, no mlx-lm), ``streaming`` (the controller),
``kv``/``heads``/``distributed``, ``engines`` (mlx-vlm, mlx-whisper, mlx-embeddings
models: docs/engines.md), ``loading`` (``load_model``), ``residency``, ``synthetic``,
``compare`` (``pyloader compare``), ``testing`` (the opt-in pytest plugin) and ``cli``.
"""

from . import engines, kernels
from ._native import core
from ._version import __version__
from .errors import (
    ConfigError,
    EngineError,
    EngineNotInstalledError,
    FormatError,
    GGUFFileError,
    HeadError,
    KVCacheWarning,
    MeasureError,
    ModelNotFoundError,
    ResidencyWarning,
    StandInError,
    UnsupportedError,
)
from .io import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Checkpoint,
    LoadStats,
    MmapReader,
    PreadReader,
    TensorMeta,
    evict_file,
    load,
    load_with_stats,
    open,
)
from .io.writer import save_safetensors
from .streaming import Residency, StreamingController, StreamOptions, stats, stream
from .streaming.trace import trace

uring_available = core.uring_available

# Imported on first use: these need mlx-lm (an optional dependency) or, for
# Distribution, the distributed package.
_LAZY = {
    "Distribution": "distributed",
    "default_model_path": "default_model",
    "load_model": "loading",
    "load_prompt_cache": "kv",
    "make_kv_cache": "kv",
    "plan_kv_cache": "kv",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pyloader' has no attribute {name!r}")


__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "Checkpoint",
    "ConfigError",
    "Distribution",
    "EngineError",
    "EngineNotInstalledError",
    "FormatError",
    "GGUFFileError",
    "HeadError",
    "KVCacheWarning",
    "LoadStats",
    "MeasureError",
    "MmapReader",
    "ModelNotFoundError",
    "PreadReader",
    "Residency",
    "ResidencyWarning",
    "StandInError",
    "StreamOptions",
    "StreamingController",
    "TensorMeta",
    "UnsupportedError",
    "__version__",
    "default_model_path",
    "engines",
    "evict_file",
    "kernels",
    "load",
    "load_model",
    "load_prompt_cache",
    "load_with_stats",
    "make_kv_cache",
    "open",
    "plan_kv_cache",
    "save_safetensors",
    "stats",
    "stream",
    "trace",
    "uring_available",
]
