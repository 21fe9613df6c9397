"""Layer streaming: the controller that owns a loaded model's weights.

* :mod:`.options`: :class:`StreamOptions`, every streaming setting, checked once;
* :mod:`.controller`: :class:`StreamingController` and its typed :class:`Layout`
  (layers, sources, resident set, streamed units, reads in flight); ``attach``,
  ``build_units``, ``shed``, ``admit``, ``stats``;
* :mod:`.units`: what a streamed unit is, and the unit kinds (``"layer"``,
  ``"sublayer"``) behind one interface;
* :mod:`.experts`: expert caches for mixture-of-experts layers (only routed experts are
  read, into fixed slot banks), their policies, routing traces and the simulator;
* :mod:`.reads`: how a unit's bytes come in and go out (mmap views or pread buffers);
* :mod:`.timeline`: the recorded timeline of every streamed unit and the reader threads
  (Chrome trace-event JSON); :mod:`.trace`: ``pyloader.trace``, which writes it (and a
  PNG summary) around a block of code;
* :mod:`.sources`: which checkpoint tensor each parameter comes from;
* :mod:`.resident`: which layers stay resident.

Models are loaded with :func:`pyloader.load_model` (:mod:`pyloader.loading`); this
package never imports the variants built on it (heads, distributed).
"""

from .controller import Layout, StreamingController, controller_of, stats, streams
from .experts import EXPERT_SOURCES, POLICIES, ExpertCache, RoutingTrace, simulate
from .options import StreamOptions
from .resident import PLACEMENTS, Residency, choose_resident
from .sources import SourceMap, placeholder, source_map
from .timeline import Timeline, summarize
from .units import GRANULARITIES, UNIT_KINDS, LayerEntry, Unit, UnitKind, UnitStats

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
    "choose_resident",
    "controller_of",
    "placeholder",
    "source_map",
    "stats",
    "streams",
    "summarize",
]
