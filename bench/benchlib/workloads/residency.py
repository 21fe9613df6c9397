"""The ``residency`` workload: the cost model's predicted vs measured speed.

Set-up: one fresh process loads the model with every layer resident. Then each round
calibrates (:func:`pyloader.residency.calibrate_loaded`) and, for each named resident set,
moves layers to match (the model's streaming controller: ``admit`` / ``shed``; the rest
streamed cold, mmap), measures the median decode step (and, with ``--prefill-chunk``, one
prefill chunk) and records what :func:`pyloader.residency.predict` says for the same set
with that round's calibration. Each round is printed to stderr as it finishes; the result
is ``{"rows": [one row per round]}``. Used by ``tests/test_residency_real.py`` and
``bench/prediction_bench.py``.

    python -m pyloader.compare.child bench/benchlib/workloads/residency.py \
        PATH SETS_JSON ROUNDS TOKENS [--prefill-chunk]

SETS_JSON maps a name to a list of resident layer indices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from pyloader.loading import load_model
from pyloader.residency.budget import model_budget
from pyloader.residency.calibration import Calibration, calibrate_loaded, decode_steps, prefill_time
from pyloader.residency.cost import predict
from pyloader.streaming import controller_of

#: Prompt tokens of the calibration's (and the timed) prefill chunk.
PREFILL_TOKENS = 8
#: Calibrated constants a summary takes the median of over rounds.
CONSTANTS = ("disk_bytes_per_s", "stream_bytes_per_s", "decode_s_per_byte",
             "prefill_s_per_byte_token", "unit_overhead_s", "release_s_per_byte")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("sets", type=json.loads, help="JSON: name -> resident layer indices")
    p.add_argument("rounds", type=int)
    p.add_argument("tokens", type=int)
    p.add_argument("--prefill-chunk", action="store_true",
                   help="also time one prefill chunk per set")


def prepare(args) -> tuple[dict, dict]:
    model, _ = load_model(args.path, resident=1.0, tokenizer=False)
    budget = model_budget(args.path)
    return {"layers": budget.n_layers}, {"model": model, "budget": budget}


def run(args, state: dict) -> dict:
    model, budget = state["model"], state["budget"]
    ctl = controller_of(model)
    n = budget.n_layers
    prompt = [(7 * i + 3) % 256 for i in range(PREFILL_TOKENS)]
    rows = []
    for _ in range(args.rounds):
        cal = calibrate_loaded(model, args.path, tokens=args.tokens,
                               prefill_tokens=PREFILL_TOKENS)
        row = {"calibration": cal.to_dict(), "measured": {}, "predicted": {}}
        if args.prefill_chunk:
            row.update(prefill_measured={}, prefill_predicted={})
        for name, layers in args.sets.items():
            keep = set(layers)
            ctl.admit(keep)
            ctl.shed(set(range(n)) - keep)
            decode_steps(model, [1, 2, 3, 4], 1)  # settle: the first pass re-reads
            _, steps, _ = decode_steps(model, [1, 2, 3, 4, 5, 6, 7, 8], args.tokens)
            pred = predict(budget, keep, cal)
            row["measured"][name] = statistics.median(steps)
            row["predicted"][name] = pred["decode_s_per_token"]
            if args.prefill_chunk:
                # One forward pass over the chunk (fresh cache), median of 2.
                row["prefill_measured"][name] = prefill_time(model, prompt, repeats=2)
                row["prefill_predicted"][name] = pred["prefill_s_per_chunk"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return {"rows": rows}


def median_calibration(rows: list[dict]) -> Calibration:
    """A :class:`~pyloader.residency.Calibration` with the median of every calibrated
    constant over the rounds (the rest from the first round)."""
    cals = [r["calibration"] for r in rows]
    return Calibration.from_dict({**cals[0], **{
        key: statistics.median(c[key] for c in cals) for key in CONSTANTS}})
