"""The streaming controller: which layers of a model are resident, which stream, and how.

:class:`StreamingController` owns a loaded model's weights. :meth:`~StreamingController.attach`
loads the resident set and hooks every streamed unit (a layer, or with
``granularity="sublayer"`` each of its attention and MLP blocks): the unit is brought in
just before it runs and released right after, while the next units are requested in the
background. :meth:`~StreamingController.shed` and :meth:`~StreamingController.admit` move
layers between resident and streamed on a live model; they are the only way anything
changes a model's residency. Its state is the typed :class:`Layout`.

How a unit is hooked: a ``"stream"`` hook on its module (:func:`pyloader._util.hooks.add_hook`)
wraps ``__call__`` while ``isinstance`` and every attribute stay as they were, so mlx-lm's
generate, batch_generate, prompt caches and speculative decoding drive the model
unchanged. A model with every layer resident has no hooked module at all: it is exactly
the mlx-lm model. How bytes come in and go out: :mod:`.reads`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .._native import core
from .._util.hooks import add_hook, attach_handle, handle_of, remove_hook
from .._util.memory import MemorySnapshot, headroom_of, limiting_probe, read_memory
from .._util.host import process_memory
from .._util.sizes import budget_text, format_bytes
from ..errors import ResidencyWarning
from ..io.checkpoint import Checkpoint, TensorMeta
from ..io.readers import MmapReader, aligned_are_views
from .experts import (
    COUNTERS as EXPERT_COUNTERS,
)
from .experts import (
    LAYER,
    BankExperts,
    ExpertCache,
    MappedExperts,
    cache_memory,
    cache_slots,
    expert_modules,
    routing_trace,
    totals,
)
from .experts import (
    HOOK as EXPERT_HOOK,
)
from .depth import AUTO, fit_depth, wanted_depth
from .options import StreamOptions
from .preflight import check, need_of
from .reads import UnitReads, make_reads
from .resident import choose_resident
from .sources import stand_in
from .timeline import DEFAULT_MAX_EVENTS, Timeline
from .units import UNIT_KINDS, LayerEntry, Unit, decoder_layers

log = logging.getLogger(__name__)

_HOOK = "stream"
_GUARD = "guard"


@dataclass
class Layout:
    """What the controller knows about its model. Other modules read it; only the
    controller changes it.

    Attributes:
        layers: Every decoder layer, in ``model.layers`` order.
        sources: Every parameter read from the checkpoint → its tensor.
        fixed_bytes: Non-layer weights (embeddings, final norm, head): always resident.
        derived_bytes: Parameters not read from the checkpoint (computed by ``sanitize``,
            or given by the caller, such as a bundle's head): always resident.
        resident: Indices of the layers kept in memory.
        units: The streamed units, in execution order.
        in_flight: Reads requested ahead of use: unit → the read path's ticket.
        experts: The expert caches (``StreamOptions(experts=...)``), one per MoE module; their
            stacked tensors are not part of the layers' sources or bytes.
    """

    layers: list[LayerEntry]
    sources: dict[str, TensorMeta]
    fixed_bytes: int = 0
    derived_bytes: int = 0
    resident: set[int] = field(default_factory=set)
    units: list[Unit] = field(default_factory=list)
    in_flight: dict[Unit, int] = field(default_factory=dict)
    experts: list[ExpertCache] = field(default_factory=list)

    @property
    def layer_bytes(self) -> list[int]:
        """Bytes of each layer's weights."""
        return [layer.nbytes for layer in self.layers]

    @property
    def expert_bank_bytes(self) -> int:
        """Memory of the expert caches' banks (always resident)."""
        return sum(c.memory_bytes for c in self.experts)

    @property
    def resident_bytes(self) -> int:
        """Weights kept in memory: non-layer, derived, resident layers and expert banks."""
        return (self.fixed_bytes + self.derived_bytes + self.expert_bank_bytes
                + sum(self.layers[i].nbytes for i in self.resident))

    @property
    def streamed_layers(self) -> list[int]:
        """Indices of the layers that stream."""
        return [i for i in range(len(self.layers)) if i not in self.resident]


class StreamingController:
    """Brings streamed units in before they run and releases them after.

    Args:
        ckpt: The checkpoint the weights come from.
        options: The streaming settings (:class:`.options.StreamOptions`, checked when
            built); ``resident``, ``placement`` and ``overlap`` apply at :meth:`attach`.
            ``keep_page_cache`` stays settable between forward passes with mmap.

    Attributes:
        prefetch: The setting (an int or ``"auto"``).
        depth: The prefetch depth in effect (``"auto"`` resolved by :meth:`attach`).
        timeline: The :class:`.timeline.Timeline` being recorded
            (:meth:`start_timeline`, :func:`pyloader.trace`); None when not recording, and
            the per-unit protocol then records nothing.
    """

    def __init__(self, ckpt: Checkpoint, options: StreamOptions | None = None):
        opts = StreamOptions() if options is None else options
        self.options = opts
        self.checkpoint = ckpt
        self.strategy = opts.strategy
        self.prefetch = opts.prefetch
        self.depth = 1 if opts.prefetch == AUTO else opts.prefetch  # "auto": set by attach
        self.granularity = opts.granularity
        self.kind = UNIT_KINDS[opts.granularity]
        self.reads: UnitReads = make_reads(ckpt, opts.strategy, opts.keep_page_cache,
                                           opts.read_backend)
        self.experts = opts.experts
        self.expert_policy = opts.expert_policy
        self.expert_source = opts.expert_source
        self.expert_reader = None
        if opts.caches_experts:
            self.expert_reader = (
                core.ExpertReader(ckpt.index, backend=opts.read_backend,
                                  drop_cache=not opts.keep_page_cache)
                if opts.expert_source == "bank" else
                self.reads.reader if isinstance(self.reads.reader, MmapReader)
                else MmapReader(ckpt))
        self.layout: Layout | None = None
        self.passes = 0
        self.load_s = 0.0
        self.timeline: Timeline | None = None
        # One caller at a time runs a streamed unit or an expert cache: a unit's
        # bytes are in for exactly one call, a bank's slots serve one routing.
        self.lock = threading.RLock()
        self._stray: Unit | None = None  # a unit brought in by one of its holders
        self._stray_out: list = []       # what its holders' calls returned
        self._stray_thread = 0
        self._armed: set[Unit] = set()

    @property
    def keep_page_cache(self) -> bool:
        """Released units stay in the page cache (settable between passes with mmap;
        pread fixes it at construction)."""
        return self.reads.keep_page_cache

    @keep_page_cache.setter
    def keep_page_cache(self, value: bool) -> None:
        self.reads.keep_page_cache = value

    # -- building ---------------------------------------------------------------

    def attach(self, model: nn.Module, direct: dict[str, TensorMeta],
               derived: dict[str, mx.array] | None = None, *,
               started: float | None = None, strict: bool = True) -> None:
        """Put ``model``'s weights in place: non-layer weights, ``derived`` arrays and the
        resident layers (chosen by :func:`.resident.choose_resident`) now, every other
        layer streamed; the model's handle then points here.

        Args:
            direct: Every parameter to read → its checkpoint tensor.
            derived: Parameters given as arrays (kept resident).
            started: ``time.perf_counter()`` when the load began (``stats()["load_s"]``
                counts from it; default: now).
            strict: Every parameter of the model must be in ``direct`` or ``derived``
                (False: the others keep the values the model was built with).

        ``options.overlap``: return while the resident weights are still being read (see
        :meth:`UnitReads.initial_weights`); the first forward pass waits for each tensor
        as it reaches it.
        """
        t0 = time.perf_counter() if started is None else started
        resident, placement = self.options.resident, self.options.placement
        overlap = self.options.overlap
        derived = derived or {}
        paths = {id(m): name for name, m in model.named_modules()}
        layers = [LayerEntry(i, paths[id(m)], m, {})
                  for i, m in enumerate(decoder_layers(model))]
        if not layers:
            log.info("%s has no list of decoder layers: every weight is resident",
                     type(model).__name__)
        owner = {layer.path: layer for layer in layers}
        fixed = []  # non-layer tensors
        for param, t in direct.items():
            layer = _owner(param, owner)
            if layer is None:
                fixed.append(t)
            else:
                layer.sources[param] = t
        lay = Layout(layers, dict(direct), fixed_bytes=sum(t.nbytes for t in fixed),
                     derived_bytes=sum(a.nbytes for a in derived.values()))
        self.layout = lay
        found, slots = self._find_experts(derived) if self.experts != LAYER else ([], [])
        expert_params = {f"{path}.{p}" for path, _, _, src, _ in found for p in src}
        lb = lay.layer_bytes
        banks = (sum(cache_memory("bank", strides, n)
                     for (_, _, _, _, strides), n in zip(found, slots))
                 if self.expert_source == "bank" else 0)
        every = self.build_units(range(len(lay.layers)))  # each layer's units, in order
        if self.prefetch == AUTO:
            self.depth = wanted_depth([u.nbytes for u in every])
        # Streaming holds the unit computing and `depth` more being read.
        buffers = (self.depth + 1) * max(lb) if lb else 0
        lay.resident = choose_resident(lb, resident, placement, lay.fixed_bytes, buffers)
        units = [u for u in every if u.layer not in lay.resident]
        snap = read_memory()  # one reading: the depth chosen is the depth checked
        if self.prefetch == AUTO and units:
            self._fit_depth(units, fixed, banks, snap)
        self._preflight(units, every, fixed, banks, buffers, snap)
        lay.experts = self._make_expert_caches(found, slots)
        streamed = {f"{u.name}.{p}" for u in units for p in u.sources}
        weights = self.reads.initial_weights(
            {p: t for p, t in direct.items() if p not in expert_params}, streamed, overlap)
        # load_weights checks every shape: stacked experts pass as stand-ins of their
        # full shape, then the caches put their banks' arrays (fewer experts) in place.
        weights.update({p: stand_in(direct[p]) for p in expert_params})
        weights.update(derived)
        model.load_weights(list(weights.items()), strict=strict)
        for c in lay.experts:
            c.module.update(tree_unflatten(list(c.arrays().items())))
        if self.strategy == "pread" and not overlap:
            mx.eval([w for p, w in weights.items()
                     if p not in streamed and p not in expert_params])
        del weights
        if derived:
            log.info("%d parameters computed outside the checkpoint are kept resident "
                     "(%d bytes)", len(derived), lay.derived_bytes)
        self._stream(units)
        for c in lay.experts:
            if c.resident:
                c.load_all()  # every expert fits: read once, no routing needed
            else:
                add_hook(c.module, EXPERT_HOOK, c)
        self.load_s = time.perf_counter() - t0
        attach_handle(model).controller = self

    @contextlib.contextmanager
    def restructuring(self, model: nn.Module):
        """Around a change that wraps modules of the attached ``model`` while keeping each
        wrapped module as a child (mlx-lm's LoRA and DoRA layers: ``q_proj`` becomes a
        ``LoRALinear`` whose ``linear`` is the old ``q_proj``). Afterwards every read
        parameter is found again by the module object that holds it, at its new path, so
        streamed units bring their weights into the wrapped modules.

        Raises:
            ValueError: the model has expert caches (their modules are not rebound), or a
                module that held read parameters is no longer in the model.
        """
        lay = self.layout
        if lay is None:
            raise ValueError("restructuring() needs an attached model")
        if lay.experts:
            raise ValueError("a model with expert caches (experts=...) cannot be "
                             "restructured: load it with experts='layer'")
        self._close_stray()
        armed = [u for u in lay.units if u in self._armed]
        for unit in armed:  # the change sees the model's own classes
            self._disarm(unit)
        modules = dict(model.named_modules())
        owners = {p: _split_owner(p, modules) for p in lay.sources}
        yield
        where = {id(m): path for path, m in model.named_modules()}

        def moved(param: str) -> str:
            module, leaf = owners[param]
            if id(module) not in where:
                raise ValueError(f"{param}: its module left the model during "
                                 "restructuring; pyloader can no longer stream it")
            base = where[id(module)]
            return f"{base}.{leaf}" if base else leaf

        renamed = {p: moved(p) for p in lay.sources}
        lay.sources = {renamed[p]: t for p, t in lay.sources.items()}
        for layer in lay.layers:
            layer.path = where[id(layer.module)]
            layer.sources = {renamed[p]: t for p, t in layer.sources.items()}
        for unit in lay.units:
            old = unit.name
            unit.name = where[id(unit.module)]
            rel = {p: renamed[f"{old}.{p}"][len(unit.name) + 1:] for p in unit.sources}
            unit.sources = {rel[p]: t for p, t in unit.sources.items()}
            unit.copied = [rel[p] for p in unit.copied]
            unit.stand_ins = {rel[p]: a for p, a in unit.stand_ins.items() if p in rel}
            unit.holders = None  # found again under the wrapped modules
        for unit in armed:
            self._arm(unit)

    def _find_experts(self, derived: dict[str, mx.array]) -> tuple[list, list[int]]:
        """Every MoE module of every layer as ``(path, module, layer, sources, strides)``
        (their stacked tensors leave the layers' sources: the caches will own them) and
        each one's cache slots."""
        found = []
        for layer in self.layout.layers:
            for path, module in expert_modules(layer.module, layer.path):
                sources = layer.sources_under(path)
                params = {p for p, _ in tree_flatten(module.parameters())}
                missing = sorted(params - set(sources))
                if missing:
                    why = ("computed by the model's sanitize (experts stored one tensor each: "
                           "convert the checkpoint with mlx_lm.convert, which stacks them)"
                           if any(f"{path}.{p}" in derived for p in missing)
                           else "not in the checkpoint")
                    raise ValueError(f"{path}: parameters {missing[:3]} are {why}; expert "
                                     "streaming needs every expert tensor stacked [E, ...]")
                for p in sources:
                    del layer.sources[f"{path}.{p}"]
                strides = [t.nbytes // t.shape[0] for t in sources.values()]
                found.append((path, module, layer.index, sources, strides))
        if not found:
            raise ValueError(f"experts={self.experts!r}: the model has no mixture-of-experts "
                             "modules (mlx-lm's SwitchGLU / SwitchMLP); use experts='layer'")
        slots = cache_slots(
            self.experts, [(next(iter(src.values())).shape[0], strides)
                           for _, _, _, src, strides in found], self.expert_source)
        return found, slots

    def _make_expert_caches(self, found: list, slots: list[int]) -> list[ExpertCache]:
        """One cache per MoE module found by :meth:`_find_experts`."""
        caches = []
        for (path, module, index, sources, _), n in zip(found, slots):
            if self.expert_source == "bank":
                caches.append(BankExperts(path, module, index, sources, n,
                                          self.expert_policy, self.checkpoint,
                                          self.expert_reader))
            else:
                caches.append(MappedExperts(path, module, index, sources, n,
                                            self.expert_policy, self.expert_reader,
                                            self.keep_page_cache))
        for c in caches:
            c.lock = self.lock
        return caches

    def _need(self, strategy: str, fixed: list[TensorMeta], resident_layers: Iterable[int],
              streamed: list[Unit], depth: int, banks: int):
        """The pre-flight's :class:`.preflight.MemoryNeed` of a load: ``fixed`` (the
        non-layer tensors) and ``resident_layers`` resident, ``streamed`` units with
        ``depth`` of them prefetched, ``banks`` bytes of expert banks."""
        lay = self.layout
        tensors = fixed + [t for i in resident_layers for t in lay.layers[i].sources.values()]
        return need_of(strategy, tensors, [list(u.sources.values()) for u in streamed],
                       depth, lay.derived_bytes, banks)

    def _fit_depth(self, units: list[Unit], fixed: list[TensorMeta], banks: int,
                   snap: MemorySnapshot) -> None:
        """``prefetch="auto"``: lower :attr:`depth` (the depth the units' sizes want) to the
        deepest whose units in flight fit the headroom in ``snap`` beside everything else
        the pre-flight counts (:func:`.depth.fit_depth`)."""
        want = self.depth
        available = headroom_of(snap, page_cache="reclaimable")
        if available is not None:
            resident = self.layout.resident
            self.depth = fit_depth(want, lambda d: self._need(
                self.strategy, fixed, resident, units, d, banks).total <= available)
        log.info("prefetch='auto': depth %d (%d streamed %s units of %s to %s; the sizes "
                 "want %d)", self.depth, len(units), self.granularity,
                 format_bytes(min(u.nbytes for u in units)),
                 format_bytes(max(u.nbytes for u in units)), want)

    def _preflight(self, units: list[Unit], every: list[Unit], fixed: list[TensorMeta],
                   banks: int, buffers: int, snap: MemorySnapshot) -> None:
        """``MemoryError`` before anything is read or allocated when the load cannot fit
        the headroom in ``snap`` (:mod:`.preflight`), naming settings that would.
        ``units``: the streamed units; ``every``: every layer's units; ``fixed``: the
        non-layer tensors; ``banks``: the expert banks' bytes; ``buffers``: the streaming
        bytes ``choose_resident`` budgets for."""
        lay = self.layout

        def need(strategy: str, resident_layers: Iterable[int], streamed: list[Unit],
                 depth: int = self.depth):
            return self._need(strategy, fixed, resident_layers, streamed, depth, banks)

        wanted = need(self.strategy, lay.resident, units)
        available = headroom_of(snap, page_cache="reclaimable")
        if available is None:
            return
        if wanted.total <= available:
            if self.strategy == "mmap":
                mapped = fixed + [t for i in lay.resident
                                  for t in lay.layers[i].sources.values()]
                views = sum(t.nbytes for t in mapped if t.aligned) if aligned_are_views() else 0
                if views + wanted.total > available:
                    warnings.warn(ResidencyWarning(
                        f"{self.checkpoint.path}: the resident set maps "
                        f"{format_bytes(views)} of the checkpoint (page-cache views) beside "
                        f"{format_bytes(wanted.total)} of anonymous memory, but only "
                        f"{format_bytes(available)} are available "
                        f"({limiting_probe(snap, page_cache='reclaimable')}): these pages "
                        "are not resident, the kernel will evict and re-read them on every "
                        "pass (at a speed no plan predicts). A resident set that fits: resident="
                        f"'{budget_text(max(0, available - wanted.reserve))}', or "
                        "pyloader.residency.load_planned(path)."), stacklevel=4)
            return
        suggestions = []
        if self.strategy == "pread" and need("mmap", lay.resident, units).total <= available:
            suggestions.append("strategy='mmap'")
        shallower = [d for d in (1, 0) if d < self.depth
                     and need(self.strategy, lay.resident, units, d).total <= available]
        if shallower:
            suggestions.append(f"prefetch={shallower[0]}")
        if lay.resident:
            floor = need(self.strategy, (), every).total
            if floor <= available:
                # The most weights in memory at once that fit, as a resident= budget.
                budget = lay.fixed_bytes + buffers + (available - floor)
                suggestions.append(
                    f"resident='{budget_text(budget, floor=lay.fixed_bytes + buffers)}'")
        check(wanted, str(self.checkpoint.path), suggestions=suggestions, snap=snap)

    def in_memory(self, model: nn.Module) -> list[mx.array]:
        """The attached ``model``'s parameters that hold data: all but the stand-ins of
        the streamed units that are out (evaluating those raises
        :class:`pyloader.StandInError`)."""
        out = {id(a) for u in self.layout.units for a in u.stand_ins.values()}
        return [a for _, a in tree_flatten(model.parameters()) if id(a) not in out]

    def routing_trace(self):
        """A context manager recording every expert cache's routing
        (:class:`.experts.RoutingTrace`), for :func:`.experts.simulate`."""
        return routing_trace(self.layout.experts)

    def build_units(self, layers: Iterable[int]) -> list[Unit]:
        """New units of ``layers`` (by the unit kind), not yet streamed or ordered."""
        units = []
        for i in layers:
            layer = self.layout.layers[i]
            for path, module in self.kind.modules(layer):
                unit = Unit(name=path, module=module, layer=i,
                            sources=layer.sources_under(path))
                unit.copied = self.reads.copied_params(unit)
                units.append(unit)
        return units

    def _stream(self, units: list[Unit]) -> None:
        """Hook ``units``, put them in execution order and drop their weights."""
        lay = self.layout
        for unit in units:
            add_hook(unit.module, _HOOK, functools.partial(self._run_unit, unit), inner=True)
        rank = {id(u): k for k, u in enumerate(lay.units + units)}
        lay.units = sorted(lay.units + units, key=lambda u: (u.layer, rank[id(u)]))
        self._renumber()
        for unit in units:
            self.reads.start_streaming(unit)
            self._arm(unit)
        self.reads.plan_buffers(lay.units, self.depth)

    def _renumber(self) -> None:
        for k, u in enumerate(self.layout.units):
            u.order = k

    # -- moving layers between resident and streamed ----------------------------

    def shed(self, layers: Iterable[int]) -> int:
        """Turn resident layers into streamed ones; returns the weight bytes released.

        Safe between forward passes (a pending computation keeps the arrays it already
        references). mmap: the layer's pages leave the process and the page cache; pread
        and misaligned copies: the arrays are dropped and MLX's buffer cache cleared."""
        lay = self.layout
        todo = sorted(i for i in set(layers) if i in lay.resident)
        if not todo:
            return 0
        with self.lock:
            self._close_stray()
            self._stream(self.build_units(todo))
        lay.resident -= set(todo)
        mx.clear_cache()
        return sum(lay.layers[i].nbytes for i in todo)

    def admit(self, layers: Iterable[int]) -> int:
        """Turn streamed layers back into resident ones (loaded now); returns the bytes."""
        lay = self.layout
        todo = {i for i in set(layers) if i not in lay.resident}
        if not todo:
            return 0
        with self.lock:
            self._close_stray()
            self._admit(todo)
        lay.resident |= todo
        return sum(lay.layers[i].nbytes for i in todo)

    def _admit(self, todo: set[int]) -> None:
        lay = self.layout
        leaving = [u for u in lay.units if u.layer in todo]
        for unit in leaving:
            ticket = lay.in_flight.pop(unit, None)
            if ticket is not None:
                self.reads.discard(ticket)  # its buffers are freed
        lay.units = [u for u in lay.units if u.layer not in todo]
        self._renumber()
        for unit in leaving:
            self.reads.admit(unit)
            remove_hook(unit.module, _HOOK)
            self._disarm(unit)
            unit.order = -1
        self.reads.plan_buffers(lay.units, self.depth)

    # -- the per-unit protocol (the hook) ---------------------------------------

    def _run_unit(self, unit: Unit, module, call, *args, **kwargs):
        with self.lock:
            self.before(unit, args, kwargs)
            try:
                out = call(*args, **kwargs)
                self.after(unit, out, args, kwargs)
            except BaseException:
                self.release(unit)
                self.drain()  # an error or Ctrl-C: no prefetch outlives it
                raise
            return out

    # -- units reached through their holders (the "guard" hook) -----------------
    #
    # A streamed unit's parameters live in the modules that hold them (its Linear,
    # norm, embedding ... modules: the unit's *holders*). While the unit is out each
    # holder carries a "guard" hook, so a forward that calls them other than through
    # the unit's own call (a layer's submodules called directly, layers looped twice
    # by their parts) still finds the bytes in: the guard brings the unit in, and it
    # stays in (a "stray" unit) until another unit comes in. While a unit is in
    # through its own call the guards are off: the per-unit protocol pays nothing
    # for them. Reads that bypass every call (a parent reading ``.weight``) meet the
    # stand-in, which raises.

    def _holders(self, unit: Unit) -> list[nn.Module]:
        """The modules below ``unit.module`` that hold its streamed parameters."""
        if unit.holders is None:
            modules = {path: m for path, m in unit.module.named_modules() if path}
            found = {}
            for p in unit.sources:
                hit = _longest_prefix(p, modules)
                if hit is not None:
                    found[id(hit[0])] = hit[0]
            unit.holders = list(found.values())
        return unit.holders

    def _arm(self, unit: Unit) -> None:
        if unit in self._armed:
            return
        guard = functools.partial(self._guarded_call, unit)
        for m in self._holders(unit):
            add_hook(m, _GUARD, guard)
        self._armed.add(unit)

    def _disarm(self, unit: Unit) -> None:
        if unit in self._armed:
            self._armed.discard(unit)
            for m in self._holders(unit):
                remove_hook(m, _GUARD)

    def _guarded_call(self, unit: Unit, module, call, *args, **kwargs):
        with self.lock:
            # Another thread's stray unit is brought in again for this one: its arrays
            # may be lazy on that thread's stream (mmap's per-use copies).
            if self._stray is not unit or self._stray_thread != threading.get_ident():
                self._close_stray()
                try:
                    self.before(unit, args, kwargs, disarm=False)
                except BaseException:
                    self.release(unit)
                    raise
                unit.stats.stray_entries += 1
                self._stray, self._stray_out = unit, []
                self._stray_thread = threading.get_ident()
            try:
                out = call(*args, **kwargs)
            except BaseException:
                self._close_stray(evaluate=False)
                self.drain()
                raise
            self._stray_out.append(out)
            return out

    def _close_stray(self, evaluate: bool = True) -> None:
        """Release the unit its holders brought in, once what they computed is
        evaluated (by the thread that built it; another thread's graph keeps the
        arrays it references, so releasing is safe without it)."""
        unit, pending = self._stray, self._stray_out
        if unit is None:
            return
        self._stray, self._stray_out = None, []
        try:
            if evaluate and self._stray_thread == threading.get_ident():
                mx.eval([x for _, x in tree_flatten(pending) if isinstance(x, mx.array)])
                self.reads.check_unchanged()
        finally:
            self.release(unit)
        self._schedule(unit.order, len(self.layout.units))

    def before(self, unit: Unit, args=(), kwargs=None, *, disarm: bool = True) -> None:
        """Bring ``unit``'s weights in (waiting for its request) and request the next.

        The unit's inputs are evaluated asynchronously first, so the resident layers
        that ran lazily since the previous streamed unit compute while this one's
        read finishes (instead of after it). A unit its holders brought in is released
        first; ``disarm``: the unit's holders run unguarded until its release."""
        try:
            self._close_stray()
            inputs = [a for a in list(args) + list((kwargs or {}).values())
                      if isinstance(a, mx.array)]
            if inputs:
                mx.async_eval(inputs)
            self._bring_in(unit)
            if disarm:
                self._disarm(unit)
        except BaseException:
            # An I/O error or an interrupt: no request may outlive it (a failed one
            # would fail the next pass too, a finished one holds memory).
            self.drain()
            raise

    def _bring_in(self, unit: Unit) -> None:
        tl = self.timeline
        if unit.order == 0:
            self.passes += 1
            if tl is not None:
                tl.begin_pass(self.passes)
        t0 = time.monotonic_ns()
        ticket = self.layout.in_flight.pop(unit, None)
        self.reads.bring_in(unit, ticket)
        t1 = time.monotonic_ns()
        st = unit.stats
        st.bytes_read += unit.nbytes
        st.loads += 1
        st.prefetched += ticket is not None
        st.wait_s += (t1 - t0) / 1e9
        if tl is not None:
            tl.add("wait", unit, t0, t1, ticket=ticket, bytes=unit.nbytes,
                   prefetched=ticket is not None)
        self._schedule(unit.order, len(self.layout.units) - 1)
        if tl is not None:
            tl.compute_begins()

    def _schedule(self, current: int, limit: int) -> None:
        """Requests the next ``min(depth, limit)`` streamed units after ``current``
        (in execution order, wrapping into the next forward pass)."""
        units, in_flight = self.layout.units, self.layout.in_flight
        tl = self.timeline
        n = len(units)
        for step in range(1, min(self.depth, limit) + 1):
            u = units[(current + step) % n]
            if u not in in_flight:
                in_flight[u] = (self.reads.request(u) if tl is None
                                else tl.request(u, self.reads.request))

    def after(self, unit: Unit, out, args, kwargs) -> None:
        """Evaluate what reads ``unit``'s weights (output, cache state), then release it."""
        t0 = time.monotonic_ns()
        # The unit's weights may be released only once everything that reads
        # them has run: its output and the cache state it wrote.
        pending = [out]
        for a in list(args) + list(kwargs.values()):
            if hasattr(a, "state") and not isinstance(a, mx.array):
                pending.append(a.state)
        mx.eval([x for _, x in tree_flatten(pending) if isinstance(x, mx.array)])
        t1 = time.monotonic_ns()
        unit.stats.compute_s += (t1 - t0) / 1e9
        if self.timeline is not None:
            self.timeline.compute_ends(unit, t0, t1)
        self.reads.check_unchanged()  # changed under this unit's compute
        self.release(unit)
        # With no more streamed units than the prefetch depth, this unit is among
        # the next ones to run (next pass): request it again now that it is out, so
        # its read overlaps the rest of the pass instead of stalling it.
        self._schedule(unit.order, len(self.layout.units))

    def release(self, unit: Unit) -> None:
        """Drop ``unit``'s weights from this process (and the page cache unless kept;
        mmap queues both on its reader's worker: :meth:`settle` waits for them)."""
        tl = self.timeline
        if tl is None:
            self.reads.release(unit)
        else:
            t0 = time.monotonic_ns()
            self.reads.release(unit)
            tl.add("release", unit, t0, time.monotonic_ns(), bytes=unit.nbytes)
        self._arm(unit)

    def settle(self) -> None:
        """Block until every released unit's pages are gone from this process (and the
        page cache unless kept)."""
        self.reads.settle()

    def close(self) -> None:
        """Cancel outstanding requests (their buffers are freed)."""
        for ticket in self.layout.in_flight.values():
            self.reads.cancel(ticket)
        self.layout.in_flight.clear()

    def drain(self) -> None:
        """Cancel queued requests and wait out (discarding their result or error) the
        one already running, so nothing is in flight; a unit its holders brought in is
        released."""
        self._close_stray(evaluate=False)
        tickets = list(self.layout.in_flight.values())
        self.layout.in_flight.clear()
        for ticket in tickets:
            self.reads.discard(ticket)

    # -- reporting ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters of every streamed unit and their totals (see :func:`pyloader.stats`)."""
        lay = self.layout
        wait = sum(u.stats.wait_s for u in lay.units)
        compute = sum(u.stats.compute_s for u in lay.units)
        memory = {"peak_memory": mx.get_peak_memory(), "active_memory": mx.get_active_memory()}
        memory.update(process_memory().as_status())  # None where not reported
        return {
            "strategy": self.strategy,
            "prefetch": self.depth,
            "prefetch_setting": self.prefetch,
            "granularity": self.granularity,
            "streamed_units": len(lay.units),
            "streamed_bytes_per_pass": sum(u.nbytes for u in lay.units),
            "resident_layers": sorted(lay.resident),
            "resident_bytes": lay.resident_bytes,
            "derived_bytes": lay.derived_bytes,
            "load_s": self.load_s,
            "passes": self.passes,
            "bytes_read": sum(u.stats.bytes_read for u in lay.units),
            "wait_s": wait,
            "compute_s": compute,
            # Share of the streamed units' time not spent waiting for I/O.
            "overlap_efficiency": compute / (wait + compute) if wait + compute else 1.0,
            "reads_in_flight": len(lay.in_flight),
            "units": {u.name: vars(u.stats).copy() for u in lay.units},
            "reader": self.reads.stats(),
            **({"experts": self._expert_stats()} if lay.experts else {}),
            **memory,
        }

    def start_timeline(self, max_events: int = DEFAULT_MAX_EVENTS) -> Timeline:
        """Start recording :attr:`timeline`: every streamed unit's requests, wait,
        compute, release and eviction, and the reader threads' work (:mod:`.timeline`).
        Start between forward passes; :func:`pyloader.trace` wraps this and writes the
        files.

        Raises:
            RuntimeError: A timeline is already being recorded.
        """
        if self.timeline is not None:
            raise RuntimeError("a timeline is already being recorded (controller.timeline); "
                               "stop it first")
        self.settle()  # releases queued before now are not part of the recording
        lay = self.layout
        meta = {"checkpoint": str(self.checkpoint.path), "strategy": self.strategy,
                "prefetch": self.depth, "prefetch_setting": self.prefetch,
                "granularity": self.granularity,
                "keep_page_cache": self.keep_page_cache,
                "resident_layers": sorted(lay.resident),
                "units": [{"name": u.name, "layer": u.layer, "bytes": u.nbytes}
                          for u in lay.units]}
        self.timeline = Timeline(self.reads.take_trace, meta, max_events)
        self.reads.trace_enable(True)  # after the timeline's origin: no earlier event
        return self.timeline

    def stop_timeline(self) -> Timeline | None:
        """Stop recording; returns the timeline recorded (None if none was)."""
        timeline, self.timeline = self.timeline, None
        if timeline is not None:
            self.settle()  # the last releases queued on the reader are in the trace
            self.reads.trace_enable(False)  # then taken: spans ending later are not kept
            timeline.stop()
        return timeline

    def _expert_stats(self) -> dict[str, Any]:
        per = {c.name: c.stats() for c in self.layout.experts}
        total = totals(per.values(),
                       EXPERT_COUNTERS + ("bytes_read", "reads", "stall_s", "bank_bytes"))
        return {"policy": self.expert_policy, "setting": self.experts,
                "source": self.expert_source, "layers": per, "total": total}


def _longest_prefix(param: str, table: dict[str, Any]) -> tuple[Any, str] | None:
    """``(table[prefix], rest)`` for the longest module path ``prefix`` of ``param`` in
    ``table`` (``""`` included) and the parameter's path below it; None if none is."""
    parts = param.split(".")
    for k in range(len(parts) - 1, -1, -1):
        found = table.get(".".join(parts[:k]))
        if found is not None:
            return found, ".".join(parts[k:])
    return None


def _split_owner(param: str, modules: dict[str, nn.Module]) -> tuple[nn.Module, str]:
    """``(module, rest)``: the module holding ``param`` and the parameter's path in it."""
    found = _longest_prefix(param, modules)
    if found is None:
        raise ValueError(f"{param}: no module of the model holds it")
    return found


def _owner(param: str, layers: dict[str, LayerEntry]) -> LayerEntry | None:
    """The layer whose module path is the longest prefix of ``param``, if any."""
    found = _longest_prefix(param, layers)
    return found[0] if found else None


def controller_of(model: nn.Module) -> StreamingController:
    """The controller of a model from :func:`pyloader.load_model` (ValueError otherwise)."""
    h = handle_of(model)
    if h is None or h.controller is None:
        raise ValueError("this model was not loaded by pyloader.load_model")
    return h.controller


def streams(model: nn.Module) -> bool:
    """True when pyloader streams some of the model's weights (a streaming controller
    with at least one streamed unit)."""
    h = handle_of(model)
    return bool(h is not None and h.controller is not None and h.controller.layout.units)


def stats(model: nn.Module) -> dict[str, Any]:
    """Streaming counters of a model from :func:`pyloader.load_model`: per unit loads,
    bytes read, time waiting for I/O and computing, the overlap efficiency, the
    reader's byte counters, and this process's memory (peak RSS ``VmHWM``,
    ``VmRSS``, ``RssAnon``, ``RssFile``: every key present, None where the platform does
    not report it; MLX peak)."""
    return controller_of(model).stats()
