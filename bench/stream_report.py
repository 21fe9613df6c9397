"""Turns the streaming benchmark's JSON into its table and the target ratios.

    python bench/stream_report.py bench/results/raw/streaming.json [-o FILE]
"""

from __future__ import annotations

import argparse
import json

from benchlib.rounds import benchmark_cases


def render(cases: dict[str, dict]) -> str:
    base = cases["mlx-lm"]
    lines = [
        "| case | decode tok/s | × mlx-lm | TTFT s | prefill tok/s | load s | wait s/pass "
        "| compute s/pass | overlap | peak RSS MB | anon MB | tokens = mlx-lm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, c in cases.items():
        ref = cases.get(f"mlx-lm-batch{c['batch']}", base) if c["batch"] > 1 else base

        def f(key, digits=2):
            v = c.get(key)
            return "–" if v is None else f"{v:.{digits}f}"
        lines.append(
            f"| {name} | {c['decode_tps']:.3f} | {c['decode_tps'] / ref['decode_tps']:.2f} "
            f"| {c['ttft_s']:.2f} | {c['prefill_tps']:.1f} | {c['load_s']:.2f} "
            f"| {f('wait_s_per_pass')} | {f('compute_s_per_pass')} | {f('overlap_efficiency')} "
            f"| {c['VmHWM'] / 2**20:.0f} | {c['RssAnon'] / 2**20:.0f} "
            f"| {'yes' if c['tokens_match_mlx_lm'] else 'NO'} |")
    return "\n".join(lines)


def targets(cases: dict[str, dict]) -> str:
    base, full, zero = cases["mlx-lm"], cases["resident-100"], cases["resident-0"]
    bw = zero["disk_bandwidth"]
    read_s = zero["streamed_bytes_per_pass"] / bw
    compute_s = 1 / full["decode_tps"]  # one forward with everything resident
    bound = max(read_s, compute_s)
    rows = [
        ("100% resident via streaming path / mlx-lm decode tok/s", "≥ 0.97",
         full["decode_tps"] / base["decode_tps"]),
        ("0% resident, prefetch 1: s/token ÷ max(read, compute)", "≤ 1.15",
         zero["decode_s_per_token"] / bound),
        ("prefetch on / off speedup (0% resident)", "> 1",
         cases["resident-0-noprefetch"]["decode_s_per_token"] / zero["decode_s_per_token"]),
    ]
    if "resident-0-batch16" in cases:
        rows.append(("0% resident: batch 16 / batch 1 total tok/s", "grows",
                     cases["resident-0-batch16"]["decode_tps"] / zero["decode_tps"]))
    out = [f"Disk bandwidth (cold pread of the file, this run): {bw / 1e9:.2f} GB/s; "
           f"streamed per token: {zero['streamed_bytes_per_pass'] / 1e9:.2f} GB → read "
           f"{read_s:.2f} s; compute per token (100% resident): {compute_s:.2f} s.", "",
           "| target | goal | measured |", "|---|---|---:|"]
    out += [f"| {a} | {b} | {v:.2f} |" for a, b, v in rows]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("-o", "--output")
    args = p.parse_args()
    with open(args.json) as f:
        found = benchmark_cases(json.load(f))
    text = render(found) + "\n\n" + targets(found) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
