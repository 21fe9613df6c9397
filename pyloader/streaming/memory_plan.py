"""What an attach will hold in memory, checked before anything is read: the
pre-flight of a load, suggested settings when it does not fit, and the deepest prefetch that
fits (``prefetch="auto"``)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Iterable

from .._util.memory import MemorySnapshot, headroom_of, limiting_probe
from .._util.sizes import budget_text, format_bytes
from ..errors import ResidencyWarning
from ..io.checkpoint import TensorMeta
from ..io.readers import aligned_are_views
from .depth import fit_depth
from .layout import Layout
from .preflight import MemoryNeed, check, need_of
from .units import Unit

log = logging.getLogger(__name__)


@dataclass
class MemoryPlan:
    """The memory of one load of checkpoint ``what``: ``fixed`` (non-layer) tensors,
    the ``layout``'s resident layers, ``banks`` bytes of expert caches, all checked against
    one memory reading ``snap`` (the depth chosen is the depth checked)."""

    what: str
    strategy: str
    layout: Layout
    fixed: list[TensorMeta]
    banks: int
    snap: MemorySnapshot

    def need(self, strategy: str, resident_layers: Iterable[int], streamed: list[Unit],
             depth: int) -> MemoryNeed:
        """The pre-flight's need with ``resident_layers`` resident and ``streamed``
        units, ``depth`` of them prefetched."""
        lay = self.layout
        tensors = self.fixed + [t for i in resident_layers
                                for t in lay.layers[i].sources.values()]
        return need_of(strategy, tensors, [list(u.sources.values()) for u in streamed],
                       depth, lay.derived_bytes, self.banks)

    def fit_depth(self, want: int, units: list[Unit], granularity: str) -> int:
        """The deepest depth up to ``want`` whose units in flight fit the headroom."""
        depth = want
        available = headroom_of(self.snap, page_cache="reclaimable")
        if available is not None:
            resident = self.layout.resident
            depth = fit_depth(want, lambda d: self.need(
                self.strategy, resident, units, d).total <= available)
        log.info("prefetch='auto': depth %d (%d streamed %s units of %s to %s; the sizes "
                 "want %d)", depth, len(units), granularity,
                 format_bytes(min(u.nbytes for u in units)),
                 format_bytes(max(u.nbytes for u in units)), want)
        return depth

    def check(self, units: list[Unit], every: list[Unit], depth: int, buffers: int) -> None:
        """``MemoryError`` when the load cannot fit, naming settings that would; a
        :class:`pyloader.ResidencyWarning` when mmap's resident views would not stay resident."""
        lay, snap, need = self.layout, self.snap, self.need
        wanted = need(self.strategy, lay.resident, units, depth)
        available = headroom_of(snap, page_cache="reclaimable")
        if available is None:
            return
        if wanted.total <= available:
            if self.strategy == "mmap":
                mapped = self.fixed + [t for i in lay.resident
                                       for t in lay.layers[i].sources.values()]
                views = sum(t.nbytes for t in mapped if t.aligned) if aligned_are_views() else 0
                if views + wanted.total > available:
                    warnings.warn(ResidencyWarning(
                        f"{self.what}: the resident set maps "
                        f"{format_bytes(views)} of the checkpoint (page-cache views) beside "
                        f"{format_bytes(wanted.total)} of anonymous memory, but only "
                        f"{format_bytes(available)} are available "
                        f"({limiting_probe(snap, page_cache='reclaimable')}): these pages "
                        "are not resident, the kernel will evict and re-read them on every "
                        "pass (at a speed no plan predicts). A resident set that fits: resident="
                        f"'{budget_text(max(0, available - wanted.reserve))}', or "
                        "pyloader.residency.load_planned(path)."), stacklevel=5)
            return
        suggestions = []
        if self.strategy == "pread" and need("mmap", lay.resident, units, depth).total <= available:
            suggestions.append("strategy='mmap'")
        shallower = [d for d in (1, 0) if d < depth
                     and need(self.strategy, lay.resident, units, d).total <= available]
        if shallower:
            suggestions.append(f"prefetch={shallower[0]}")
        if lay.resident:
            floor = need(self.strategy, (), every, depth).total
            if floor <= available:
                # The most weights in memory at once that fit, as a resident= budget.
                budget = lay.fixed_bytes + buffers + (available - floor)
                suggestions.append(
                    f"resident='{budget_text(budget, floor=lay.fixed_bytes + buffers)}'")
        check(wanted, self.what, suggestions=suggestions, snap=snap)
