"""Checkpoints and their bytes, without mlx-lm: the index, the readers, ``load``,
page-cache control, ``inspect``, the aligned writer, ``repack`` and GGUF conversion.

* :mod:`.checkpoint`: ``open(path)`` → :class:`Checkpoint`, a validated header table;
* :mod:`.readers`: :class:`MmapReader` (zero-copy views, prefetch) and
  :class:`PreadReader` (parallel chunked reads, io_uring);
* :mod:`.strategies`: ``load(path, strategy)`` → ``dict[str, mx.array]``;
* :mod:`.pagecache`: ``evict_file`` and friends, for cold and warm starts;
* :mod:`.inspect`: what a checkpoint holds, from its headers (``pyloader inspect``);
* :mod:`.writer` / :mod:`.repack`: every tensor on a boundary (``pyloader repack``);
* :mod:`.gguf`: a llama GGUF → an mlx-lm model directory (``pyloader convert-gguf``).
"""

from .checkpoint import Checkpoint, TensorMeta, open
from .pagecache import evict_file
from .readers import MmapReader, PreadReader
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
