"""pyloader: load and stream LLM weights for MLX.

The package is layered (``_util``/``errors``, ``io``, ``streaming``, ..., ``cli``); see
docs/architecture.md and docs/loading.md.
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

# Imported on first use: these need mlx-lm (optional) or the distributed package.
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
