"""``pyloader.trace``: record a streamed model's timeline into a Chrome trace-event JSON
(and optionally a matplotlib PNG summary) while a block of code runs it. See
docs/streaming.md."""

from __future__ import annotations

import io
import json
import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.nn as nn

from .._util.fs import write_atomic
from ..errors import PlotsUnavailable
from .controller import controller_of
from .timeline import DEFAULT_MAX_EVENTS, UNIT_CATEGORIES, Timeline, summarize

log = logging.getLogger(__name__)

#: One colour per category, the same in every panel.
COLORS = {"wait": "#d62728", "request": "#7f7f7f", "compute": "#2ca02c",
          "release": "#1f77b4", "evict": "#9467bd", "other": "#c7c7c7", "read": "#ff7f0e"}


def require_pyplot(needed_by: str = "the trace's PNG (the JSON needs nothing)"):
    """``matplotlib.pyplot`` (non-interactive backend); PlotsUnavailable naming ``needed_by``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable(
            f"{needed_by} needs matplotlib, which is not installed: pip install matplotlib "
            "(or install pyloader with its 'compare' extra: pip install \"pyloader-mlx[compare]\")"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def trace(model: nn.Module, path: str | os.PathLike[str], *,
          png: str | os.PathLike[str] | None = None,
          max_events: int = DEFAULT_MAX_EVENTS) -> Iterator[Timeline]:
    """Record the timeline of every streamed unit of ``model`` while the block runs, then
    write it to ``path`` as Chrome trace-event JSON and, with ``png``, its PNG summary (atomic
    writes; written also when the block raises). Start it between forward passes.

    Yields:
        The :class:`.timeline.Timeline` being recorded.

    Raises:
        PlotsUnavailable: ``png`` was given and matplotlib is missing (before recording).
        ValueError: ``model`` was not loaded by pyloader.
        RuntimeError: A timeline is already being recorded for this model.
    """
    if png is not None:
        require_pyplot()
    ctl = controller_of(model)
    timeline = ctl.start_timeline(max_events)
    try:
        yield timeline
    finally:
        ctl.stop_timeline()
        data = timeline.write(path)
        if png is not None:
            plot_trace(data, png)
        if not ctl.layout.units:
            log.warning("%s: %s", os.fspath(path), data["otherData"]["summary"]["note"])


def plot_trace(trace: dict[str, Any] | str | os.PathLike[str],
               path: str | os.PathLike[str]) -> None:
    """Draw a trace (object or JSON file) as a PNG at ``path``: the last pass as a
    Gantt chart, seconds per pass by category, and the totals.

    Raises:
        PlotsUnavailable: matplotlib is missing.
    """
    plt = require_pyplot()
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    summary = summarize(trace)
    fig = plt.figure(figsize=(13, 8.5), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=(1.1, 1.0))
    _gantt(fig.add_subplot(grid[0, :]), trace, summary)
    _per_pass(fig.add_subplot(grid[1, 0]), summary)
    _totals(fig.add_subplot(grid[1, 1]), summary)
    other = trace.get("otherData", {})
    fig.suptitle(f"{os.path.basename(str(other.get('checkpoint', '')))}: "
                 f"{other.get('strategy', '?')}, prefetch {other.get('prefetch', '?')}, "
                 f"{summary['streamed_units']} streamed units, {summary['passes']} passes",
                 fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def _lanes(trace: dict[str, Any]) -> list[tuple[int, str]]:
    """(tid, name) of every named thread, in the trace's sort order."""
    names, order = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e["name"] == "thread_sort_index":
            order[e["tid"]] = e["args"]["sort_index"]
    return sorted(names.items(), key=lambda kv: order.get(kv[0], 0))


def _gantt(ax, trace: dict[str, Any], summary: dict[str, Any]) -> None:
    passes = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == "pass"]
    if not passes:
        ax.text(0.5, 0.5, summary.get("note", "no forward pass was recorded"),
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    last = max(passes, key=lambda e: e["ts"])
    lo, hi = last["ts"], last["ts"] + last["dur"]
    lanes = _lanes(trace)
    row = {tid: k for k, (tid, _) in enumerate(lanes)}
    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if (e.get("ph") != "X" or e["cat"] == "pass" or e["tid"] not in row
                or e["ts"] + e["dur"] < lo or e["ts"] > hi):
            continue
        # A synchronous read drawn inside a wait gets the lower half of the lane.
        inner = "reader_thread" in e["args"] and e["args"]["reader_thread"] != e["tid"]
        start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        bars.setdefault((row[e["tid"]], e["cat"], inner), []).append(
            ((start - lo) / 1000, (end - start) / 1000))
    seen = set()
    for (k, cat, inner), spans in sorted(bars.items(), key=lambda kv: kv[0][2]):
        y, h = (k, 0.4) if inner else (k - 0.4, 0.8)
        ax.broken_barh(spans, (y, h), facecolors=COLORS.get(cat, "black"),
                       label=None if cat in seen else cat)
        seen.add(cat)
    ax.set_yticks(range(len(lanes)), [name for _, name in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1000)
    ax.set_xlabel("ms since the pass began")
    ax.set_title(f"last forward pass ({last['name']}, {last['dur'] / 1000:.1f} ms): "
                 "compute thread and reader threads")
    if seen:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def _per_pass(ax, summary: dict[str, Any]) -> None:
    rows = [r for r in summary["per_pass"] if "total" in r]
    xs = [r["pass"] for r in rows]
    bottom = [0.0] * len(rows)
    drawn = False
    for cat in UNIT_CATEGORIES + ("other",):
        ys = [r.get(cat, 0.0) for r in rows]
        if any(ys):
            ax.bar(xs, ys, bottom=bottom, color=COLORS[cat], label=cat, width=0.8)
            bottom = [b + y for b, y in zip(bottom, ys)]
            drawn = True
    ax.set_xlabel("forward pass (the first ones: prompt)")
    ax.set_ylabel("seconds on the compute thread")
    ax.set_title("each pass by category")
    if drawn:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _totals(ax, summary: dict[str, Any]) -> None:
    ct = summary["compute_thread_s"]
    rt = {c: v for c, v in summary["reader_threads_s"].items() if v}  # mmap evicts on ct
    labels = [f"compute thread: {c}" for c in ct] + [f"reader threads: {c}" for c in rt]
    values = list(ct.values()) + list(rt.values())
    colors = [COLORS[c] for c in ct] + [COLORS[c] for c in rt]
    bars = ax.barh(range(len(values)), values, color=colors)
    for k in range(len(ct), len(values)):
        bars[k].set_hatch("//")
    total = sum(ct.values()) or 1.0
    for k, v in enumerate(values):
        share = f" ({100 * v / total:.0f}%)" if k < len(ct) else ""
        ax.text(v, k, f" {v:.3f} s{share}", va="center", fontsize=8)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (all passes)")
    rate = f", {summary['read_gbps']:.2f} GB/s" if summary["read_gbps"] else ""
    ax.set_title(f"total by category (read {summary['bytes_read'] / 1e6:.0f} MB{rate})")
    ax.set_xlim(0, max(values + [1e-9]) * 1.35)
    ax.grid(axis="x", alpha=0.3)


