"""The two readers of a checkpoint's tensors.

* :class:`MmapReader` maps each file once.
* :class:`PreadReader` reads with a pool of threads (or io_uring) into fresh MLX-owned buffers.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

import mlx.core as mx

from .._native import core
from .checkpoint import Checkpoint
from .gguf_header import is_gguf
from .gguf_source import GGUFSource
from .hub import resolve

log = logging.getLogger(__name__)
_warned_misaligned: set[str] = set()


def warn_misaligned(ckpt: Checkpoint) -> None:
    """Warn once per checkpoint how much of it the mmap strategy copies, and how to repack it."""
    a = ckpt.alignment_summary()
    if a["aligned_tensors"] == a["tensors"] or ckpt.path in _warned_misaligned:
        return
    _warned_misaligned.add(ckpt.path)
    log.warning(
        "%s: %d of %d tensors (%.1f of %.1f MB) are not aligned to their dtype (as "
        "mx.save_safetensors writes them), so the mmap strategy copies them into "
        "anonymous memory; `pyloader repack --in-place %s` rewrites the checkpoint "
        "with every tensor zero-copy (it still loads in mlx_lm.load)",
        ckpt.path, a["tensors"] - a["aligned_tensors"], a["tensors"],
        (a["bytes"] - a["aligned_bytes"]) / 1e6, a["bytes"] / 1e6, ckpt.path)


def zero_copy_mode() -> str:
    """How the mmap reader makes arrays of aligned tensors here: ``"header"``, ``"make_buffer"``
    or ``"copy"`` (``PYLOADER_ZERO_COPY`` forces one)."""
    return core.zero_copy_mode()


def views_cost_nothing() -> bool:
    """Whether an mmap view may stay attached while its pages are dropped (``"header"`` views)."""
    return zero_copy_mode() == "header"


def aligned_are_views() -> bool:
    """Whether the mmap reader hands out aligned tensors as views of the page cache."""
    mode = zero_copy_mode()
    return mode == "header" or (mode == "make_buffer" and core.buffer_owner() == "metal")


def open(path: str | os.PathLike[str],  # noqa: A001 - the public name
         revision: str | None = None) -> Checkpoint:
    """Open and validate a checkpoint's headers: a safetensors file, directory or cached repo
    id, or a GGUF file (its tensors under mlx-lm's names, read in place: docs/gguf.md)."""
    p = resolve(path, revision)
    if is_gguf(p):
        return GGUFSource.open(p).checkpoint
    return Checkpoint(p)


def as_checkpoint(path_or_ckpt) -> Checkpoint:
    """``path_or_ckpt`` itself when it is an open :class:`Checkpoint`, else opened."""
    if isinstance(path_or_ckpt, Checkpoint):
        return path_or_ckpt
    return open(path_or_ckpt)


def check_names(ckpt: Checkpoint, names: Iterable[str] | None) -> list[str] | None:
    """None (every tensor) or the names, each checked to exist (KeyError otherwise); padding
    entries of a repacked checkpoint are never included."""
    if names is None:
        return ckpt.keys() if ckpt.padding_names else None
    names = list(names)
    for n in names:
        if n not in ckpt:
            raise KeyError(f"no tensor named {n!r} in {ckpt.path}")
    return names


class _Reader:
    """What both readers share (``checkpoint`` and the core reader ``_reader``)."""

    checkpoint: Checkpoint

    def load_overlapped(self, names: Iterable[str] | None = None) -> dict[str, mx.array]:
        """Return the tensors at once, made ready in file order in the background; evaluating
        one waits for its bytes and raises its ``OSError`` if a read failed."""
        return self._reader.load_overlapped(check_names(self.checkpoint, names))

    def cancel(self, ticket: int) -> bool:
        """Drop a queued prefetch or read that has not started (True if dropped)."""
        return self._reader.cancel(ticket)

    def stats(self) -> dict:
        """Counters since the reader was created."""
        return self._reader.stats()

    def trace_enable(self, on: bool = True, capacity: int = 1 << 16) -> None:
        """Start (clearing the record) or stop tracing the reader threads' work."""
        self._reader.trace_enable(on, capacity)

    def take_trace(self) -> tuple[list[tuple[str, int, int, int, int, int]], int]:
        """``(events, dropped)`` since the last call; an event is ``(kind, ticket, thread_id,
        start_ns, end_ns, bytes)``, times on :func:`time.monotonic_ns`'s clock."""
        return self._reader.take_trace()


class MmapReader(_Reader):
    """Zero-copy tensors over read-only mappings of a checkpoint's files.

    Args:
        path: A checkpoint path or an open :class:`Checkpoint`.
        allow_misaligned: Hand out views of tensors whose offset is not a multiple of their item
            size instead of copying them.
    """

    def __init__(self, path, *, allow_misaligned: bool = False):
        self.checkpoint = as_checkpoint(path)
        self._reader = core.MmapReader(self.checkpoint.index, allow_misaligned)
        if not allow_misaligned:
            warn_misaligned(self.checkpoint)

    def get(self, name: str) -> mx.array:
        """One tensor."""
        return self._reader.get(name)

    def load(self, names: Iterable[str] | None = None) -> dict[str, mx.array]:
        """Several tensors (all when ``names`` is None)."""
        return self._reader.load(check_names(self.checkpoint, names))

    def advise(self, name: str, hint: str) -> bool:
        """Page hint for one tensor's bytes; False when the kernel refused it.

        ``hint``: ``"sequential"``, ``"random"``, ``"normal"``, ``"willneed"``, ``"populate"``
        (read in and map now), ``"dontneed"`` (drop from this process) or ``"evict"`` (drop from
        the page cache)."""
        return self._reader.advise(name, hint)

    def advise_range(self, file: str, offset: int, length: int, hint: str) -> bool:
        """Page hint for a byte range of one of the checkpoint's files."""
        return self._reader.advise_range(
            self.checkpoint.files.index(os.fspath(file)), offset, length, hint
        )

    def prefetch(self, names: Iterable[str], hint: str = "populate") -> int:
        """Apply ``hint`` to ``names`` in the background; returns a ticket for :meth:`wait`."""
        return self._reader.prefetch(check_names(self.checkpoint, names), hint)

    def wait(self, ticket: int) -> None:
        """Block until a :meth:`prefetch` is done; raises its OSError, if any."""
        self._reader.wait(ticket)

    def drop(self, names: Iterable[str], *, evict: bool) -> None:
        """Drop ``names``' pages from this process and, with ``evict``, the page cache, in the
        background ahead of queued prefetches; returns at once."""
        self._reader.drop(check_names(self.checkpoint, names), evict)

    def settle(self) -> None:
        """Block until every :meth:`prefetch` and :meth:`drop` queued so far has run."""
        self._reader.settle()

    def resident_bytes(self, name: str) -> int:
        """Bytes of the tensor's pages currently in memory (page granular)."""
        return self._reader.resident_bytes(name)

    def check_unchanged(self) -> None:
        """``OSError`` (``ESTALE``) if a mapped file changed since its header was read."""
        self._reader.check_unchanged()

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


class PreadReader(_Reader):
    """Parallel chunked ``pread`` into fresh MLX-owned arrays.

    Args:
        path: A checkpoint path or an open :class:`Checkpoint`.
        threads: Reader threads (default: one per core; ignored by io_uring).
        chunk_bytes: Largest single read (default: the core's, 2 MiB).
        backend: ``"threads"`` or ``"io_uring"`` (needs liburing: :func:`pyloader.uring_available`).
        readahead: False reads exactly the requested ranges (no kernel readahead).
        drop_cache: Drop the ranges from the page cache once read.
        direct: Read uncached tensors of 1 MiB or more with direct I/O (default True).
    """

    def __init__(self, path, *, threads: int | None = None, chunk_bytes: int | None = None,
                 backend: str = "threads", readahead: bool = True, drop_cache: bool = False,
                 direct: bool = True):
        self.checkpoint = as_checkpoint(path)
        self._reader = core.PreadReader(self.checkpoint.index, threads or 0, chunk_bytes or 0,
                                         backend, readahead, drop_cache, direct)

    def load(self, names: Iterable[str] | None = None, *,
             reuse: bool = False) -> dict[str, mx.array]:
        """Read tensors (all when ``names`` is None), GIL released; ``reuse``: into a free
        buffer."""
        return self._reader.load(check_names(self.checkpoint, names), reuse)

    def submit(self, names: Iterable[str], *, reuse: bool = False) -> int:
        """Queue a background read of ``names``; returns a ticket for :meth:`take`."""
        return self._reader.submit(check_names(self.checkpoint, names), reuse)

    def take(self, ticket: int) -> dict[str, mx.array]:
        """Wait for a submitted read and return its arrays (raises its OSError)."""
        return self._reader.take(ticket)

    def reserve_buffers(self, slots: int, slot_bytes: int, *, direct: bool) -> None:
        """Keep ``slots`` reusable read buffers of ``slot_bytes``, committed now.

        Raises:
            AllocationError: the memory cannot be committed.
        """
        self._reader.reserve_buffers(slots, slot_bytes, direct)

    def layout_bytes(self, names: Iterable[str]) -> int:
        """The buffer bytes a read of ``names`` takes (each tensor on its own pages)."""
        return self._reader.layout_bytes(check_names(self.checkpoint, names))

    @property
    def buffer_slots(self) -> int:
        """Reusable buffers kept (:meth:`reserve_buffers`)."""
        return self._reader.buffer_slots

    @property
    def buffers_lent(self) -> int:
        """Reusable buffers some arrays still use."""
        return self._reader.buffers_lent

    @property
    def direct(self) -> bool:
        """Reads into the reusable buffers bypass the page cache (``O_DIRECT``)."""
        return self._reader.direct

    @property
    def threads(self) -> int:
        """Reader threads (1 with io_uring)."""
        return self._reader.threads

    @property
    def backend(self) -> str:
        """``"threads"`` or ``"io_uring"``."""
        return self._reader.backend


