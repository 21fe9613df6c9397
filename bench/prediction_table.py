"""The machine-calibration table of docs/memory-planning.md, from the results of
``bench/prediction_bench.py --machine`` (``bench/results/raw/prediction-*-machine.json``):
per model and residency level, the measured decode tok/s (median over the rounds), the
machine calibration's prediction (median constants over the rounds' calibrations) and the
error in s/token, with each round's own error. Prints markdown.

    python bench/prediction_table.py [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchlib.paths import RAW

RESULTS = RAW
#: Row order and labels: the result label's model part.
MODELS = [("smollm2-135m-4bit", "default SmolLM2-135M"),
          ("synthetic-llama-300MB-f32", "llama 300 MB f32"),
          ("synthetic-llama-300MB-f16", "llama 300 MB f16"),
          ("synthetic-llama-300MB-bf16", "llama 300 MB bf16"),
          ("synthetic-qwen3-300MB-bf16", "qwen3 300 MB bf16"),
          ("synthetic-llama-300MB-q8", "llama 300 MB q8"),
          ("synthetic-llama-300MB-q4", "llama 300 MB q4"),
          ("synthetic-qwen3-300MB-q4", "qwen3 300 MB q4")]
LIMIT = 0.25


def fmt_of(machine: dict) -> str:
    f = machine["detail"]["format"]
    q = f"q{f['bits']}g{f['group_size']}, {f['weights']} scales, " if f.get("bits") else ""
    return f"{q}{f['activation']} act., {f['unit_bytes'] >> 20} MiB units"


def table(results: Path) -> tuple[str, int, int]:
    lines = ["| model (format) | layers | when, load | 0% resident: measured / machine tok/s, "
             "error (rounds) | 50% | 100% |", "|---|---|---|---|---|---|"]
    within = total = 0
    for stem, name in MODELS:
        f = results / f"prediction-{stem}-machine.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        s = r["summary"]
        cells = []
        for row in s["sets"]:
            total += 1
            ok = abs(row["machine_error"]) <= LIMIT
            within += ok
            err = f"{row['machine_error']:+.1%}"
            own = ", ".join(f"{e:+.0%}" for e in row.get("machine_round_errors", []))
            cells.append(f"{row['measured_tps']:.2f} / {row['machine_tps']:.2f}, "
                         + (err if ok else f"**{err}**") + (f" ({own})" if own else ""))
        of = s["sets"][0]["of"]
        la = r.get("load_average", [None])[0]
        lines.append(f"| {name} ({fmt_of(s['machine'])}) | {of} | {r['when'][5:16]}, "
                     f"{la:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines), within, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    text, within, total = table(args.results)
    print(text)
    print(f"\n{within} of {total} cells within {LIMIT:.0%}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
