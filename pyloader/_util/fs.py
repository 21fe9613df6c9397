"""The cache directory, and writes that never leave a half-written file behind.

Writers write a temporary sibling and rename it into place (a directory is exchanged in one step);
:func:`remove_stale` cleans up after killed writers. Readers refuse non-regular files with an
``OSError`` saying what the path is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import signal
import stat
from pathlib import Path
from typing import Iterable


def cache_dir(*parts: str, create: bool = True) -> Path:
    """``$PYLOADER_CACHE`` (or ``~/.cache/pyloader``) joined with ``parts``; made if ``create``."""
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
    """Rename a complete ``tmp`` to ``dst`` (replacing only with ``overwrite``), atomically."""
    tmp, dst = Path(tmp), Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(17, "destination exists (pass overwrite=True)", str(dst))
        if tmp.is_dir() and dst.is_dir() and not dst.is_symlink():
            replace_dir(tmp, dst)
            return
    os.replace(tmp, dst)
    fault_point(f"renamed {tmp.name} to {dst}")


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
    """Swap the names ``a`` and ``b`` (both must exist) in one atomic step.

    Raises:
        OSError: ``ENOSYS``/``EINVAL`` where the kernel, libc or file system cannot.
    """
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", os.fspath(a))
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                  _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"exchange with {os.fspath(b)}: {os.strerror(e)}", os.fspath(a))


def replace_dir(tmp: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Put the complete directory ``tmp`` at ``dst``, replacing the directory there."""
    tmp, dst = Path(tmp), Path(dst)
    try:
        exchange(tmp, dst)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
        old = tmp_sibling(dst, "old")
        os.rename(dst, old)
        fault_point(f"renamed {dst} aside")
        os.rename(tmp, dst)
        fault_point(f"renamed {tmp.name} to {dst}")
        shutil.rmtree(old)
        return
    fault_point(f"exchanged {tmp.name} and {dst}")
    shutil.rmtree(tmp)


_TEMP_RE = re.compile(r"\.(?P<name>.+)\.(?P<tag>tmp|old|repack|swap)-(?P<pid>[0-9]+)")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(dst: str | os.PathLike[str]) -> list[Path]:
    """Remove dead writers' temporaries beside ``dst``; undo a replacement killed half-way."""
    dst = Path(dst)
    parent = dst.parent
    removed = []
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _TEMP_RE.fullmatch(entry.name)
        if m is None or m["name"] != dst.name or _alive(int(m["pid"])):
            continue
        if m["tag"] == "old" and not (dst.exists() or dst.is_symlink()):
            os.rename(entry, dst)  # the old state, complete: back in place
            continue
        remove(entry)
        removed.append(entry)
    return removed


def check_destination(dst: str | os.PathLike[str], *, sources: Iterable = (),
                      directory: bool, overwrite: bool, owned=None) -> None:
    """The one rule for what a writer may replace: raise unless writing ``dst`` is safe.

    Args:
        dst: Where the writer puts its file or directory.
        sources: What it reads: ``dst`` must not be nor contain one, even with ``overwrite``.
        directory: The writer makes a directory (else a file); the other type is never replaced.
        overwrite: Replace an existing ``dst``; without it an existing ``dst`` is refused.
        owned: For a directory: whether an existing ``dst`` is this writer's kind (empty: always).

    Raises:
        FileExistsError: ``dst`` exists without ``overwrite``, or is of another type or kind.
        ValueError: ``dst`` is a source or contains one.
    """
    dst = Path(dst)
    target = Path(os.path.realpath(dst))
    for src in sources:
        real = Path(os.path.realpath(src))
        if real == target or target in real.parents:
            raise ValueError(f"{dst}: the destination {'is' if real == target else 'contains'}"
                             f" the source {src}; writing it would destroy what is read")
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "destination exists (pass --overwrite / "
                              "overwrite=True to replace it)", str(dst))
    is_dir = dst.is_dir() and not dst.is_symlink()
    if is_dir != directory:
        raise FileExistsError(errno.EEXIST, f"destination is a {'directory' if is_dir else 'file'}"
                              f"; this writes a {'directory' if directory else 'file'} and "
                              "never replaces one by the other", str(dst))
    if is_dir and owned is not None and any(dst.iterdir()) and not owned(dst):
        raise FileExistsError(errno.EEXIST, "destination is a directory this command did "
                              "not make; --overwrite replaces only its own kind of output "
                              "(remove it yourself if you mean it)", str(dst))


