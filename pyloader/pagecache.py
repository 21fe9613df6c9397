"""Page-cache control, for cold-start measurements."""

from __future__ import annotations

import os

from ._native import _core


def evict_file(path: str | os.PathLike[str]) -> None:
    """Drop a file's clean pages from the page cache (``posix_fadvise(DONTNEED)``).

    Pages still mapped by a live process stay; everything else is read from
    disk on next use. Raises OSError when the file cannot be opened.
    """
    _core.evict_file(os.fspath(path))
