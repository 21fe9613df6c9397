"""A timeline of a streamed model as Chrome trace-event JSON (open in
https://ui.perfetto.dev): per streamed unit ``request``, ``wait``, ``compute``, ``release``
and ``evict`` spans plus one ``pass`` span per pass on the compute thread, and the reader
threads' ``read``/``evict`` work, linked by ticket. Timestamps are microseconds since the
recording started, on CLOCK_MONOTONIC shared with the C++ readers. See docs/streaming.md."""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .._util.fs import write_atomic
from .._version import __version__
from .units import Unit

#: The compute thread's categories, in the order the per-unit protocol runs them.
UNIT_CATEGORIES = ("wait", "request", "compute", "release")
#: The reader threads' categories (mmap's release and eviction run on its worker).
READER_CATEGORIES = ("read", "release", "evict")
#: Reader work that nobody waits for (ticket 0 but not synchronous): mmap's drops.
DETACHED_KINDS = ("release", "release-evict")
#: Events a timeline keeps before it counts the rest as dropped.
DEFAULT_MAX_EVENTS = 1_000_000
CLOCK = ("CLOCK_MONOTONIC (Python time.monotonic_ns, C++ std::chrono::steady_clock); "
         "ts in microseconds since origin_ns")

#: A reader event: ``(kind, ticket, thread_id, start_ns, end_ns, bytes)``.
ReaderEvent = tuple[str, int, int, int, int, int]


@dataclass(slots=True)
class Span:
    """One compute-thread span: ``cat``, unit ``name``, ``tid``, start/end (ns), ``args``."""

    cat: str
    name: str
    tid: int
    start_ns: int
    end_ns: int
    args: dict[str, Any]


