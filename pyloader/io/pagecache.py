"""Page-cache control, for cold and warm starts and for checking what a run read."""

from __future__ import annotations

import os
from typing import Iterable

from .._native import core
from .readers import MmapReader


def evict_file(path: str | os.PathLike[str]) -> None:
    """Drop a file's clean pages from the page cache (``posix_fadvise(DONTNEED)``; macOS:
    docs/platforms.md); OSError when the file cannot be opened."""
    core.evict_file(os.fspath(path))


def evict(files: Iterable[str | os.PathLike[str]]) -> None:
    """:func:`evict_file` on every file."""
    for f in files:
        evict_file(f)


def warm(files: Iterable[str | os.PathLike[str]], chunk: int = 8 << 20) -> None:
    """Read every byte of every file once so it sits in the page cache."""
    buf = bytearray(chunk)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def recache(files: Iterable[str | os.PathLike[str]]) -> None:
    """:func:`evict` then :func:`warm`: the files' bytes in pages cached just now."""
    files = list(files)
    evict(files)
    warm(files)


#: The page-cache states a measurement starts from.
CACHE_STATES = ("warm", "cold")


def prepare_cache(cache: str, files: Iterable[str | os.PathLike[str]]) -> None:
    """Put ``files`` in page-cache state ``cache``: ``"cold"`` evicts, ``"warm"`` reads them."""
    if cache == "cold":
        evict(files)
    elif cache == "warm":
        warm(files)
    else:
        raise ValueError(f"unknown cache state {cache!r}; expected one of {CACHE_STATES}")


def cached_fraction(files: Iterable[str | os.PathLike[str]]) -> float:
    """Share of the files' bytes in the page cache now, 0..1 (1.0 for no bytes); maps nothing in."""
    total = cached = 0
    for f in files:
        total += os.path.getsize(f)
        cached += core.cached_bytes(os.fspath(f))
    return min(cached / total, 1.0) if total else 1.0


def page_cache_fraction(path) -> float:
    """Fraction of a checkpoint's tensor bytes in the page cache now; maps nothing in."""
    with MmapReader(path) as r:
        ckpt = r.checkpoint
        total = ckpt.total_nbytes
        resident = sum(r.resident_bytes(n) for n in ckpt)
    return min(resident / total, 1.0) if total else 1.0


