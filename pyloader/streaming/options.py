"""How a model streams: every setting of the controller in one typed, checked object.

:class:`StreamOptions` is built once where a setting enters pyloader (``load_model``, the
CLI, an engine's own code) and is checked there: a wrong value raises ``ValueError`` naming
the setting before any file is opened. The controller and the loaders read its fields and
never parse a setting again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .depth import AUTO, check_prefetch
from .experts import EXPERT_SOURCES, LAYER, POLICIES
from .resident import PLACEMENTS
from .units import GRANULARITIES, check_patterns

STRATEGIES = ("mmap", "pread")
READ_BACKENDS = ("threads", "io_uring")


@dataclass(frozen=True)
class StreamOptions:
    """The streaming settings of one model.

    Attributes:
        strategy: ``"mmap"`` or ``"pread"``: where streamed (and resident) weights come from.
        resident: Layers kept in memory (see :func:`pyloader.load_model`): a fraction,
            a count, a byte budget, a set of layer indices, or ``"auto"``.
        placement: Which layers are resident: ``"first_n"``, ``"last_n"``,
            ``"interleaved"``.
        granularity: ``"layer"`` or ``"sublayer"``: the streamed unit.
        prefetch: Units requested ahead of the running one (0: none) or ``"auto"``.
        keep_page_cache: Keep released units in the page cache.
        read_backend: pread: ``"threads"`` or ``"io_uring"``.
        experts: ``"layer"`` or an expert cache size (slots per layer, a fraction of each
            layer's experts, or a byte budget).
        expert_policy: ``"lru"`` or ``"lfu"``.
        expert_source: ``"bank"`` or ``"mmap"``.
        overlap: Return while the resident weights are still being read.
        units: Which modules are the streamed layers
            (:func:`pyloader.streaming.units.select_units`): None (the model's decoder
            layers), a pattern over module paths (``"decoder.blocks.*"``, ``*`` = one
            path component) or a sequence of patterns whose lists are concatenated in
            the order given (kept as a tuple). Whether each pattern matches is checked
            when the controller attaches to a model.
    """

    strategy: str = "mmap"
    resident: Any = 1.0
    placement: str = "first_n"
    granularity: str = "layer"
    prefetch: int | str = AUTO
    keep_page_cache: bool = False
    read_backend: str = "threads"
    experts: Any = LAYER
    expert_policy: str = "lru"
    expert_source: str = "bank"
    overlap: bool = False
    units: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        patterns = check_patterns(self.units)
        if patterns is not None and not isinstance(self.units, str):
            object.__setattr__(self, "units", patterns)  # a list given: frozen as a tuple
        _one_of("strategy", self.strategy, STRATEGIES)
        _one_of("placement", self.placement, PLACEMENTS)
        _one_of("granularity", self.granularity, GRANULARITIES)
        check_prefetch(self.prefetch)
        _one_of("read_backend", self.read_backend, READ_BACKENDS)
        _one_of("expert_policy", self.expert_policy, tuple(POLICIES))
        _one_of("expert_source", self.expert_source, EXPERT_SOURCES)
        if isinstance(self.resident, (list, tuple)) and AUTO in self.resident:
            raise ValueError("resident='auto' gathers every rank's headroom: pass it alone, "
                             "not in a per-rank list")

    def with_(self, **changes: Any) -> StreamOptions:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)

    @property
    def caches_experts(self) -> bool:
        """Mixture-of-experts modules read only their routed experts into caches."""
        return self.experts != LAYER


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