class named_errors:
    """Re-raise a file-less ``OSError`` (``ENOSPC``) with ``path`` as its file name."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), self.path) from exc
        return False


def renamed_error(exc: BaseException, tmp: str | os.PathLike[str],
                  dst: str | os.PathLike[str]) -> BaseException:
    """``exc`` with temporary ``tmp`` names shown as ``dst``'s; anything else unchanged."""
    tmp_s, dst_s = os.fspath(tmp), os.fspath(dst)
    if isinstance(exc, OSError) and isinstance(exc.filename, str) and (
            exc.filename == tmp_s or exc.filename.startswith(tmp_s + os.sep)):
        new = OSError(exc.errno, exc.strerror, dst_s + exc.filename[len(tmp_s):])
        new.__cause__ = exc
        return new
    return exc


_steps = 0


def fault_point(what: str) -> None:
    """One step of a writer is done; ``PYLOADER_FAULT_AT=K`` kills this process at the K-th step
    (``PYLOADER_FAULT_MODE=raise``: ``OSError(ENOSPC)``)."""
    global _steps
    at = os.environ.get("PYLOADER_FAULT_AT")
    if not at:
        return
    _steps += 1
    if _steps != int(at):
        return
    if os.environ.get("PYLOADER_FAULT_MODE") == "raise":
        raise OSError(errno.ENOSPC, f"injected fault at step {_steps} ({what})")
    os.kill(os.getpid(), signal.SIGKILL)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = tmp_sibling(path)
    try:
        with open(tmp, "w" if isinstance(data, str) else "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if exc.filename is None:  # say which file (ENOSPC names none otherwise)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    fault_point(f"wrote {path}")


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file's data to storage, so its pages are clean and can be evicted."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def describe_path(path: str | os.PathLike[str]) -> tuple[str, int]:
    """What is at ``path`` (links followed), for a message, and the fitting ``errno`` when a
    regular file was expected: ``("a directory", EISDIR)``, ``("a regular file", 0)``, ..."""
    path = os.fspath(path)
    if ("\0" if isinstance(path, str) else b"\0") in path:
        return "a name containing a NUL byte", errno.EINVAL
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        err = exc.errno or errno.EINVAL
    else:
        if stat.S_ISREG(mode):
            return "a regular file", 0
        return _kind(mode), errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    if err == errno.ELOOP:
        return "a symbolic link loop", err
    if err == errno.ENOTDIR:
        return "unreachable (a component of the path is not a directory)", err
    if err == errno.ENOENT:
        try:
            target = os.readlink(path)
        except OSError:
            return "no such file or directory", err
        return f"a symbolic link to {os.fsdecode(target)!r}, which does not exist", err
    return os.strerror(err), err


def path_error(path: str | os.PathLike[str], what: str = "file") -> OSError:
    """The errno-specific ``OSError`` for a ``path`` that should be a regular file."""
    desc, err = describe_path(path)
    if desc == "no such file or directory":
        return FileNotFoundError(err, f"{what} not found (no such file or directory)",
                                 os.fspath(path))
    if desc.startswith("a name"):
        return OSError(err, f"{what} has {desc}", os.fspath(path))
    tail = ", not a regular file" if desc.startswith("a ") else ""
    return OSError(err or errno.EINVAL, f"{what} is {desc}{tail}", os.fspath(path))


def is_regular_file(path: str | os.PathLike[str], what: str = "file") -> bool:
    """True for a regular file, False when nothing is there; :func:`path_error` otherwise."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return False
        raise path_error(path, what) from None
    except (OSError, ValueError):
        raise path_error(path, what) from None
    if not stat.S_ISREG(mode):
        raise path_error(path, what)
    return True
