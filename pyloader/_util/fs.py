"""The cache directory, and writes that never leave a half-written file behind.

Every writer in pyloader writes to a temporary sibling of the destination (same
directory, so same file system) and renames it into place once complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir(*parts: str, create: bool = True) -> Path:
    """``$PYLOADER_CACHE`` (default ``~/.cache/pyloader``) joined with ``parts``; created
    unless ``create`` is False."""
    root = os.environ.get("PYLOADER_CACHE") or os.path.join(Path.home(), ".cache", "pyloader")
    d = Path(root).expanduser().joinpath(*parts)
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def tmp_sibling(dst: str | os.PathLike[str], tag: str = "tmp") -> Path:
    """A hidden temporary name beside ``dst`` (unique to this process)."""
    dst = Path(dst)
    return dst.with_name(f".{dst.name}.{tag}-{os.getpid()}")


def remove(p: str | os.PathLike[str]) -> None:
    """Delete a file, link or directory tree if it exists."""
    p = Path(p)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def commit(tmp: str | os.PathLike[str], dst: str | os.PathLike[str], overwrite: bool) -> None:
    """Rename a complete ``tmp`` (file or directory) to ``dst``; an existing ``dst`` is
    replaced only with ``overwrite``, and never left half-written."""
    tmp, dst = Path(tmp), Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(17, "destination exists (pass overwrite=True)", str(dst))
        if dst.is_dir() and not dst.is_symlink():
            old = tmp_sibling(dst, "old")
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old)
            return
    os.replace(tmp, dst)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = tmp_sibling(path)
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file's data to storage: flushed pages are clean, so a later
    ``posix_fadvise(DONTNEED)`` can really evict them (dirty pages stay cached)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
