"""Predicted vs measured decode speed of the residency planner's cost model.

The measuring child is the ``residency`` workload (``bench/benchlib/workloads/residency.py``;
one fresh process; each round calibrates, then measures the median decode step and one prefill chunk at
each residency level — the first ``k`` layers resident, the rest streamed cold from
disk, mmap — and records ``residency.predict`` for the same set with that round's
calibration). Reported per level: the median measurement over the rounds, the
prediction from the median calibration constants, and the error in s/token (the
quantity `tests/test_residency_real.py` holds within 25%); the same for one prefill
chunk of 8 tokens (a forward pass with a fresh cache).

``--plan-ram SIZE`` measures the planner's own resident set for that budget against
the naive one of the same size (the first layers): is its placement really faster?

``--machine`` also predicts every level from the machine calibration alone
(``residency.calibrate_machine`` in the model's format, measured in a fresh process just
before each round's levels, never from the cache; the prediction uses the median of each
constant over the rounds), next to the per-model prediction. Each round is then its own
child process (calibration, model load, levels), so the machine calibration and the
measurement it predicts are minutes apart, not the length of the whole run.
``synthetic:SIZE:FORMAT:ARCH`` picks the synthetic model's format: f32, f16, bf16
(default), q4, q8 (quantized from bf16, group size 64), and architecture: llama (default)
or qwen3.

Commands:
    python bench/prediction_bench.py --model default --levels 0,8,15,22,30
    python bench/prediction_bench.py --model synthetic:500MB --levels 0,1,2,3,4
    python bench/prediction_bench.py --model default --plan-ram 520MB --context 2048
    python bench/prediction_bench.py --model synthetic:300MB:q4 --levels 0,4,8 --machine
    python bench/prediction_bench.py --model synthetic:120MB:bf16:qwen3 --levels 0,1,2 --machine
Results: bench/results/raw/prediction-<label>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pyloader.compare.harness import environment
from benchlib.paths import RAW
from benchlib.workloads import RESIDENCY

RESULTS = RAW


def model_path(spec: str, root: Path) -> tuple[Path, str]:
    if spec == "default":
        from pyloader.default_model import default_model_path

        return Path(default_model_path()), "smollm2-135m-4bit"
    if spec.startswith("synthetic:"):
        from benchlib.synthetic import make_model
        from pyloader.io.repack import repack
        from pyloader.residency import parse_bytes

        size, fmt, arch = (spec.split(":", 1)[1].split(":") + ["", ""])[:3]
        fmt, arch = fmt or "bf16", arch or "llama"
        if fmt not in ("f32", "f16", "bf16", "q4", "q8"):
            raise SystemExit(f"unknown synthetic format {fmt!r}: f32, f16, bf16, q4, q8")
        label = f"synthetic-{arch}-{size}-{fmt}"
        src = make_model(root / label / "raw", parse_bytes(size),
                         dtype="bf16" if fmt.startswith("q") else fmt, arch=arch)
        if fmt.startswith("q"):
            src = _quantized(src, root / label / "quantized", int(fmt[1:]))
        dst = root / label / "aligned"  # every tensor aligned: zero-copy streaming
        if not (dst / "config.json").exists():
            repack(src, dst, overwrite=True)  # copies config.json and the rest too
        return dst, label
    return Path(spec), Path(spec).name


def _quantized(src: Path, dst: Path, bits: int) -> Path:
    """``src`` quantized with mlx-lm (group size 64), written once to ``dst``."""
    if (dst / "config.json").exists():
        return dst
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src)
    model, config = quantize_model(model, config, group_size=64, bits=bits)
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model)
    save_config(config, dst / "config.json")
    return dst


def machine_calibration(path: Path) -> dict:
    """The machine calibration in the model's format, measured now in a fresh process."""
    import subprocess

    code = ("import json, sys\n"
            "from pyloader.residency import calibrate_machine, format_of, model_budget\n"
            "b = model_budget(sys.argv[1])\n"
            "c = calibrate_machine(format_of(b, sys.argv[1]), force=True)\n"
            "print(json.dumps(c.to_dict()))\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(rows: list[dict], path: Path, sets: dict[str, list[int]],
              machines: list[dict] | None = None) -> dict:
    from benchlib.workloads.residency import PREFILL_TOKENS as PREFILL
    from benchlib.workloads.residency import median_calibration
    from pyloader.residency import Calibration, format_ranges, predict
    from pyloader.residency.budget import model_budget

    med = median_calibration(rows)
    mcal = median_calibration([{"calibration": m} for m in machines]) if machines else None
    budget = model_budget(path)
    table = []
    for name, layers in sets.items():
        measured = statistics.median(r["measured"][name] for r in rows)
        predicted = predict(budget, layers, med)["decode_s_per_token"]
        pre_m = statistics.median(r["prefill_measured"][name] for r in rows)
        pre_p = predict(budget, layers, med, prefill_tokens=PREFILL)["prefill_s_per_chunk"]
        table.append({"name": name, "resident": len(layers), "of": budget.n_layers,
                      "layers": format_ranges(sorted(layers)), "measured_tps": 1 / measured,
                      "rounds_tps": [1 / r["measured"][name] for r in rows],
                      "predicted_tps": 1 / predicted, "error": predicted / measured - 1,
                      "prefill_measured_tps": PREFILL / pre_m,
                      "prefill_predicted_tps": PREFILL / pre_p,
                      "prefill_error": pre_p / pre_m - 1})
        if mcal is not None:
            mp = predict(budget, layers, mcal, prefill_tokens=PREFILL)
            # Each round against its own machine calibration too (how far one moves).
            own = [predict(budget, layers, Calibration.from_dict(m))["decode_s_per_token"]
                   / r["measured"][name] - 1 for m, r in zip(machines, rows)]
            table[-1].update(machine_tps=1 / mp["decode_s_per_token"],
                             machine_round_errors=own,
                             machine_error=mp["decode_s_per_token"] / measured - 1,
                             machine_prefill_tps=PREFILL / mp["prefill_s_per_chunk"],
                             machine_prefill_error=mp["prefill_s_per_chunk"] / pre_m - 1)
    return {"sets": table, "calibration": med.to_dict(),
            "machine": mcal.to_dict() if mcal else None, "machines": machines}


