"""Opening a checkpoint's files from Python: never blocking, and with no moment at which a
Ctrl-C could leave a descriptor that nothing owns.

``os.open`` returns a bare descriptor, and a ``KeyboardInterrupt`` can be raised right after
it returns, before any ``try`` or file object holds it: the descriptor leaks. Python's
``open()`` with the C++ core's opener stores the descriptor in its file object without
running Python code in between.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .._native import core
from .._util.fs import path_error


def open_unblocked(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` whose open never waits (a FIFO's would wait for a writer).
    Whether it is a regular file is the caller's check."""
    return open(os.fsdecode(path), "rb", opener=core.open_for_python)


def open_regular(path: str | os.PathLike[str], what: str = "file") -> BinaryIO:
    """``open(path, "rb")`` of a regular file only, never blocking; else :func:`path_error`."""
    try:
        f = open_unblocked(path)
    except (OSError, ValueError):
        raise path_error(path, what) from None
    try:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise path_error(path, what)
    except BaseException:
        f.close()
        raise
    return f
