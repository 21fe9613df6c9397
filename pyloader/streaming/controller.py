"""The streaming controller: which layers of a model are resident, which stream, and how.

:class:`StreamingController` owns a loaded model's weights: :meth:`~StreamingController.attach`
loads the resident set and hooks every streamed unit; :meth:`~StreamingController.shed` and
:meth:`~StreamingController.admit` are the only way a model's residency changes. A fully
resident model has no hooked module. See docs/streaming.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from .._util.hooks import attach_handle, handle_of
from .._util.host import process_memory
from .._util.memory import read_memory
from ..io.checkpoint import Checkpoint, TensorMeta
from .depth import AUTO, wanted_depth
from .expert_caches import ExpertCaches
from .layer_units import LayerUnits
from .layout import Layout, layer_of
from .memory_plan import MemoryPlan
from .options import StreamOptions
from .reads import UnitReads, make_reads
from .recording import Recorder
from .resident import choose_resident
from .sources import stand_in
from .timeline import DEFAULT_MAX_EVENTS, Timeline
from .units import UNIT_KINDS, LayerEntry, Unit, select_units

log = logging.getLogger(__name__)


class StreamingController:
    """Brings the streamed units of ``ckpt``'s model in before they run and releases
    them after, as ``options`` say (``resident``, ``placement``, ``overlap`` apply at
    :meth:`attach`, which sets ``layout`` and ``layer_units``)."""

    def __init__(self, ckpt: Checkpoint, options: StreamOptions | None = None):
        opts = StreamOptions() if options is None else options
        self.options = opts
        self.checkpoint = ckpt
        self.strategy = opts.strategy
        self.prefetch = opts.prefetch
        self.granularity = opts.granularity
        self.kind = UNIT_KINDS[opts.granularity]
        self.reads: UnitReads = make_reads(ckpt, opts.strategy, opts.keep_page_cache,
                                           opts.read_backend)
        # One caller at a time runs a streamed unit or an expert cache.
        self.lock = threading.RLock()
        self.expert_caches = ExpertCaches(ckpt, opts, self.reads, self.lock)
        self.recorder = Recorder(self.reads)
        self.layout: Layout | None = None
        self.layer_units: LayerUnits | None = None
        self.load_s = 0.0
        self._depth = 1 if opts.prefetch == AUTO else opts.prefetch  # "auto": set by attach

    @property
    def depth(self) -> int:
        """The prefetch depth in effect (``"auto"`` resolved by :meth:`attach`)."""
        return self._depth if self.layer_units is None else self.layer_units.depth

    @property
    def passes(self) -> int:
        """Passes begun (:mod:`.order`: each call of the cycle's first unit)."""
        return 0 if self.layer_units is None else self.layer_units.order.passes

    @property
    def timeline(self) -> Timeline | None:
        """The :class:`.timeline.Timeline` being recorded, or None."""
        return self.recorder.timeline

    @property
    def keep_page_cache(self) -> bool:
        """Released units stay in the page cache (settable between passes with mmap)."""
        return self.reads.keep_page_cache

    @keep_page_cache.setter
    def keep_page_cache(self, value: bool) -> None:
        self.reads.keep_page_cache = value

    def attach(self, model: nn.Module, direct: dict[str, TensorMeta],
               derived: dict[str, mx.array] | None = None, *,
               started: float | None = None, strict: bool = True) -> None:
        """Put ``model``'s weights in place: non-layer weights, ``derived`` arrays (kept
        resident) and the resident layers now, every other layer streamed. ``direct``:
        parameter -> checkpoint tensor; ``started``: ``time.perf_counter()`` at the load's
        start; ``strict``: every parameter in ``direct`` or ``derived``. With
        ``options.overlap`` it returns while resident weights are still being read."""
        t0 = time.perf_counter() if started is None else started
        derived = derived or {}
        lay, fixed = self._lay_out(model, select_units(model, self.options.units), direct,
                                   derived)
        units, every = self._units(lay)
        # Called from here: its warnings name the line that called load_model.
        lay.resident = choose_resident(lay.layer_bytes, self.options.resident,
                                       self.options.placement, lay.fixed_bytes,
                                       self._buffers(lay, units.depth))
        streamed = [u for u in every if u.layer not in lay.resident]
        self._check_memory(lay, fixed, units, streamed, every)
        self._load(model, direct, derived, streamed, strict)
        self.load_s = time.perf_counter() - t0
        attach_handle(model).controller = self

    def _lay_out(self, model: nn.Module, modules: list[nn.Module],
                 direct: dict[str, TensorMeta], derived: dict[str, mx.array]
                 ) -> tuple[Layout, list[TensorMeta]]:
        """The layout of ``model`` (layers ``modules``), and the non-layer tensors."""
        paths = {id(m): name for name, m in model.named_modules()}
        layers = [LayerEntry(i, paths[id(m)], m, {}) for i, m in enumerate(modules)]
        if not layers:
            log.info("%s has no list of decoder layers: every weight is resident",
                     type(model).__name__)
        owner = {layer.path: layer for layer in layers}
        fixed = []
        for param, t in direct.items():
            layer = layer_of(param, owner)
            if layer is None:
                fixed.append(t)
            else:
                layer.sources[param] = t
        lay = Layout(layers, dict(direct), fixed_bytes=sum(t.nbytes for t in fixed),
                     derived_bytes=sum(a.nbytes for a in derived.values()))
        self.layout = lay
        if self.expert_caches.enabled:
            self.expert_caches.find(lay.layers, derived)
        return lay, fixed

    def _units(self, lay: Layout) -> tuple[LayerUnits, list[Unit]]:
        """The streamed units' part, its depth, and every layer's units."""
        units = LayerUnits(lay, self.reads, self.kind, self._depth, self.lock, self.recorder)
        self.layer_units = units
        every = units.build(range(len(lay.layers)))  # each layer's units, in order
        if self.prefetch == AUTO:
            units.depth = wanted_depth([u.nbytes for u in every])
        return units, every

    @staticmethod
    def _buffers(lay: Layout, depth: int) -> int:
        """Streaming holds the unit computing and ``depth`` more being read."""
        lb = lay.layer_bytes
        return (depth + 1) * max(lb) if lb else 0

    def _check_memory(self, lay: Layout, fixed: list[TensorMeta], units: LayerUnits,
                      streamed: list[Unit], every: list[Unit]) -> None:
        """Lower ``prefetch="auto"``'s depth to what fits; check the load against memory."""
        plan = MemoryPlan(str(self.checkpoint.path), self.strategy, lay, fixed,
                          self.expert_caches.bank_bytes, read_memory())
        buffers = self._buffers(lay, units.depth)  # what choose_resident budgeted
        if self.prefetch == AUTO and streamed:
            units.depth = plan.fit_depth(units.depth, streamed, self.granularity)
        plan.check(streamed, every, units.depth, buffers)

    def _load(self, model: nn.Module, direct: dict[str, TensorMeta],
              derived: dict[str, mx.array], units: list[Unit], strict: bool) -> None:
        """Read the resident weights into ``model`` and start streaming ``units``."""
        lay, experts, overlap = self.layout, self.expert_caches, self.options.overlap
        lay.experts = experts.build(self.keep_page_cache)
        expert_params = experts.params
        streamed = {f"{u.name}.{p}" for u in units for p in u.sources}
        weights = self.reads.initial_weights(
            {p: t for p, t in direct.items() if p not in expert_params}, streamed, overlap)
        # load_weights checks shapes: stacked experts pass as full-shape stand-ins first.
        weights.update({p: stand_in(direct[p]) for p in expert_params})
        weights.update(derived)
        model.load_weights(list(weights.items()), strict=strict)
        experts.place()
        if self.strategy == "pread" and not overlap:
            mx.eval([w for p, w in weights.items()
                     if p not in streamed and p not in expert_params])
        del weights
        if derived:
            log.info("%d parameters computed outside the checkpoint are kept resident "
                     "(%d bytes)", len(derived), lay.derived_bytes)
        self.layer_units.stream(units)
        experts.install()

    def restructuring(self, model: nn.Module):
        """Context manager around a change that wraps modules of the attached ``model``,
        each kept as a child (e.g. LoRA layers); read parameters are found again at their
        new paths. ValueError with expert caches, or when a module that held read
        parameters has left the model."""
        if self.layout is None:
            raise ValueError("restructuring() needs an attached model")
        if self.layout.experts:
            raise ValueError("a model with expert caches (experts=...) cannot be "
                             "restructured: load it with experts='layer'")
        return self.layer_units.restructuring(model)

    def in_memory(self, model: nn.Module) -> list[mx.array]:
        """The attached ``model``'s parameters that hold data (not stand-ins)."""
        return self.layer_units.in_memory(model)

    def routing_trace(self):
        """Context manager recording every expert cache's routing."""
        return self.expert_caches.routing_trace()

    def shed(self, layers: Iterable[int]) -> int:
        """Stream resident layers (between forward passes); returns the bytes released."""
        return self.layer_units.shed(layers)

    def admit(self, layers: Iterable[int]) -> int:
        """Turn streamed layers back into resident ones (loaded now); returns the bytes."""
        return self.layer_units.admit(layers)

    def settle(self) -> None:
        """Block until released units' pages are gone (from the page cache unless kept)."""
        self.reads.settle()

    def close(self) -> None:
        """Cancel outstanding requests (their buffers are freed)."""
        self.layer_units.close()

    def drain(self) -> None:
        """Cancel queued requests and wait out the running one."""
        self.layer_units.drain()

    def stats(self) -> dict[str, Any]:
        """Counters of every streamed unit and their totals (see :func:`pyloader.stats`)."""
        memory = {"peak_memory": mx.get_peak_memory(), "active_memory": mx.get_active_memory()}
        memory.update(process_memory().as_status())  # None where not reported
        return {
            "strategy": self.strategy,
            "prefetch": self.depth,
            "prefetch_setting": self.prefetch,
            "granularity": self.granularity,
            "load_s": self.load_s,
            **self.layer_units.stats(),
            "reader": self.reads.stats(),
            **({"experts": self.expert_caches.stats()} if self.layout.experts else {}),
            **memory,
        }

    def start_timeline(self, max_events: int = DEFAULT_MAX_EVENTS) -> Timeline:
        """Start recording :attr:`timeline` between forward passes (RuntimeError if one
        is being recorded; :func:`pyloader.trace` wraps this)."""
        lay = self.layout
        meta = {"checkpoint": str(self.checkpoint.path), "strategy": self.strategy,
                "prefetch": self.depth, "prefetch_setting": self.prefetch,
                "granularity": self.granularity,
                "keep_page_cache": self.keep_page_cache,
                "resident_layers": sorted(lay.resident),
                "units": [{"name": u.name, "layer": u.layer, "bytes": u.nbytes}
                          for u in lay.units]}
        return self.recorder.start(meta, max_events)

    def stop_timeline(self) -> Timeline | None:
        """Stop recording; returns the timeline recorded (None if none was)."""
        return self.recorder.stop()


def controller_of(model: nn.Module) -> StreamingController:
    """The controller of a model from :func:`pyloader.load_model` (ValueError otherwise)."""
    h = handle_of(model)
    if h is None or h.controller is None:
        raise ValueError("this model was not loaded by pyloader.load_model")
    return h.controller


def streams(model: nn.Module) -> bool:
    """True when pyloader streams some of the model's weights."""
    h = handle_of(model)
    return bool(h is not None and h.controller is not None and h.controller.layout.units)


def stats(model: nn.Module) -> dict[str, Any]:
    """Streaming counters of a model from :func:`pyloader.load_model`: per unit and
    totals, reader byte counters, and process memory (every key present, None where the
    platform does not report it). See docs/streaming.md."""
    return controller_of(model).stats()
