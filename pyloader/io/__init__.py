"""Checkpoints and their bytes, without mlx-lm: the index, the readers, ``load``, page-cache
control, ``inspect``, the aligned writer, ``repack`` and GGUF conversion."""

from .checkpoint import Checkpoint, TensorMeta
from .pagecache import evict_file
from .readers import MmapReader, PreadReader, open
from .strategies import DEFAULT_STRATEGY, STRATEGIES, LoadStats, load, load_with_stats

__all__ = [
    "Checkpoint",
    "DEFAULT_STRATEGY",
    "LoadStats",
    "MmapReader",
    "PreadReader",
    "STRATEGIES",
    "TensorMeta",
    "evict_file",
    "load",
    "load_with_stats",
    "open",
]
