"""Loading strategies: each turns a checkpoint into ``dict[str, mx.array]``.

* ``"mmap"`` maps each file once; aligned tensors are zero-copy views of the
  page cache, misaligned ones are copied (counted in :class:`LoadStats`).
* ``"pread"`` reads with a pool of threads into fresh MLX-owned buffers.
* ``"mlx"`` is plain ``mx.load`` (the baseline; its arrays are lazy).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx

from ._native import _core
from .checkpoint import Checkpoint
from .memcheck import check_fits

STRATEGIES = ("mmap", "pread", "mlx")
DEFAULT_STRATEGY = "mmap"


@dataclass
class LoadStats:
    """What one load did.

    ``bytes_read`` counts bytes moved by a read or copy during the load; for the
    mmap strategy zero-copy tensors are read later, on first touch, by the
    page-fault path; ``populate_bytes`` counts bytes an mmap reader read in
    ahead of use (prefetch/``"populate"``). ``zero_copy_verified`` is False when the running MLX
    refused a zero-copy view and the loader copied instead.
    """

    strategy: str
    tensors: int = 0
    bytes: int = 0
    zero_copy_tensors: int = 0
    zero_copy_bytes: int = 0
    copied_tensors: int = 0
    copied_bytes: int = 0
    bytes_read: int = 0
    populate_bytes: int = 0
    wall_s: float = 0.0
    zero_copy_verified: bool = True

    @property
    def zero_copy_fraction(self) -> float:
        """Fraction of tensor bytes handed out without a copy."""
        return self.zero_copy_bytes / self.bytes if self.bytes else 1.0


def _as_checkpoint(path_or_ckpt) -> Checkpoint:
    if isinstance(path_or_ckpt, Checkpoint):
        return path_or_ckpt
    return Checkpoint(path_or_ckpt)


def _check_names(ckpt: Checkpoint, names: Iterable[str] | None) -> list[str] | None:
    """None (every tensor) or the list of names, each checked to exist.
    A repacked checkpoint's padding entries are never loaded: for it, None
    becomes the list of its real tensors."""
    if names is None:
        return ckpt.keys() if ckpt.padding_names else None
    names = list(names)
    for n in names:
        if n not in ckpt:
            raise KeyError(f"no tensor named {n!r} in {ckpt.path}")
    return names


class MmapReader:
    """Zero-copy tensors over read-only mappings of a checkpoint's files.

    Each file is mapped once, on first use, and its descriptor closed. Arrays
    keep their file's mapping alive; it is unmapped when the reader and every
    array from it are gone.

    Args:
        path: A checkpoint path or an open :class:`Checkpoint`.
        allow_misaligned: Hand out views of tensors whose offset is not a
            multiple of their item size instead of copying them.
    """

    def __init__(self, path, *, allow_misaligned: bool = False):
        self.checkpoint = _as_checkpoint(path)
        self._reader = _core.MmapReader(self.checkpoint.index, allow_misaligned)

    def get(self, name: str) -> mx.array:
        """One tensor."""
        return self._reader.get(name)

    def load(self, names: Iterable[str] | None = None) -> dict[str, mx.array]:
        """Several tensors (all when ``names`` is None)."""
        return self._reader.load(_check_names(self.checkpoint, names))

    def advise(self, name: str, hint: str) -> bool:
        """Page hint for one tensor's bytes.

        ``hint`` is one of ``"sequential"``, ``"random"``, ``"normal"``,
        ``"willneed"`` (start reading it in, asynchronously), ``"populate"`` (read it
        in and map it now, so touching it later takes no page faults), ``"dontneed"`` (drop its pages from
        this process; pages shared with neighbouring tensors are kept) or
        ``"evict"`` (drop its clean pages from the page cache). Returns False
        when the kernel refused the hint.
        """
        return self._reader.advise(name, hint)

    def advise_range(self, file: str, offset: int, length: int, hint: str) -> bool:
        """Page hint for a byte range of one of the checkpoint's files."""
        return self._reader.advise_range(
            self.checkpoint.files.index(os.fspath(file)), offset, length, hint
        )

    def prefetch(self, names: Iterable[str], hint: str = "populate") -> int:
        """Apply ``hint`` to ``names`` on a background thread; returns a ticket
        for :meth:`wait`. ``"populate"`` reads the pages in and maps them."""
        return self._reader.prefetch(_check_names(self.checkpoint, names), hint)

    def wait(self, ticket: int) -> None:
        """Block until a :meth:`prefetch` is done; raises its OSError, if any."""
        self._reader.wait(ticket)

    def cancel(self, ticket: int) -> bool:
        """Drop a :meth:`prefetch` that has not started (True if dropped)."""
        return self._reader.cancel(ticket)

    def resident_bytes(self, name: str) -> int:
        """Bytes of the tensor's pages currently in memory (page granular)."""
        return self._reader.resident_bytes(name)

    def check_unchanged(self) -> None:
        """Raise ``OSError`` (``ESTALE``) if a file this reader maps was
        truncated, rewritten or replaced since its header was read. Views of a
        truncated mapping would fault (SIGBUS) and views of a rewritten one
        would hold other bytes: call this before using them again."""
        self._reader.check_unchanged()

    def stats(self) -> dict:
        """Counters since the reader was created."""
        return self._reader.stats()

    @property
    def live_mappings(self) -> int:
        """Files this reader currently holds mapped."""
        return self._reader.live_mappings

    def close(self) -> None:
        """Drop the reader's references to its mappings (arrays keep theirs)."""
        self._reader.release()

    def __enter__(self) -> "MmapReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PreadReader:
    """Parallel chunked ``pread`` into fresh MLX-owned arrays.

    Args:
        path: A checkpoint path or an open :class:`Checkpoint`.
        threads: Reader threads (default: one per core; ignored by io_uring).
        chunk_bytes: Largest single read.
        backend: ``"threads"`` (a pool doing ``pread``) or ``"io_uring"`` (one ring,
            64 reads in flight; needs a build with liburing, see
            :func:`pyloader.uring_available`).
        readahead: False reads exactly the requested ranges (no kernel readahead
            into neighbouring tensors), for reading a few tensors at a time.
        drop_cache: Drop the ranges from the page cache once read.
    """

    def __init__(self, path, *, threads: int | None = None, chunk_bytes: int = 16 << 20,
                 backend: str = "threads", readahead: bool = True, drop_cache: bool = False):
        self.checkpoint = _as_checkpoint(path)
        self._reader = _core.PreadReader(self.checkpoint.index, threads or 0, chunk_bytes,
                                         backend, readahead, drop_cache)

    def load(self, names: Iterable[str] | None = None) -> dict[str, mx.array]:
        """Read tensors (all when ``names`` is None); the GIL is released while reading."""
        return self._reader.load(_check_names(self.checkpoint, names))

    def submit(self, names: Iterable[str]) -> int:
        """Queue a background read of ``names``; returns a ticket for :meth:`take`."""
        return self._reader.submit(_check_names(self.checkpoint, names))

    def take(self, ticket: int) -> dict[str, mx.array]:
        """Wait for a submitted read and return its arrays (raises its OSError)."""
        return self._reader.take(ticket)

    def cancel(self, ticket: int) -> bool:
        """Drop a submitted read (True if it had not started); its arrays are freed."""
        return self._reader.cancel(ticket)

    def stats(self) -> dict:
        """Counters since the reader was created."""
        return self._reader.stats()

    @property
    def threads(self) -> int:
        return self._reader.threads

    @property
    def backend(self) -> str:
        return self._reader.backend


