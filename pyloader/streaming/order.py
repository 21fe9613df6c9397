"""Which streamed units run next: the order a model actually calls its units in, learned
while it runs, so that prefetch requests the units that will be needed next.

A model need not call its streamed units once each, in list order, per forward pass: an
encoder-decoder runs its encoder's blocks once and then its decoder's blocks once per
decoded token, a model may call a block twice per forward, or call its blocks in an
order of its own. :class:`CallOrder` watches every call and remembers, for each of the
last one, two and three units called (the *context*), the unit called next. It predicts
by following those successors from the latest calls, preferring the longest context
seen (``A B A C`` tells "after B, A" apart from "after C, A": the unit after that A is
C in one case, B in the other), and falls back to list order (the next unit of the
layer list, wrapping to the first) where nothing was observed yet. The latest
observation wins, so a changed order is learned after one pass through it.

A prediction only decides which reads are requested early: a unit called while not
requested is read on the spot, and a request that is no longer predicted is withdrawn.
Either costs a read, never a different result.

A *pass* begins each time the cycle's first unit is called: the first streamed unit
called after attach or after the streamed set changed (shed, admit). For a model that
calls each streamed unit once per forward this is one forward pass; Whisper with only its
decoder streamed counts one per decoded token, and with its encoder streamed too one
per encoder run (then the decoder's tokens are part of that pass).
"""

from __future__ import annotations

from collections import deque

from .units import Unit

#: The longest context remembered (units called before the one predicted).
CONTEXT = 3
#: Contexts remembered per streamed unit before the table is cleared (a model whose
#: order never repeats would otherwise grow it without bound).
TABLE_PER_UNIT = 64


class CallOrder:
    """Observed calls of the streamed units, and what they predict (see the module doc).

    Attributes:
        units: The streamed units in list order (``unit.order`` is the position).
        head: The unit whose call begins a pass (None until a unit is called).
        passes: Passes begun.
        calls: Units called (observed).
    """

    def __init__(self, context: int = CONTEXT):
        self.context = context
        self.units: list[Unit] = []
        self.head: Unit | None = None
        self.passes = 0
        self.calls = 0
        self.successors: dict[tuple[Unit, ...], Unit] = {}
        self.recent: deque[Unit] = deque(maxlen=context)

    def restart(self, units: list[Unit]) -> None:
        """The streamed units are now ``units``: forget what involves the units that
        left; the next call begins a pass."""
        alive = set(units)
        self.units = list(units)
        self.head = None
        self.successors = {k: v for k, v in self.successors.items()
                           if v in alive and all(u in alive for u in k)}
        self.recent = deque((u for u in self.recent if u in alive), maxlen=self.context)

    def observe(self, unit: Unit) -> bool:
        """``unit`` is being called; True when its call begins a pass."""
        recent = self.recent
        if recent:
            if len(self.successors) > TABLE_PER_UNIT * max(1, len(self.units)):
                self.successors.clear()
            key = tuple(recent)
            for k in range(len(key)):
                self.successors[key[k:]] = unit
        recent.append(unit)
        self.calls += 1
        if self.head is None:
            self.head = unit
        if unit is self.head:
            self.passes += 1
            return True
        return False

    def _after(self, context: tuple[Unit, ...]) -> Unit:
        """The unit predicted to follow ``context`` (the latest call last)."""
        for k in range(len(context)):
            found = self.successors.get(context[k:])
            if found is not None:
                return found
        units = self.units
        return units[(context[-1].order + 1) % len(units)] if context else units[0]

    def predict(self, depth: int, skip: Unit | None = None) -> list[Unit]:
        """The next ``depth`` distinct units predicted after the latest call, soonest
        first, leaving out ``skip`` (the unit in memory now)."""
        if depth <= 0 or not self.units:
            return []
        out: list[Unit] = []
        context = tuple(self.recent)
        for _ in range(depth + len(self.units)):
            unit = self._after(context)
            if unit is not skip and unit not in out:
                out.append(unit)
                if len(out) == depth:
                    break
            context = (context + (unit,))[-self.context:]
        return out
