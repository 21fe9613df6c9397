"""The pre-flight of ``load_model``: will the load and the streaming after it fit in the
memory this process can still commit? Checked before anything is read or allocated,
so a budget that cannot fit is a ``MemoryError`` naming what is needed, what is
available and a setting that fits, never a kill by the kernel half way (under a memory
cgroup the kernel does not fail an allocation: it kills the process when the pages are
touched).

Counted (anonymous memory: what reclaim cannot take back):

* ``weights``: resident weights held in fresh buffers — every resident tensor with
  ``pread``; with ``mmap`` only the misaligned ones (copied; the aligned ones are views
  of the page cache, which the kernel can reclaim and read again) — plus parameters
  computed at load (``derived``);
* ``buffers``: the streamed units in flight, the one computing and ``prefetch`` more
  (their fresh buffers: every tensor with ``pread``, the copied ones with ``mmap``);
* ``experts``: the expert banks (``expert_source="bank"``), exactly as allocated;
* ``reserve``: :data:`RESERVE` for activations, MLX's buffer cache and the runtime's
  growth after loading.

Available: :func:`pyloader._util.memory.headroom_of` with the page cache counted as
reclaimable (``MemAvailable`` and the cgroup's ``limit - usage``).

``resident="auto"`` plans with the same headroom, page cache counted as used (as
``pyloader.residency.plan`` counts it): :func:`auto_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .._util.memory import MemorySnapshot, headroom_of, limiting_probe, read_memory
from .._util.sizes import format_bytes
from ..io.readers import aligned_are_views

#: Anonymous memory kept free beyond the weights and buffers: activations, MLX's buffer
#: cache, and what the process still allocates after loading (mlx-lm's generate and its
#: imports). Measured on a 1.5 GB llama streamed with pread in a 600 MB cgroup: peak
#: anonymous memory 133 MB above MLX's peak, MLX's peak 29 MB above the units in flight.
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


def auto_budget(snap: Optional[MemorySnapshot] = None) -> int:
    """The weight budget of ``resident="auto"``: this process's headroom (``headroom_of``,
    the page cache counted as used) minus :data:`RESERVE` (may be negative: nothing fits).

    Raises:
        RuntimeError: no memory probe is readable here (and ``PYLOADER_HEADROOM`` is
            unset); pass a byte budget instead.
    """
    head = headroom_of(snap or read_memory(), page_cache="used")
    if head is None:
        raise RuntimeError("resident='auto' needs a memory probe; none is readable here "
                           "(pass a byte budget, e.g. resident='4GB')")
    return head - RESERVE


def copied_bytes(strategy: str, tensors: Iterable) -> int:
    """Bytes of ``tensors`` (:class:`~pyloader.TensorMeta`) held in fresh buffers by
    ``strategy``: all of them with pread, the misaligned ones with mmap (all of them where
    this MLX copies mapped tensors: :func:`pyloader.io.readers.aligned_are_views`)."""
    if strategy == "pread" or not aligned_are_views():
        return sum(t.nbytes for t in tensors)
    return sum(t.nbytes for t in tensors if not t.aligned)


def need_of(strategy: str, resident_tensors: Iterable, unit_tensors: list[list],
            depth: int, derived: int = 0, experts: int = 0) -> MemoryNeed:
    """The :class:`MemoryNeed` of a load: ``resident_tensors`` (non-layer and resident
    layers' tensors), ``unit_tensors`` (each streamed unit's tensors), ``depth`` units
    prefetched ahead of the one computing."""
    per_unit = sorted((copied_bytes(strategy, ts) for ts in unit_tensors), reverse=True)
    in_flight = per_unit[:depth + 1]
    return MemoryNeed(strategy, copied_bytes(strategy, resident_tensors) + derived,
                      sum(in_flight), experts)


def check(need: MemoryNeed, what: str, *, suggestions: Optional[list[str]] = None,
          snap: Optional[MemorySnapshot] = None) -> None:
    """Raise ``MemoryError`` when ``need`` does not fit in what this process can still
    commit (from ``snap``, read now unless given); ``suggestions`` are settings that
    would fit, named in the message."""
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
