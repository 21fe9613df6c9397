"""Measuring child for the residency cost model: predicted vs measured speed.

One fresh process loads the model with every layer resident; each round calibrates
(:func:`pyloader.residency.calibrate_loaded`) and then, for each named resident set,
moves layers to match (:func:`~pyloader.residency.admit_layers` /
:func:`~pyloader.residency.shed_layers`; the rest streamed cold, mmap), measures the
median decode step (and, with ``--prefill-chunk``, one prefill chunk) and records what
:func:`~pyloader.residency.predict` says for the same set with that round's calibration.
Used by ``tests/test_residency_real.py`` and ``bench/prediction_bench.py``.

    python -m pyloader._residency_measure PATH SETS_JSON ROUNDS TOKENS [--prefill-chunk]

SETS_JSON maps a name to a list of resident layer indices. Prints one JSON row per round
to stderr as it goes and the list of rows to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

#: Prompt tokens of the calibration's (and the timed) prefill chunk.
PREFILL_TOKENS = 8
#: Calibrated constants a summary takes the median of over rounds.
CONSTANTS = ("disk_bytes_per_s", "stream_bytes_per_s", "decode_s_per_byte",
             "prefill_s_per_byte_token", "unit_overhead_s", "release_s_per_byte")


def measure(path: str, sets: dict[str, list[int]], rounds: int, tokens: int,
            prefill_chunk: bool = False) -> list[dict]:
    import pyloader
    from pyloader import residency
    from pyloader.budget import model_budget
    from pyloader.residency import _decode_steps, _prefill_time, admit_layers, shed_layers

    model, _ = pyloader.load_model(path, resident=1.0, tokenizer=False)
    budget = model_budget(path)
    n = budget.n_layers
    prompt = [(7 * i + 3) % 256 for i in range(PREFILL_TOKENS)]
    rows = []
    for _ in range(rounds):
        cal = residency.calibrate_loaded(model, path, tokens=tokens,
                                         prefill_tokens=PREFILL_TOKENS)
        row = {"calibration": cal.to_dict(), "measured": {}, "predicted": {}}
        if prefill_chunk:
            row.update(prefill_measured={}, prefill_predicted={})
        for name, layers in sets.items():
            keep = set(layers)
            admit_layers(model, keep)
            shed_layers(model, set(range(n)) - keep)
            _decode_steps(model, [1, 2, 3, 4], 1)  # settle: the first pass re-reads
            _, steps, _ = _decode_steps(model, [1, 2, 3, 4, 5, 6, 7, 8], tokens)
            pred = residency.predict(budget, keep, cal)
            row["measured"][name] = statistics.median(steps)
            row["predicted"][name] = pred["decode_s_per_token"]
            if prefill_chunk:
                # One forward pass over the chunk (fresh cache), median of 2.
                row["prefill_measured"][name] = _prefill_time(model, prompt, repeats=2)
                row["prefill_predicted"][name] = pred["prefill_s_per_chunk"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def median_calibration(rows: list[dict]):
    """A :class:`~pyloader.residency.Calibration` with the median of every calibrated
    constant over the rounds (the rest from the first round)."""
    from pyloader.residency import Calibration

    cals = [r["calibration"] for r in rows]
    return Calibration.from_dict({**cals[0], **{
        key: statistics.median(c[key] for c in cals) for key in CONSTANTS}})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyloader._residency_measure",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("sets", type=json.loads, help="JSON: name -> resident layer indices")
    ap.add_argument("rounds", type=int)
    ap.add_argument("tokens", type=int)
    ap.add_argument("--prefill-chunk", action="store_true",
                    help="also time one prefill chunk per set")
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.path, args.sets, args.rounds, args.tokens,
                             args.prefill_chunk)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
