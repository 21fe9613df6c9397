"""The pre-flight of ``load_model``: will the load and the streaming after it fit in
the memory this process can still commit? Checked before anything is read, so a load that
cannot fit is a ``MemoryError`` naming the need, the headroom and a setting that fits.
Counts anonymous memory: resident ``weights`` in fresh buffers, streaming ``buffers``,
expert ``banks``, and a ``reserve``. See docs/memory-planning.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .._util.memory import MemorySnapshot, headroom_of, limiting_probe, read_memory
from .._util.sizes import format_bytes
from ..io.readers import aligned_are_views

#: Anonymous memory kept free beyond weights and buffers: activations, MLX's buffer
#: cache, and what the process allocates after loading.
RESERVE = 160 << 20


@dataclass(frozen=True)
class MemoryNeed:
    """Anonymous bytes a load needs (see the module doc)."""

    strategy: str
    weights: int
    buffers: int
    experts: int = 0
    reserve: int = RESERVE

    @property
    def total(self) -> int:
        return self.weights + self.buffers + self.experts + self.reserve

    def describe(self) -> str:
        parts = [f"resident weights {format_bytes(self.weights)}",
                 f"streaming buffers {format_bytes(self.buffers)}"]
        if self.experts:
            parts.append(f"expert caches {format_bytes(self.experts)}")
        parts.append(f"reserve {format_bytes(self.reserve)}")
        return f"{format_bytes(self.total)} ({', '.join(parts)})"


def auto_budget(snap: MemorySnapshot | None = None) -> int:
    """The weight budget of ``resident="auto"``: the headroom (page cache counted as
    used) minus :data:`RESERVE`; may be negative.

    Raises:
        RuntimeError: no memory probe is readable (and ``PYLOADER_HEADROOM`` is unset).
    """
    head = headroom_of(snap or read_memory(), page_cache="used")
    if head is None:
        raise RuntimeError("resident='auto' needs a memory probe; none is readable here "
                           "(pass a byte budget, e.g. resident='4GB')")
    return head - RESERVE


def copied_bytes(strategy: str, tensors: Iterable) -> int:
    """Bytes of ``tensors`` held in fresh buffers by ``strategy``: all with pread,
    those mmap cannot view with mmap."""
    if strategy == "pread" or not aligned_are_views():
        return sum(t.nbytes for t in tensors)
    return sum(t.nbytes for t in tensors if not t.aligned)


def need_of(strategy: str, resident_tensors: Iterable, unit_tensors: list[list],
            depth: int, derived: int = 0, experts: int = 0) -> MemoryNeed:
    """The :class:`MemoryNeed` of a load with ``depth`` units prefetched."""
    per_unit = sorted((copied_bytes(strategy, ts) for ts in unit_tensors), reverse=True)
    in_flight = per_unit[:depth + 1]
    return MemoryNeed(strategy, copied_bytes(strategy, resident_tensors) + derived,
                      sum(in_flight), experts)


def check(need: MemoryNeed, what: str, *, suggestions: list[str] | None = None,
          snap: MemorySnapshot | None = None) -> None:
    """Raise ``MemoryError`` when ``need`` does not fit what this process can still
    commit; ``suggestions`` (settings that would fit) are named in the message."""
    snap = snap or read_memory()
    available = headroom_of(snap, page_cache="reclaimable")
    if available is None or need.total <= available:
        return
    hint = (f" Settings that fit: {'; '.join(suggestions)}." if suggestions
            else " No setting of this model fits: free memory or raise the limit.")
    raise MemoryError(
        f"{what}: strategy={need.strategy!r} needs {need.describe()} of anonymous memory "
        f"but only {format_bytes(available)} are available "
        f"({limiting_probe(snap, page_cache='reclaimable')}); nothing was loaded.{hint}")
