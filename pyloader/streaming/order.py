"""Which streamed units run next: the call order learned while the model runs, so
prefetch requests the units needed next.

:class:`CallOrder` remembers, for each context of the last one to three calls, the unit
called next; it predicts from the longest context seen, falling back to list order. A
wrong prediction only costs a read, never a different result. A *pass* begins each time
the cycle's first unit is called.
"""

from __future__ import annotations

from collections import deque

from .units import Unit

#: The longest context remembered (units called before the one predicted).
CONTEXT = 3
#: Contexts remembered per streamed unit before the table is cleared (bounds growth).
TABLE_PER_UNIT = 64


class CallOrder:
    """Observed calls of the streamed ``units`` (in list order), and what they predict:
    ``head`` is the unit whose call begins a pass (None until one is called)."""

    def __init__(self, context: int = CONTEXT):
        self.context = context
        self.units: list[Unit] = []
        self.head: Unit | None = None
        self.passes = 0
        self.calls = 0
        self.successors: dict[tuple[Unit, ...], Unit] = {}
        self.recent: deque[Unit] = deque(maxlen=context)

    def restart(self, units: list[Unit]) -> None:
        """The streamed units are now ``units``: forget the departed ones; the
        next call begins a pass."""
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
        """The next ``depth`` distinct predicted units, soonest first, without ``skip``."""
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