def render(label: str, summary: dict, rounds: int, tokens: int) -> str:
    from benchlib.workloads.residency import PREFILL_TOKENS as PREFILL

    c = summary["calibration"]
    lines = [f"# Prediction vs measurement: {label}", "",
             f"{rounds} rounds, median of {tokens} decode steps per level and round; median "
             f"calibration: disk {c['disk_bytes_per_s'] / 1e9:.2f} GB/s, streaming reads "
             f"{(c['stream_bytes_per_s'] or c['disk_bytes_per_s']) / 1e9:.2f} GB/s, compute "
             f"{1e-9 / c['decode_s_per_byte']:.2f} GB/s of weights, unit overhead "
             f"{c['unit_overhead_s'] * 1e3:.1f} ms, page-cache drop "
             f"{c['release_s_per_byte'] * 1e11:.1f} ms/100 MB", "",
             "| set | resident layers | decode: measured tok/s (rounds) | predicted | "
             f"error (s/token) | prefill ({PREFILL}-token chunk): measured tok/s | predicted "
             "| error (s/chunk) |", "|---|---|---|---|---|---|---|---|"]
    machine = summary.get("machine")
    if machine:
        fmt = machine["detail"].get("format", {})
        ms = summary.get("machines") or [machine]
        busy = [m["detail"]["contended"] for m in ms if m["detail"].get("contended")]
        lines[-2] += (" machine: decode tok/s | error (each round against its own "
                      "calibration) | prefill tok/s | error |")
        lines[-1] += "---|---|---|---|"
        lines.insert(3, f"Machine calibration ({fmt.get('weights')} weights, "
                        f"{fmt.get('activation')} activations"
                        + (f", q{fmt['bits']}g{fmt['group_size']}" if fmt.get("bits") else "")
                        + f"; median of {len(ms)}, one before each round; "
                        + (f"contended in {len(busy)}: {'; '.join(busy)}" if busy
                           else "none contended")
                        + f"): compute {1e-9 / machine['decode_s_per_byte']:.2f} GB/s of "
                        f"weights, disk {machine['disk_bytes_per_s'] / 1e9:.2f} GB/s, "
                        f"streaming reads {machine['stream_bytes_per_s'] / 1e9:.2f} GB/s, "
                        f"unit overhead {machine['unit_overhead_s'] * 1e3:.1f} ms, "
                        f"page-cache drop {machine['release_s_per_byte'] * 1e11:.1f} ms/100 MB.")
        lines.insert(4, "")
    for r in summary["sets"]:
        rounds_txt = ", ".join(f"{x:.2f}" for x in r["rounds_tps"])
        own = ", ".join(f"{e:+.0%}" for e in r.get("machine_round_errors", []))
        lines.append(f"| {r['name']} | {r['resident']}/{r['of']} {r['layers']} | "
                     f"{r['measured_tps']:.2f} ({rounds_txt}) | {r['predicted_tps']:.2f} | "
                     f"{r['error']:+.1%} | {r['prefill_measured_tps']:.1f} | "
                     f"{r['prefill_predicted_tps']:.1f} | {r['prefill_error']:+.1%} |"
                     + (f" {r['machine_tps']:.2f} | {r['machine_error']:+.1%} ({own}) | "
                        f"{r['machine_prefill_tps']:.1f} | {r['machine_prefill_error']:+.1%} |"
                        if machine else ""))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="default, synthetic:SIZE or a path")
    ap.add_argument("--levels", default=None, help="resident layer counts, e.g. 0,1,2,3,4")
    ap.add_argument("--plan-ram", default=None, metavar="SIZE",
                    help="instead of levels: the planner's resident set for this budget "
                         "against the first layers of the same count")
    ap.add_argument("--context", type=int, default=2048, help="context for --plan-ram")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--machine", action="store_true",
                    help="also predict from the machine calibration alone (measured first)")
    args = ap.parse_args()
    from pyloader.compare.system import cache_dir
    from pyloader.residency.budget import model_budget

    path, label = model_path(args.model, cache_dir("bench"))
    n = model_budget(path).n_layers
    if args.plan_ram:
        from pyloader.residency import KVSpec, plan

        chosen = list(plan(path, args.plan_ram, kv=KVSpec(context=args.context),
                           calibration="measure").resident_layers)
        sets = {"planned": chosen, f"first {len(chosen)}": list(range(len(chosen)))}
        label += f"-plan-{args.plan_ram}"
    else:
        levels = ([int(x) for x in args.levels.split(",")] if args.levels
                  else sorted({0, n // 4, n // 2, 3 * n // 4, n}))
        sets = {f"first {k}": list(range(k)) for k in levels}
    t0 = time.perf_counter()
    from pyloader.compare.protocol import run_child

    def measure(rounds: int) -> list[dict]:
        return run_child(RESIDENCY, [str(path), json.dumps(sets), str(rounds),
                                       str(args.tokens), "--prefill-chunk"],
                         timeout=7200)["rows"]

    machines = None
    if args.machine:
        label += "-machine"
        machines, rows = [], []
        for _ in range(args.rounds):
            machines.append(machine_calibration(path))
            rows += measure(1)
    else:
        rows = measure(args.rounds)
    summary = summarize(rows, path, sets, machines)
    report = {"model": str(path), "label": label, "rounds": rows, "summary": summary,
              "seconds": time.perf_counter() - t0, "tokens": args.tokens,
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg(),
              "env": environment()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"prediction-{label}.json").write_text(json.dumps(report, indent=1))
    md = render(label, summary, args.rounds, args.tokens)
    (args.out / f"prediction-{label}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
