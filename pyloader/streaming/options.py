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
from .expert_slots import POLICIES
from .experts import EXPERT_SOURCES, LAYER
from .resident import ALL, PLACEMENTS, Residency
from .units import GRANULARITIES, check_patterns

STRATEGIES = ("mmap", "pread")
READ_BACKENDS = ("threads", "io_uring")


@dataclass(frozen=True)
class StreamOptions:
    """The streaming settings of one model (``load_model(path, options=...)``,
    ``StreamingController(ckpt, options)``).

    Attributes:
        strategy: ``"mmap"`` or ``"pread"``: where streamed (and resident) weights come from.
        resident: Layers kept in memory, parsed once into a :class:`.resident.Residency`:
            a count (int, or a str with its unit: ``"4layers"``), a fraction (float in
            [0, 1], or ``"50%"``, ``"all"``), a byte budget for all weights (a str with
            its unit: ``"600MB"``, ``"4096B"``), a set of layer indices (e.g.
            ``pyloader.residency.plan(...).resident_layers``), ``"auto"``, or with a
            distributed group a list with one value per rank. ``1`` (the int) keeps ONE
            layer and warns (:class:`pyloader.ResidencyWarning`) that every layer is
            ``1.0`` or ``"all"`` (``"1layer"`` says one layer without the warning); a
            bare number in a str (``"3"``: layers or bytes?) raises ValueError.
            ``"auto"`` is a byte budget of this process's headroom at load, page cache
            counted as used, minus the pre-flight reserve
            (:func:`pyloader.streaming.preflight.auto_budget`; ``PYLOADER_HEADROOM``
            clamps the headroom). With a group, every rank measures its own and the
            budgets are gathered: pipeline sharding without a ``split`` chooses the split
            from them (``distributed.plan_split(path, "auto", group=)``, the same on every
            rank) and each rank keeps what its own budget holds; tensor sharding applies
            the smallest rank's budget on every rank (tensor ranks must stream the same
            layers; per-rank lists must then be equal). A rank that cannot fit makes every
            rank raise ``MemoryError`` before anything is read. Non-layer weights
            (embeddings, final norm, lm_head) are always resident. The layers are
            ``model.layers``, or for a model without it the longest list of same-type
            modules; a model with neither is loaded fully resident.
        placement: Which layers are resident: ``"first_n"``, ``"last_n"`` or
            ``"interleaved"`` (spread evenly).
        granularity: ``"layer"`` streams whole layers; ``"sublayer"`` streams each
            layer's attention and MLP blocks separately (small norms stay resident).
        prefetch: How many streamed units ahead to bring in while the current one
            computes (0 disables prefetching), or ``"auto"`` (the default): the depth
            the units' sizes call for (1 for layers, deeper where units alternate in
            size, as at ``granularity="sublayer"``), lowered to what fits the memory
            headroom; ``pyloader.stats(model)["prefetch"]`` tells the depth chosen
            (:mod:`pyloader.streaming.depth`).
        keep_page_cache: Keep released units in the page cache (drop them from this
            process only).
        read_backend: pread only: ``"threads"`` or ``"io_uring"``.
        experts: Mixture-of-experts models: ``"layer"`` (default) streams experts with
            their layer; otherwise each MoE module reads only the experts its tokens route
            to into a fixed cache (:mod:`pyloader.streaming.experts`): slots per layer
            (int), a fraction of each layer's experts (float in (0, 1]) or a byte budget
            for every cache together (str). The rest of each layer follows ``resident``.
        expert_policy: The expert caches' eviction policy: ``"lru"`` or ``"lfu"``.
        expert_source: Where cached experts live: ``"bank"`` (default: fixed slots read
            with parallel pread) or ``"mmap"`` (page-cache views of the stacked tensors,
            each expert's pages populated when it enters and dropped when it leaves; needs
            an aligned checkpoint, see ``pyloader repack``).
        overlap: Return while the resident weights are still being read, in file order,
            in the background, so the reads overlap the first forward pass: with
            ``"pread"`` each array waits for its own tensor's bytes when evaluated (a
            failed read raises its ``OSError`` there), with ``"mmap"`` the views' pages
            are populated in the background (a fault brings in what is not there yet).
            ``lazy`` is then moot: nothing waits for the resident weights at load.
            Default False: every resident byte is in when ``load_model`` returns
            (docs/loading.md says when each wins).
        units: Which modules are the streamed layers
            (:func:`pyloader.streaming.units.select_units`): None (the model's decoder
            layers), a pattern over module paths (``"decoder.blocks.*"``, ``*`` = one
            path component) or a sequence of patterns whose lists are concatenated in
            the order given (kept as a tuple). Whether each pattern matches is checked
            when the controller attaches to a model.
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
