"""Turn ``pytest bench/test_experts_bench.py --benchmark-json=FILE`` into the expert
streaming table, the targets, the simulated-vs-live hit counts and a plot.

    python bench/experts_report.py bench/results/raw/experts.json [--out bench/results/raw]

Writes ``experts.md`` and ``experts.png`` next to the JSON (or into ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchlib.rounds import benchmark_cases
from pyloader.streaming import RoutingTrace, simulate
from pyloader.streaming.experts import COUNTERS, slots_for


def load(path: str) -> dict[str, dict]:
    with open(path) as f:
        return benchmark_cases(json.load(f))


def slots_of(setting, num_experts: int) -> int:
    """Slots per layer of a cache setting (a count or a fraction, as the benchmark uses)."""
    def no_budget(_slots):
        raise ValueError(f"{setting!r}: a byte budget needs the model's tensor sizes")

    return slots_for(setting, num_experts, no_budget)


def add_bounds(cases: dict[str, dict]) -> None:
    """Each case's physical bound: max(bytes read per token / the disk bandwidth of the
    run, compute per token of the same layer residency with every expert in memory)."""
    compute = {"streamed": cases["experts-100"]["decode_s_per_token"]}
    if "experts-100-resident" in cases:
        compute["resident"] = cases["experts-100-resident"]["decode_s_per_token"]
    for c in cases.values():
        layers = c.get("layers", "streamed")
        if layers in compute:
            bound = max(c["bytes_per_token"] / c["disk_bandwidth"], compute[layers])
            c.update(bound_s_per_token=bound, x_bound=c["decode_s_per_token"] / bound)


def table(cases: dict[str, dict]) -> list[str]:
    base = cases["mlx-lm"]["decode_tps"]
    lines = ["| configuration | layers | decode tok/s | x mlx-lm | read MB/token | hit rate (decode) | "
             "stall ms/token | bound s/token | x bound | MLX peak MB | peak RSS MB | "
             "RssAnon MB | same tokens |", "|" + "---|" * 13]
    for name, c in cases.items():
        hit = c.get("decode_hit_rate")
        stall = c.get("decode_stall_s_per_token")
        lines.append(
            f"| {name} | {c.get('layers', '-')} | {c['decode_tps']:.2f} | {c['decode_tps'] / base:.2f} | "
            f"{c['bytes_per_token'] / 1e6:.1f} | {'-' if hit is None else f'{hit:.2f}'} | "
            f"{'-' if stall is None else f'{stall * 1e3:.0f}'} | "
            f"{c.get('bound_s_per_token', float('nan')):.3f} | {c.get('x_bound', float('nan')):.2f} | "
            f"{c['mx_peak'] / 2**20:.0f} | {c['VmHWM'] / 2**20:.0f} | {c['RssAnon'] / 2**20:.0f} | "
            f"{'yes' if c['tokens_match_mlx_lm'] else 'NO'} |")
    return lines


def simulated(cases: dict[str, dict]) -> list[str]:
    t = cases["experts-100"]["trace"]
    trace = RoutingTrace(layers=t["layers"], num_experts=t["num_experts"])
    num_experts = next(iter(trace.num_experts.values()))
    lines = ["| configuration | slots/layer | live hits / misses / evictions | simulated | equal |",
             "|---|---|---|---|---|"]
    for name, c in cases.items():
        if not name.startswith("experts-") or "live_total" not in c:
            continue
        slots = slots_of(c["expert_setting"], num_experts)
        if slots >= num_experts:  # holds every expert: read once at load, never routed
            continue
        sim = simulate(trace, slots, c["expert_policy"])["total"]
        live = c["live_total"]
        same = all(sim[k] == live[k] for k in COUNTERS)
        lines.append(f"| {name} | {slots} | {live['hits']} / {live['misses']} / "
                     f"{live['evictions']} | {sim['hits']} / {sim['misses']} / "
                     f"{sim['evictions']} | {'yes' if same else 'NO'} |")
    return lines


def targets(cases: dict[str, dict]) -> list[str]:
    e25, l0, lb = cases["experts-25"], cases["layer-0"], cases.get("layer-budget")
    rows = [("bytes/token, 25% cache vs layer streaming", e25["bytes_per_token"]
             / l0["bytes_per_token"], "<= 0.25")]
    if lb:
        rows.append(("decode tok/s, 25% cache vs layer streaming at the same memory",
                     e25["decode_tps"] / lb["decode_tps"], ">= 3"))
    rows.append(("per-token time / physical bound, 25% cache", e25.get("x_bound", float("nan")),
                 "<= 1.25"))
    if "experts-25-resident" in cases:
        rows.append(("per-token time / physical bound, 25% cache, layers resident",
                     cases["experts-25-resident"].get("x_bound", float("nan")), "<= 1.25"))
    rows.append(("tokens identical (every configuration)",
                 float(all(c["tokens_match_mlx_lm"] for c in cases.values())), "== 1"))
    return ["| target | measured | goal |", "|---|---|---|"] + [
        f"| {n} | {v:.3f} | {g} |" for n, v, g in rows]


def plot(cases: dict[str, dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [(n, float(c["expert_setting"])) for n, c in cases.items()
             if n in ("experts-12.5", "experts-25", "experts-50", "experts-100")]
    sizes.sort(key=lambda x: x[1])
    xs = [100 * s for _, s in sizes]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(xs, [cases[n]["decode_tps"] for n, _ in sizes], "o-", label="expert cache")
    for name, style, label in (
            ("layer-0", "--", "layer streaming, 0 resident"),
            ("layer-budget", ":", "layer streaming in the 25% cache's memory"),
            ("mlx-lm", "-.", "mlx-lm, all in memory")):
        if name in cases:
            ax[0].axhline(cases[name]["decode_tps"], linestyle=style, color="gray")
            ax[0].annotate(label, (xs[0], cases[name]["decode_tps"]), fontsize=8,
                           xytext=(0, 3), textcoords="offset points")
    ax[0].set_xlabel("experts cached per layer (%)")
    ax[0].set_ylabel("decode tokens/s")
    ax[1].plot(xs, [cases[n]["bytes_per_token"] / 1e6 for n, _ in sizes], "o-")
    ax[1].axhline(cases["layer-0"]["bytes_per_token"] / 1e6, linestyle="--", color="gray")
    ax[1].annotate("layer streaming", (xs[0], cases["layer-0"]["bytes_per_token"] / 1e6),
                   fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax[0].set_title("decode speed (rest of each layer streamed)", fontsize=9)
    ax[1].set_title("bytes read per token (experts + streamed layer parts)", fontsize=9)
    ax[1].set_yscale("log")
    ax[1].set_xlabel("experts cached per layer (%)")
    ax[1].set_ylabel("MB read per token (log)")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = load(args.json)
    add_bounds(cases)
    out = args.out or os.path.dirname(os.path.abspath(args.json))
    c0 = next(iter(cases.values()))
    text = "\n".join([
        f"Disk bandwidth (cold, this run): {c0['disk_bandwidth'] / 1e9:.2f} GB/s; "
        f"{c0['tokens']} sampled tokens per round, {c0['rounds']} rounds, medians.", "",
        *table(cases), "", "Targets:", "", *targets(cases), "",
        "Live hit counts (prompt and decode) against the routing trace of experts-100 "
        "replayed by pyloader.streaming.simulate:", "", *simulated(cases), ""])
    with open(os.path.join(out, "experts.md"), "w") as f:
        f.write(text)
    print(text)
    try:
        plot(cases, os.path.join(out, "experts.png"))
    except ImportError as exc:
        print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
