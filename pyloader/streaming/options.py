"""How a model streams: every setting of the controller in one typed object,
checked where it is built (``ValueError`` naming the setting before any file is opened).
See docs/streaming.md."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .depth import AUTO, check_prefetch
from .expert_slots import POLICIES
from .experts import EXPERT_SOURCES, LAYER
from .resident import ALL, PLACEMENTS, Residency
from .units import GRANULARITIES, check_patterns

STRATEGIES = ("mmap", "pread")
READ_BACKENDS = ("threads", "io_uring")


@dataclass(frozen=True)
class StreamOptions:
    """The streaming settings of one model (``load_model(path, options=...)``,
    ``StreamingController(ckpt, options)``). See docs/streaming.md for each setting.

    Attributes:
        strategy: ``"mmap"`` or ``"pread"``.
        resident: Layers kept in memory, parsed into a :class:`.resident.Residency`: a count
            (int, ``"4layers"``), a fraction (float, ``"50%"``, ``"all"``), a byte budget
            (``"600MB"``), a set of layer indices, ``"auto"`` (the headroom at load, see
            :func:`pyloader.streaming.preflight.auto_budget`), or per rank with a
            distributed group. The int ``1`` keeps one layer and warns
            (:class:`pyloader.ResidencyWarning`); a bare number in a str raises ValueError.
            Non-layer weights are always resident.
        placement: ``"first_n"``, ``"last_n"`` or ``"interleaved"``.
        granularity: ``"layer"`` or ``"sublayer"`` (attention and MLP stream separately).
        prefetch: Units to bring in ahead (0: none), or ``"auto"``
            (:mod:`pyloader.streaming.depth`).
        keep_page_cache: Keep released units in the page cache.
        read_backend: pread only: ``"threads"`` or ``"io_uring"``.
        experts: ``"layer"`` (default) or an expert cache size: slots (int), a fraction of
            each layer's experts (float) or a byte budget for all caches (str).
        expert_policy: ``"lru"`` or ``"lfu"``.
        expert_source: ``"bank"`` (default) or ``"mmap"`` (needs an aligned checkpoint).
        overlap: Return while resident weights are still being read; each array waits for
            its own bytes when evaluated (a failed read raises there). Default False.
        units: Which modules are the streamed layers
            (:func:`pyloader.streaming.units.select_units`), kept as a tuple.
    """

    strategy: str = "mmap"
    resident: Residency | Any = ALL
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
        # The one place a resident set is parsed: every reader below gets the typed value.
        object.__setattr__(self, "resident", Residency.parse(self.resident))

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
