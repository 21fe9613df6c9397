"""Layer streaming: the controller that owns a loaded model's weights.

:class:`StreamOptions` (:mod:`.options`) holds the settings; :class:`StreamingController`
(:mod:`.controller`) composes the parts (layout, layer units, call order, expert caches,
recording, memory plan); :func:`stream` (:mod:`.steps`) applies them to any model. This
package never imports heads or distributed. See docs/streaming.md and docs/architecture.md.
"""

from .controller import StreamingController, controller_of, stats, streams
from .expert_slots import POLICIES, RoutingTrace, simulate
from .experts import EXPERT_SOURCES, ExpertCache
from .layout import Layout
from .options import StreamOptions
from .resident import PLACEMENTS, Residency, choose_resident
from .sources import SourceMap, placeholder, source_map
from .steps import stream
from .timeline import Timeline, summarize
from .units import (
    GRANULARITIES,
    UNIT_KINDS,
    LayerEntry,
    Unit,
    UnitKind,
    UnitStats,
    block_patterns,
    select_units,
)

__all__ = [
    "EXPERT_SOURCES",
    "ExpertCache",
    "POLICIES",
    "RoutingTrace",
    "simulate",
    "GRANULARITIES",
    "LayerEntry",
    "Layout",
    "PLACEMENTS",
    "Residency",
    "SourceMap",
    "StreamOptions",
    "StreamingController",
    "Timeline",
    "UNIT_KINDS",
    "Unit",
    "UnitKind",
    "UnitStats",
    "block_patterns",
    "choose_resident",
    "controller_of",
    "placeholder",
    "select_units",
    "source_map",
    "stats",
    "stream",
    "streams",
    "summarize",
]
