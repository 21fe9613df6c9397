"""Streamed units reached through their holders (the ``"guard"`` hook).

A streamed unit's parameters live in the modules that hold them (its Linear, norm,
embedding ... modules: the unit's *holders*). While the unit is out each holder carries
a ``"guard"`` hook, so a forward that calls them other than through the unit's own call
(a layer's submodules called directly, layers looped twice by their parts) still finds
the bytes in: the guard brings the unit in, and it stays in (a *stray* unit) until
another unit comes in. While a unit is in through its own call the guards are off: the
per-unit protocol pays nothing for them. Reads that bypass every call (a parent reading
``.weight``) meet the stand-in, which raises.
"""

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
    """The guards of every streamed unit, and the one unit they brought in.

    Args:
        lock: The controller's lock (guards run under it, like the per-unit protocol).
        reads: The read path (a stray unit's views are checked before release).
        enter: Brings a unit in for its holders (``enter(unit, args, kwargs)``), its
            guards left on.
        release: Releases a unit (its guards back on).
        schedule: Requests the units predicted next (a stray unit was released).
        abort: Cancels every read in flight (an error or an interrupt).

    The four are bound methods of the part that owns this one, held weakly.

    Attributes:
        armed: The units whose holders are guarded now.
        unit: The stray unit in memory (None when there is none).
        outputs: What its holders' calls returned (evaluated before it is released).
        thread: The thread that brought it in.
    """

    def __init__(self, lock: threading.RLock, reads: UnitReads,
                 enter: Callable[[Unit, tuple, dict], None],
                 release: Callable[[Unit], None], schedule: Callable[[], None],
                 abort: Callable[[], None]):
        self.lock = lock
        self.reads = reads
        # The owner holds this part: strong references back would make a cycle that
        # keeps a dropped model's arrays alive until the garbage collector runs.
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
            # Another thread's stray unit is brought in again for this one: its arrays
            # may be lazy on that thread's stream (mmap's per-use copies).
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
        """Release the stray unit, once what its holders computed is evaluated (by the
        thread that built it; another thread's graph keeps the arrays it references, so
        releasing is safe without it)."""
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