def _load_mlx(ckpt: Checkpoint, names: list[str] | None) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in ckpt.files:
        out.update(mx.load(f))
    if names is not None:
        out = {n: out[n] for n in names}
    elif ckpt.padding_names:
        out = {n: a for n, a in out.items() if n not in ckpt.padding_names}
    return out


def load_with_stats(
    path,
    strategy: str = DEFAULT_STRATEGY,
    names: Iterable[str] | None = None,
    *,
    allow_misaligned: bool = False,
    threads: int | None = None,
) -> tuple[dict[str, mx.array], LoadStats]:
    """Like :func:`load`, and also return the :class:`LoadStats` of this load."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    t0 = time.perf_counter()
    ckpt = _as_checkpoint(path)
    wanted = _check_names(ckpt, names)
    if strategy == "mlx":
        arrays = _load_mlx(ckpt, wanted)
        nbytes = sum(ckpt[n].nbytes for n in arrays)
        raw = {"tensors": len(arrays), "bytes": nbytes, "copied_tensors": len(arrays),
               "copied_bytes": nbytes, "bytes_read": nbytes}
    elif strategy == "mmap":
        if not allow_misaligned:  # misaligned tensors are copied
            metas = [ckpt[n] for n in wanted] if wanted is not None else ckpt.tensors()
            check_fits(sum(t.nbytes for t in metas if not t.aligned), str(ckpt.path))
        reader = _core.MmapReader(ckpt.index, allow_misaligned)
        arrays = reader.load(wanted)
        raw = reader.stats()
    else:
        metas = [ckpt[n] for n in wanted] if wanted is not None else ckpt.tensors()
        check_fits(sum(t.nbytes for t in metas), str(ckpt.path))
        reader = _core.PreadReader(ckpt.index, threads or 0, 16 << 20)
        arrays = reader.load(wanted)
        raw = reader.stats()
    stats = LoadStats(strategy=strategy, wall_s=time.perf_counter() - t0, **raw)
    return arrays, stats


def load(
    path,
    strategy: str = DEFAULT_STRATEGY,
    names: Iterable[str] | None = None,
    *,
    allow_misaligned: bool = False,
    threads: int | None = None,
) -> dict[str, mx.array]:
    """Load a checkpoint's tensors as ``mx.array``s.

    Args:
        path: A ``.safetensors`` file, a sharded model directory or a directory
            of ``*.safetensors`` files (or an open :class:`Checkpoint`).
        strategy: ``"mmap"`` (default: zero-copy where aligned), ``"pread"`` or
            ``"mlx"`` (plain ``mx.load``, lazy).
        names: Only these tensors (default: all). Unknown names raise KeyError.
        allow_misaligned: mmap only: view misaligned tensors instead of copying.
        threads: pread only: reader threads (default: one per core).

    Raises:
        pyloader.FormatError: a header breaks a rule of the format.
        FileNotFoundError / OSError: a file is missing or a read failed.
    """
    return load_with_stats(
        path, strategy, names, allow_misaligned=allow_misaligned, threads=threads
    )[0]
