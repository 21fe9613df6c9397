"""Layer streaming: the controller that owns a loaded model's weights.

* :mod:`.options`: :class:`StreamOptions`, every streaming setting, checked once;
* :mod:`.controller`: :class:`StreamingController` (``attach``, ``restructuring``,
  ``build_units``, ``shed``, ``admit``, ``stats``, the timeline), composing the parts:

  * :mod:`.layout`: its typed :class:`Layout` (layers, sources, resident set, streamed
    units, reads in flight, expert caches);
  * :mod:`.layer_units`: the streamed units, their hooks, the per-unit protocol, shed and
    admit; :mod:`.strays`: units reached through their holders;
  * :mod:`.order`: the order units are called in, learned, and what prefetch requests;
  * :mod:`.expert_caches`: the MoE modules' caches;
  * :mod:`.recording`: the timeline being recorded;
  * :mod:`.memory_plan`: the pre-flight of a load and ``prefetch="auto"``'s depth;
* :mod:`.units`: which modules stream (:func:`select_units`: the decoder layers, or the
  modules a pattern names), what a streamed unit is, and the unit kinds (``"layer"``,
  ``"sublayer"``) behind one interface;
* :mod:`.steps`: :func:`stream`, the public steps composed for any model (docs/engines.md);
* :mod:`.experts`: expert caches for mixture-of-experts layers (only routed experts are
  read, into fixed slot banks) and routing traces; :mod:`.expert_slots`: their
  bookkeeping, policies and the simulator;
* :mod:`.reads`: how a unit's bytes come in and go out (mmap views or pread buffers);
* :mod:`.timeline`: the recorded timeline of every streamed unit and the reader threads
  (Chrome trace-event JSON); :mod:`.trace`: ``pyloader.trace``, which writes it (and a
  PNG summary) around a block of code;
* :mod:`.sources`: which checkpoint tensor each parameter comes from;
* :mod:`.resident`: which layers stay resident.

Models are loaded with :func:`pyloader.load_model` (:mod:`pyloader.loading`); this
package never imports the variants built on it (heads, distributed).
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