class Timeline:
    """The spans of one recording, written by the controller's
    :class:`.recording.Recorder`.

    Args:
        drain: Returns the reader's events since the last call as ``(events, dropped)``.
        meta: What is traced, written to ``otherData``.
        max_events: Events kept; later ones are counted in :attr:`dropped`.
    """

    def __init__(self, drain: Callable[[], tuple[list[ReaderEvent], int]],
                 meta: dict[str, Any], max_events: int = DEFAULT_MAX_EVENTS):
        self.meta = meta
        self.max_events = max_events
        self.spans: list[Span] = []
        self.reader_events: list[ReaderEvent] = []
        self.passes: list[tuple[int, int]] = []  # (the controller's pass number, start ns)
        self.dropped = 0
        self._drain = drain
        self._compute_from = 0
        self.origin_ns = time.monotonic_ns()
        self.end_ns: int | None = None

    def _full(self) -> bool:
        return len(self.spans) + len(self.reader_events) >= self.max_events

    def begin_pass(self, number: int) -> None:
        """Forward pass ``number`` starts now; the reader's events so far are taken."""
        self.passes.append((number, time.monotonic_ns()))
        self._take_reader_events()

    def add(self, cat: str, unit: Unit, start_ns: int, end_ns: int, **args: Any) -> None:
        """A span of the calling thread about ``unit``."""
        if self._full():
            self.dropped += 1
            return
        self.spans.append(Span(cat, unit.name, threading.get_native_id(), start_ns, end_ns,
                               {"layer": unit.layer,
                                "pass": self.passes[-1][0] if self.passes else None,
                                **args}))

    def request(self, unit: Unit, issue: Callable[[Unit], int]) -> int:
        """Issue ``unit``'s read (``issue(unit)`` returns its ticket), recorded."""
        t0 = time.monotonic_ns()
        ticket = issue(unit)
        self.add("request", unit, t0, time.monotonic_ns(), ticket=ticket, bytes=unit.nbytes)
        return ticket

    def compute_begins(self) -> None:
        """The running unit's weights are in: its module is called from now."""
        self._compute_from = time.monotonic_ns()

    def compute_ends(self, unit: Unit, eval_start_ns: int, end_ns: int) -> None:
        """``unit``'s output and cache state were evaluated (the eval ran from
        ``eval_start_ns``)."""
        self.add("compute", unit, self._compute_from, end_ns,
                 eval_ms=(end_ns - eval_start_ns) / 1e6)

    def stop(self) -> None:
        """The recording ends: the reader's last events are taken."""
        self._take_reader_events()
        self.end_ns = time.monotonic_ns()

    def _take_reader_events(self) -> None:
        events, dropped = self._drain()
        room = max(self.max_events - len(self.spans) - len(self.reader_events), 0)
        self.reader_events.extend(events[:room])
        self.dropped += dropped + max(len(events) - room, 0)

    def to_chrome(self) -> dict[str, Any]:
        """The Chrome trace-event JSON object (``traceEvents``, ``otherData``)."""
        pid = os.getpid()
        origin = self.origin_ns

        def complete(cat, name, tid, start, end, args):
            return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                    "ts": round((start - origin) / 1000, 3),
                    "dur": round((end - start) / 1000, 3), "args": args}

        def mid(start, end):
            return round(((start + end) // 2 - origin) / 1000, 3)

        events = [complete(s.cat, s.name, s.tid, s.start_ns, s.end_ns, s.args)
                  for s in self.spans]
        events += self._pass_spans(complete)

        # Which unit a ticket was issued for, and the wait each span of other work ran in.
        owner = {}
        requests, waited = {}, {}
        for s in self.spans:
            ticket = s.args.get("ticket")
            if ticket is not None and s.cat in ("request", "wait"):
                owner[ticket] = (s.name, s.args["layer"])
                (requests if s.cat == "request" else waited).setdefault(ticket, s)
        waits = sorted((s for s in self.spans if s.cat == "wait"), key=lambda s: s.start_ns)
        starts = [w.start_ns for w in waits]

        def wait_around(start: int, end: int) -> Span | None:
            i = bisect.bisect_right(starts, start) - 1
            return waits[i] if i >= 0 and waits[i].end_ns >= end else None

        reader_kinds: dict[int, set[str]] = {}
        reads = {}
        for kind, ticket, tid, start, end, nbytes in self.reader_events:
            inside = wait_around(start, end)
            name, layer = owner.get(ticket) if ticket in owner else (
                (inside.name, inside.args["layer"]) if inside is not None else (None, None))
            args = {"kind": kind, "ticket": ticket, "bytes": nbytes, "reader_thread": tid,
                    "layer": layer}
            if ticket == 0 and inside is not None and kind not in DETACHED_KINDS:
                lane = inside.tid  # synchronous: drawn inside the wait it blocked
            else:
                lane = tid
                reader_kinds.setdefault(tid, set()).add(kind)
            cat = ("release" if kind == "release" else
                   "evict" if kind in ("evict", "release-evict") else "read")
            events.append(complete(cat, name or f"({kind})", lane, start, end, args))
            if cat == "read" and ticket:
                reads.setdefault(ticket, (lane, start, end))

        flows = []
        for ticket, req in requests.items():
            w = waited.get(ticket)
            if w is None:
                continue  # still in flight, or cancelled
            common = {"cat": "flow", "name": "read", "id": ticket, "pid": pid}
            flows.append({"ph": "s", "tid": req.tid, "ts": mid(req.start_ns, req.end_ns),
                          **common})
            if ticket in reads:
                lane, start, end = reads[ticket]
                flows.append({"ph": "t", "tid": lane, "ts": mid(start, end), **common})
            flows.append({"ph": "f", "bp": "e", "tid": w.tid, "ts": mid(w.start_ns, w.end_ns),
                          **common})

        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        data = {"traceEvents": self._metadata(pid, reader_kinds) + events + flows,
                "displayTimeUnit": "ms",
                "otherData": {"generator": f"pyloader {__version__}", "clock": CLOCK,
                              "origin_ns": origin,
                              "duration_ns": (self.end_ns or time.monotonic_ns()) - origin,
                              "dropped_events": self.dropped, **self.meta}}
        data["otherData"]["summary"] = summarize(data)
        return data

    def _pass_spans(self, complete) -> list[dict]:
        """One ``pass`` span per forward pass, from its first unit's start to the next pass's."""
        tid, last = {}, {}
        for s in self.spans:
            tid.setdefault(s.args["pass"], s.tid)
            last[s.args["pass"]] = max(last.get(s.args["pass"], 0), s.end_ns)
        out = []
        for k, (number, start) in enumerate(self.passes):
            end = self.passes[k + 1][1] if k + 1 < len(self.passes) else last.get(number, start)
            lane = tid.get(number, threading.get_native_id())
            out.append(complete("pass", f"pass {number}", lane, start, end, {"pass": number}))
        return out

    def _metadata(self, pid: int, reader_kinds: dict[int, set[str]]) -> list[dict]:
        meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                 "args": {"name": f"pyloader {self.meta.get('strategy', '')} streaming: "
                                  f"{self.meta.get('checkpoint', '')}"}}]
        lanes = [(tid, "compute (Python)") for tid in sorted({s.tid for s in self.spans})]
        lanes += [(tid, f"reader ({', '.join(sorted(kinds))})")
                  for tid, kinds in sorted(reader_kinds.items())]
        for order, (tid, name) in enumerate(lanes):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                         "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                         "args": {"sort_index": order}})
        return meta

    def summary(self) -> dict[str, Any]:
        """:func:`summarize` of this timeline."""
        return summarize(self.to_chrome())

    def write(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Write the Chrome trace JSON to ``path`` atomically; returns the object written."""
        data = self.to_chrome()
        write_atomic(path, json.dumps(data, separators=(",", ":")))
        return data


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """Where the time went in a :class:`Timeline` trace: seconds per category on the
    compute thread (plus ``other``) and reader threads, bytes read and rate, and per pass."""
    other = trace.get("otherData", {})
    compute = dict.fromkeys(UNIT_CATEGORIES + ("other",), 0.0)
    reader = dict.fromkeys(READER_CATEGORIES, 0.0)
    per_pass: dict[Any, dict[str, float]] = {}
    bytes_read = 0
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        seconds, args, cat = e["dur"] / 1e6, e.get("args", {}), e.get("cat")
        if cat == "pass":
            per_pass.setdefault(args["pass"], dict.fromkeys(compute, 0.0))["total"] = seconds
        elif "reader_thread" in args:
            reader[cat] = reader.get(cat, 0.0) + seconds
            bytes_read += args.get("bytes", 0) if cat == "read" else 0
        else:
            compute[cat] = compute.get(cat, 0.0) + seconds
            row = per_pass.setdefault(args.get("pass"), dict.fromkeys(compute, 0.0))
            row[cat] = row.get(cat, 0.0) + seconds
    rows = []
    for number, row in sorted(per_pass.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        if "total" in row:
            row["other"] = max(row["total"] - sum(row[c] for c in UNIT_CATEGORIES), 0.0)
            compute["other"] += row["other"]
        rows.append({"pass": number, **row})
    out = {
        "passes": sum(1 for r in rows if "total" in r),
        "streamed_units": len(other.get("units", [])),
        "pass_s": sum(r.get("total", 0.0) for r in rows),
        "compute_thread_s": compute,
        "reader_threads_s": reader,
        "bytes_read": bytes_read,
        "read_gbps": bytes_read / reader["read"] / 1e9 if reader["read"] else None,
        "dropped_events": other.get("dropped_events", 0),
        "per_pass": rows,
    }
    if not out["streamed_units"]:
        out["note"] = ("no streamed units (every layer resident): nothing streams, so the "
                       "trace has no unit events")
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """One line of :func:`summarize`'s totals."""
    if "note" in summary:
        return summary["note"]
    ct, rt = summary["compute_thread_s"], summary["reader_threads_s"]
    total = sum(ct.values()) or 1.0
    parts = ", ".join(f"{c} {ct[c]:.3f} s ({100 * ct[c] / total:.0f}%)"
                      for c in ct if ct[c] > 0)
    rate = f", {summary['read_gbps']:.2f} GB/s" if summary["read_gbps"] else ""
    line = (f"{summary['passes']} passes x {summary['streamed_units']} streamed units | "
            f"compute thread: {parts} | reader threads: read {rt['read']:.3f} s "
            f"({summary['bytes_read'] / 1e6:.0f} MB{rate}), release {rt['release']:.3f} s, "
            f"evict {rt['evict']:.3f} s")
    if summary["dropped_events"]:
        line += f" | {summary['dropped_events']} events dropped"
    return line


