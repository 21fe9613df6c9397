"""Streamed units reached through their holders (the ``"guard"`` hook): while a unit
is out its holders are guarded, so a forward that calls them directly brings the unit in
(a *stray* unit) until another unit comes in. Reads bypassing every call meet the
stand-in, which raises."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .._util.hooks import add_hook, remove_hook
from .layout import longest_prefix
from .reads import UnitReads
from .units import Unit

#: The hook name on a streamed unit's holders.
GUARD = "guard"


class StrayUnits:
    """The guards of every streamed unit (``armed``: those guarded now), and the one
    ``unit`` they brought in, with its holders' ``outputs`` (evaluated before release) and
    the ``thread`` that brought it in. The four callables (``enter(unit, args, kwargs)``,
    ``release(unit)``, ``schedule()``, ``abort()``) are bound methods, held weakly."""

    def __init__(self, lock: threading.RLock, reads: UnitReads,
                 enter: Callable[[Unit, tuple, dict], None],
                 release: Callable[[Unit], None], schedule: Callable[[], None],
                 abort: Callable[[], None]):
        self.lock = lock
        self.reads = reads
        # Weak references back: a strong cycle would keep a dropped model's arrays alive.
        self.enter = _weak(enter)
        self.release = _weak(release)
        self.schedule = _weak(schedule)
        self.abort = _weak(abort)
        self.armed: set[Unit] = set()
        self.unit: Unit | None = None
        self.outputs: list = []
        self.thread = 0

    @staticmethod
    def holders(unit: Unit) -> list[nn.Module]:
        """The modules below ``unit.module`` that hold its streamed parameters."""
        if unit.holders is None:
            modules = {path: m for path, m in unit.module.named_modules() if path}
            found = {}
            for p in unit.sources:
                hit = longest_prefix(p, modules)
                if hit is not None:
                    found[id(hit[0])] = hit[0]
            unit.holders = list(found.values())
        return unit.holders

    def arm(self, unit: Unit) -> None:
        """Guard ``unit``'s holders (it is out)."""
        if unit in self.armed:
            return
        guard = functools.partial(self.call, unit)
        for m in self.holders(unit):
            add_hook(m, GUARD, guard)
        self.armed.add(unit)

    def disarm(self, unit: Unit) -> None:
        """Unguard ``unit``'s holders (it is in, or stops streaming)."""
        if unit in self.armed:
            self.armed.discard(unit)
            for m in self.holders(unit):
                remove_hook(m, GUARD)

    def call(self, unit: Unit, module, call, *args, **kwargs):
        """The guard hook: a holder of ``unit`` is called."""
        with self.lock:
            # Another thread's stray unit: its arrays may be lazy on that thread's stream.
            if self.unit is not unit or self.thread != threading.get_ident():
                self.close()
                try:
                    self.enter(unit, args, kwargs)
                except BaseException:
                    self.release(unit)
                    raise
                unit.stats.stray_entries += 1
                self.unit, self.outputs = unit, []
                self.thread = threading.get_ident()
            try:
                out = call(*args, **kwargs)
            except BaseException:
                self.close(evaluate=False)
                self.abort()
                raise
            self.outputs.append(out)
            return out

    def close(self, evaluate: bool = True) -> None:
        """Release the stray unit once its holders' outputs are evaluated (by the
        thread that built them)."""
        unit, pending = self.unit, self.outputs
        if unit is None:
            return
        self.unit, self.outputs = None, []
        try:
            if evaluate and self.thread == threading.get_ident():
                mx.eval([x for _, x in tree_flatten(pending) if isinstance(x, mx.array)])
                self.reads.check_unchanged()
        finally:
            self.release(unit)
        self.schedule()


def _weak(method: Callable) -> Callable:
    """``method`` (a bound method) called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)
