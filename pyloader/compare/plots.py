"""PNG plots of a ``pyloader compare`` report (needs matplotlib)."""

from __future__ import annotations

import os

from ..errors import PlotsUnavailable
from ..streaming.trace import require_pyplot
from . import genbench


def plot_report(report: dict, out_dir: str) -> list[str]:
    """Draw a generation comparison's plots into ``out_dir``; returns their paths.

    Raises:
        PlotsUnavailable: matplotlib is missing.
    """
    plt = require_pyplot("plots")
    os.makedirs(out_dir, exist_ok=True)
    keys = list(dict.fromkeys((s["checkpoint"], s["cache"]) for s in report["summary"]))
    if not keys:
        return []
    return [_memory_plot(plt, report, keys, os.path.join(out_dir, "memory.png")),
            _tps_plot(plt, report, keys, os.path.join(out_dir, "tps_vs_resident.png"))]


def _labels(report: dict, key: tuple) -> list[str]:
    return sorted({s["strategy"] for s in report["summary"]
                   if (s["checkpoint"], s["cache"]) == key}, key=genbench.sort_key)


def _memory_plot(plt, report, keys, path) -> str:
    fig, axes = plt.subplots(len(keys), 2, figsize=(13, 4.2 * len(keys)), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for row, key in enumerate(keys):
        for i, label in enumerate(_labels(report, key)):
            trace = genbench.median_trace(report, *key, label)
            if not trace or not trace["samples"]:
                continue
            t = [s[0] for s in trace["samples"]]
            style = "--" if label.endswith("+kv") else "-"
            for col, idx in ((0, 1), (1, 2)):
                # None: a figure this platform does not report (no line for it)
                axes[row][col].plot(t, [s[idx] / 2**20 if s[idx] is not None else float("nan")
                                        for s in trace["samples"]], style,
                                    color=cmap(i % 20), label=label, linewidth=1.2)
        for col, what in enumerate(("RSS (VmRSS)", "anonymous RSS (RssAnon)")):
            ax = axes[row][col]
            ax.set_title(f"{key[0]} [{key[1]}]: {what}")
            ax.set_xlabel("seconds since go (load, prompt, decode)")
            ax.set_ylabel("MiB")
            ax.grid(alpha=0.3)
        axes[row][1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tps_plot(plt, report, keys, path) -> str:
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 4.2 * len(keys)), squeeze=False)
    for row, key in enumerate(keys):
        summary = [s for s in report["summary"] if (s["checkpoint"], s["cache"]) == key]
        for col, metric in enumerate(("decode_tps", "prompt_tps")):
            ax = axes[row][col]
            for kv, marker in (("default", "o"), ("prealloc", "s")):
                pts = []
                for s in summary:
                    cfg = genbench.Config.parse(s["strategy"])
                    frac = cfg.resident_fraction
                    if cfg.kv != kv or s.get(metric) is None:
                        continue
                    if frac is None and s.get("resident_bytes") and s.get("bytes"):
                        frac = s["resident_bytes"] / s["bytes"]
                    if frac is None:
                        continue
                    pts.append((frac, s, cfg))
                stream = sorted((p for p in pts if p[2].strategy == "stream"), key=lambda p: p[0])
                suffix = " + preallocated KV" if kv == "prealloc" else ""
                if stream:
                    xs = [p[0] for p in stream]
                    ys = [p[1][metric] for p in stream]
                    err = [[y - p[1][metric + "_min"] for y, p in zip(ys, stream)],
                           [p[1][metric + "_max"] - y for y, p in zip(ys, stream)]]
                    ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3,
                                label=f"stream{suffix}")
                for frac, s, cfg in pts:
                    if cfg.strategy == "stream":
                        continue
                    ax.errorbar([frac], [s[metric]],
                                yerr=[[s[metric] - s[metric + "_min"]],
                                      [s[metric + "_max"] - s[metric]]],
                                marker=marker, linestyle="none", capsize=3,
                                label=f"{cfg.strategy}{suffix}")
            ax.set_xlabel("resident fraction of the layers")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{key[0]} [{key[1]}]: "
                         f"{'decode' if metric == 'decode_tps' else 'prompt'} tok/s")
            ax.set_xlim(-0.05, 1.1)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["PlotsUnavailable", "plot_report"]
