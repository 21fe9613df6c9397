"""Every rank's memory for ``resident="auto"``: one ``all_gather`` of each rank's weight budget and
least need, checked the same way on every rank before anything is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from .._util.sizes import format_bytes
from ..streaming.preflight import RESERVE, auto_budget


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory as ``resident="auto"`` sees it (bytes).

    Attributes:
        budget: Its weight budget: headroom minus the pre-flight reserve.
        need: The least weight memory its share needs (:func:`least_need`).
    """

    rank: int
    budget: int
    need: int

    @property
    def headroom(self) -> int:
        return self.budget + RESERVE

    @property
    def fits(self) -> bool:
        return self.need <= self.budget


#: Sent in place of a budget by a rank without a memory probe.
_NO_PROBE = -(1 << 62)


def gather_memory(group, need: int) -> list[RankMemory]:
    """Every rank's :class:`RankMemory`, rank 0 first (a collective: every rank must call it)."""
    try:
        budget = auto_budget()
    except RuntimeError:
        budget = _NO_PROBE  # raised below, on every rank, after the collective
    rows = mx.distributed.all_gather(mx.array([[budget, need]], dtype=mx.int64),
                                     group=group, stream=mx.cpu).tolist()
    blind = [r for r, (b, _) in enumerate(rows) if b == _NO_PROBE]
    if blind:
        raise RuntimeError(f"rank {blind[0]}: resident='auto' needs a memory probe and "
                           "none is readable there (pass a byte budget per rank, e.g. "
                           "resident=['4GB', '6GB'])")
    return [RankMemory(r, int(b), int(n)) for r, (b, n) in enumerate(rows)]


def check_memory(memory: Sequence[RankMemory], what: str) -> None:
    """``MemoryError`` (the same on every rank) naming the first rank whose least need exceeds its
    budget; ``what`` names the load."""
    short = [m for m in memory if not m.fits]
    if not short:
        return
    m = short[0]
    every = "; ".join(f"rank {x.rank}: needs {format_bytes(x.need + RESERVE)}, has "
                      f"{format_bytes(x.headroom)}" for x in memory)
    raise MemoryError(
        f"rank {m.rank}: {what} with resident='auto' needs at least "
        f"{format_bytes(m.need + RESERVE)} (non-layer weights and streaming buffers "
        f"{format_bytes(m.need)}, reserve {format_bytes(RESERVE)}) but its headroom is "
        f"{format_bytes(m.headroom)}; nothing was loaded on any rank ({every}). Free "
        "memory on that rank, use more ranks or a smaller (quantized) checkpoint.")


def least_need(layer_bytes: Sequence[int], fixed_bytes: int, prefetch: int) -> int:
    """The least weight memory a share runs in: non-layer tensors plus layers or buffers."""
    if not layer_bytes:
        return fixed_bytes
    return fixed_bytes + min(sum(layer_bytes), (prefetch + 1) * max(layer_bytes))
