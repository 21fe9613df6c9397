"""Recording a controller's :class:`.timeline.Timeline`, started and stopped between
forward passes; nothing is recorded while it is not."""

from __future__ import annotations

import time
from typing import Any, Callable

from .reads import UnitReads
from .timeline import Timeline
from .units import Unit


class Recorder:
    """The timeline being recorded of one controller (``timeline``: None when not recording)."""

    def __init__(self, reads: UnitReads):
        self.reads = reads
        self.timeline: Timeline | None = None

    def start(self, meta: dict[str, Any], max_events: int) -> Timeline:
        """Start recording, ``meta`` in the JSON's ``otherData`` (RuntimeError if a
        timeline is being recorded)."""
        if self.timeline is not None:
            raise RuntimeError("a timeline is already being recorded (controller.timeline); "
                               "stop it first")
        self.reads.settle()  # releases queued before now are not part of the recording
        self.timeline = Timeline(self.reads.take_trace, meta, max_events)
        self.reads.trace_enable(True)  # after the timeline's origin: no earlier event
        return self.timeline

    def stop(self) -> Timeline | None:
        """Stop recording; returns the timeline recorded (None if none was)."""
        timeline, self.timeline = self.timeline, None
        if timeline is not None:
            self.reads.settle()  # the last releases queued on the reader are in the trace
            self.reads.trace_enable(False)  # then taken: spans ending later are not kept
            timeline.stop()
        return timeline

    def pass_begins(self, number: int) -> None:
        if self.timeline is not None:
            self.timeline.begin_pass(number)

    def waited(self, unit: Unit, start_ns: int, end_ns: int, ticket: int | None) -> None:
        """``unit``'s weights were brought in (``ticket``: its request, if it had one)."""
        tl = self.timeline
        if tl is not None:
            tl.add("wait", unit, start_ns, end_ns, ticket=ticket, bytes=unit.nbytes,
                   prefetched=ticket is not None)

    def compute_begins(self) -> None:
        """The unit brought in is called from now (its next reads are requested)."""
        if self.timeline is not None:
            self.timeline.compute_begins()

    def request(self, unit: Unit, issue: Callable[[Unit], int]) -> int:
        """``issue(unit)``: request its read; its ticket."""
        tl = self.timeline
        return issue(unit) if tl is None else tl.request(unit, issue)

    def computed(self, unit: Unit, eval_start_ns: int, end_ns: int) -> None:
        if self.timeline is not None:
            self.timeline.compute_ends(unit, eval_start_ns, end_ns)

    def release(self, unit: Unit, drop: Callable[[Unit], None]) -> None:
        """``drop(unit)``: release its weights."""
        tl = self.timeline
        if tl is None:
            drop(unit)
        else:
            t0 = time.monotonic_ns()
            drop(unit)
            tl.add("release", unit, t0, time.monotonic_ns(), bytes=unit.nbytes)
