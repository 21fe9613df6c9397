"""pyloader: load and stream LLM weights for MLX.

Quick use::

    import pyloader
    weights = pyloader.load("model_dir")            # zero-copy mmap
    weights = pyloader.load("model_dir", "pread")   # parallel pread
    ckpt = pyloader.open("model_dir")               # headers only
"""

from ._native import _core
from .checkpoint import Checkpoint, TensorMeta, open
from .pagecache import evict_file
from .streaming import load_model, stats
from .loaders import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    LoadStats,
    MmapReader,
    PreadReader,
    load,
    load_with_stats,
)

__version__ = "0.1.0"

FormatError = _core.FormatError
FormatError.__module__ = "pyloader"
FormatError.__doc__ = (
    "A safetensors file or model index breaks a rule of the format; the message "
    "names the file, the tensor (when there is one) and the rule."
)
UnsupportedError = _core.UnsupportedError
UnsupportedError.__module__ = "pyloader"
UnsupportedError.__doc__ = (
    "A checkpoint uses something pyloader cannot hand to MLX (a dtype MLX has no "
    "array type for, such as F4/F6) or a feature this build lacks (io_uring without "
    "liburing); the message names the file, the tensor and what to do instead."
)
uring_available = _core.uring_available

# The KV cache speaks mlx-lm's cache protocol, so it needs mlx-lm: pyloader.kv
# is imported on first use of one of these names.
_KV_NAMES = ("KVCacheWarning", "load_prompt_cache", "make_kv_cache", "plan_kv_cache")


def __getattr__(name):
    if name in _KV_NAMES:
        from . import kv

        return getattr(kv, name)
    raise AttributeError(f"module 'pyloader' has no attribute {name!r}")


__all__ = [
    "Checkpoint",
    "DEFAULT_STRATEGY",
    "FormatError",
    "KVCacheWarning",
    "LoadStats",
    "MmapReader",
    "PreadReader",
    "STRATEGIES",
    "TensorMeta",
    "UnsupportedError",
    "evict_file",
    "load",
    "load_prompt_cache",
    "load_model",
    "load_with_stats",
    "make_kv_cache",
    "open",
    "plan_kv_cache",
    "stats",
    "uring_available",
]
