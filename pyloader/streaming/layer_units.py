"""The streamed layer units of an attached model: which layers are resident, which
stream, the ``"stream"`` hooks that bring a unit in just before it runs and release it
right after, prefetch in the order :mod:`.order` predicts, and shed/admit. Hooks keep the
module's class and attributes, so mlx-lm drives the model unchanged. See docs/streaming.md."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .._util.hooks import add_hook, remove_hook
from .layout import Layout, split_owner
from .order import CallOrder
from .reads import UnitReads
from .recording import Recorder
from .strays import StrayUnits
from .units import Unit, UnitKind

#: The hook name on a streamed unit's module.
HOOK = "stream"


class LayerUnits:
    """The streamed units of one model, ``depth`` units requested ahead of the one
    running, one caller at a time (``lock``). Counters: ``hits``/``misses`` (units called
    with/without their read requested), ``withdrawn``/``withdrawn_bytes`` (requests dropped
    unused)."""

    def __init__(self, layout: Layout, reads: UnitReads, kind: UnitKind, depth: int,
                 lock: threading.RLock, recorder: Recorder):
        self.layout = layout
        self.reads = reads
        self.kind = kind
        self.depth = depth
        self.lock = lock
        self.recorder = recorder
        self.order = CallOrder()
        self.strays = StrayUnits(lock, reads, self._enter_stray, self.release,
                                 self._schedule, self.drain)
        self.hits = 0
        self.misses = 0
        self.withdrawn = 0
        self.withdrawn_bytes = 0

    def build(self, layers: Iterable[int]) -> list[Unit]:
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

    def stream(self, units: list[Unit]) -> None:
        """Hook ``units``, put them in layer order and drop their weights."""
        lay = self.layout
        for unit in units:
            add_hook(unit.module, HOOK, functools.partial(self._run, unit), inner=True)
        rank = {id(u): k for k, u in enumerate(lay.units + units)}
        lay.units = sorted(lay.units + units, key=lambda u: (u.layer, rank[id(u)]))
        self._renumber()
        for unit in units:
            self.reads.start_streaming(unit)
            self.strays.arm(unit)
        self.reads.plan_buffers(lay.units, self.depth)

    def _renumber(self) -> None:
        for k, u in enumerate(self.layout.units):
            u.order = k
        self.order.restart(self.layout.units)

    def shed(self, layers: Iterable[int]) -> int:
        """Turn resident layers into streamed ones; returns the weight bytes released."""
        lay = self.layout
        todo = sorted(i for i in set(layers) if i in lay.resident)
        if not todo:
            return 0
        with self.lock:
            self.strays.close()
            self.stream(self.build(todo))
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
            self.strays.close()
            self._unstream(todo)
        lay.resident |= todo
        return sum(lay.layers[i].nbytes for i in todo)

    def _unstream(self, todo: set[int]) -> None:
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
            remove_hook(unit.module, HOOK)
            self.strays.disarm(unit)
            unit.order = -1
        self.reads.plan_buffers(lay.units, self.depth)

    @contextlib.contextmanager
    def restructuring(self, model: nn.Module):
        """See :meth:`.controller.StreamingController.restructuring`."""
        lay = self.layout
        self.strays.close()
        armed = [u for u in lay.units if u in self.strays.armed]
        for unit in armed:  # the change sees the model's own classes
            self.strays.disarm(unit)
        modules = dict(model.named_modules())
        owners = {p: split_owner(p, modules) for p in lay.sources}
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
            self.strays.arm(unit)

    def in_memory(self, model: nn.Module) -> list[mx.array]:
        """``model``'s parameters that hold data (not stand-ins of units that are out)."""
        out = {id(a) for u in self.layout.units for a in u.stand_ins.values()}
        return [a for _, a in tree_flatten(model.parameters()) if id(a) not in out]

    def _run(self, unit: Unit, module, call, *args, **kwargs):
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

    def _enter_stray(self, unit: Unit, args: tuple, kwargs: dict) -> None:
        self.before(unit, args, kwargs, disarm=False)

    def before(self, unit: Unit, args=(), kwargs=None, *, disarm: bool = True) -> None:
        """Bring ``unit``'s weights in (waiting for its request) and request the next.

        The unit's inputs are evaluated asynchronously first so pending resident layers compute
        during the read. ``disarm``: the unit's holders run unguarded until its release.
        """
        try:
            self.strays.close()
            inputs = [a for a in list(args) + list((kwargs or {}).values())
                      if isinstance(a, mx.array)]
            if inputs:
                mx.async_eval(inputs)
            self._bring_in(unit)
            if disarm:
                self.strays.disarm(unit)
        except BaseException:
            # An I/O error or an interrupt: no request may outlive it.
            self.drain()
            raise

    def _bring_in(self, unit: Unit) -> None:
        rec = self.recorder
        if self.order.observe(unit):
            rec.pass_begins(self.order.passes)
        t0 = time.monotonic_ns()
        ticket = self.layout.in_flight.pop(unit, None)
        self.reads.bring_in(unit, ticket)
        t1 = time.monotonic_ns()
        st = unit.stats
        st.bytes_read += unit.nbytes
        st.loads += 1
        st.prefetched += ticket is not None
        st.wait_s += (t1 - t0) / 1e9
        if self.depth:
            if ticket is None:
                self.misses += 1
            else:
                self.hits += 1
        rec.waited(unit, t0, t1, ticket)
        self._schedule(running=unit)
        rec.compute_begins()

    def _schedule(self, running: Unit | None = None) -> None:
        """Request the next ``depth`` predicted units (not ``running``), soonest
        first; withdraw requests no longer predicted."""
        lay = self.layout
        want = self.order.predict(self.depth, skip=running)
        in_flight = lay.in_flight
        for u in [u for u in in_flight if u not in want]:
            self.reads.withdraw(u, in_flight.pop(u))
            self.withdrawn += 1
            self.withdrawn_bytes += u.nbytes
        for u in want:
            if u not in in_flight:
                in_flight[u] = self.recorder.request(u, self.reads.request)

    def after(self, unit: Unit, out, args, kwargs) -> None:
        """Evaluate what reads ``unit``'s weights (output, cache state), then release it."""
        t0 = time.monotonic_ns()
        # Release only once everything reading the weights (output, cache state) has run.
        pending = [out, *(a.state for a in (*args, *kwargs.values())
                          if hasattr(a, "state") and not isinstance(a, mx.array))]
        mx.eval([x for _, x in tree_flatten(pending) if isinstance(x, mx.array)])
        t1 = time.monotonic_ns()
        unit.stats.compute_s += (t1 - t0) / 1e9
        self.recorder.computed(unit, t0, t1)
        self.reads.check_unchanged()  # changed under this unit's compute
        self.release(unit)
        # With no more streamed units than the depth, request this unit again now so its
        # read overlaps the rest of the pass.
        self._schedule()

    def release(self, unit: Unit) -> None:
        """Drop ``unit``'s weights from this process (and the page cache unless
        kept; mmap queues it, :meth:`settle` waits)."""
        self.recorder.release(unit, self.reads.release)
        self.strays.arm(unit)

    def settle(self) -> None:
        """Block until every released unit's pages are gone."""
        self.reads.settle()

    def close(self) -> None:
        """Cancel outstanding requests (their buffers are freed)."""
        for ticket in self.layout.in_flight.values():
            self.reads.cancel(ticket)
        self.layout.in_flight.clear()

    def drain(self) -> None:
        """Cancel queued requests and wait out the running one; a stray unit is released."""
        self.strays.close(evaluate=False)
        tickets = list(self.layout.in_flight.values())
        self.layout.in_flight.clear()
        for ticket in tickets:
            self.reads.discard(ticket)

    def stats(self) -> dict[str, Any]:
        """The streamed units' counters and totals."""
        lay = self.layout
        wait = sum(u.stats.wait_s for u in lay.units)
        compute = sum(u.stats.compute_s for u in lay.units)
        return {
            "streamed_units": len(lay.units),
            "streamed_bytes_per_pass": sum(u.nbytes for u in lay.units),
            "resident_layers": sorted(lay.resident),
            "resident_bytes": lay.resident_bytes,
            "derived_bytes": lay.derived_bytes,
            "passes": self.order.passes,
            "unit_calls": self.order.calls,
            "bytes_read": sum(u.stats.bytes_read for u in lay.units),
            "wait_s": wait,
            "compute_s": compute,
            # Share of the streamed units' time not spent waiting for I/O.
            "overlap_efficiency": compute / (wait + compute) if wait + compute else 1.0,
            "reads_in_flight": len(lay.in_flight),
            "prefetch_hits": self.hits,
            "prefetch_misses": self.misses,
            "prefetch_withdrawn": self.withdrawn,
            "prefetch_withdrawn_bytes": self.withdrawn_bytes,
            "units": {u.name: vars(u.stats).copy() for u in lay.units},
        }
