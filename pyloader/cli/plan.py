"""``pyloader plan``: memory table, max context, resident set and predicted tok/s."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .. import residency
from .._util.sizes import parse_amount
from .common import (
    add_expert_arguments,
    add_kernels_argument,
    default_model,
    fail,
    mlx_lm_missing,
    model_location,
    parse_size,
)


def add_parser(sub) -> None:
    """``pyloader plan``."""
    pl = sub.add_parser(
        "plan", help="memory table, max context, resident set and predicted tok/s",
        description="Plan a model for a memory budget: weights (from the checkpoint index, or "
                    "from config.json shapes), KV cache per token (only layers that keep one; "
                    "windows capped), activations, runtime reserve; whether it fits, the max "
                    "context, the resident layers and the predicted prefill/decode tok/s "
                    "(from a calibration measured once and cached). Exits 1 when nothing "
                    "fits the budget, naming the smallest budget that does.",
        epilog="Details: docs/memory-planning.md.")
    pl.add_argument("model", nargs="?", metavar="PATH_OR_CONFIG",
                    help="model directory or config.json (default: the default model)")
    pl.add_argument("--ram", type=parse_size, default=None, metavar="SIZE",
                    help="memory budget for the whole process, e.g. 6GB (default: auto, from "
                         "MemAvailable and this process's cgroup)")
    pl.add_argument("--context", type=int, default=None, metavar="TOKENS",
                    help="expected context (default: min(model max, 4096))")
    pl.add_argument("--kv-bits", type=int, choices=(16, 8, 4), default=16,
                    help="KV cache precision (16: the model's float dtype)")
    pl.add_argument("--priority", choices=("max_tps", "balanced", "max_context"),
                    default="balanced",
                    help="KV reserve: 512 tokens, 1024, or the whole context (default balanced)")
    pl.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None,
                    help="config only: budget the weights quantized to this many bits")
    pl.add_argument("--group-size", type=int, default=64, help="with --bits (default 64)")
    add_expert_arguments(pl)
    add_kernels_argument(pl)
    pl.add_argument("--calibrate", action="store_true",
                    help="re-measure the calibration (the checkpoint's own when it has weights)")
    pl.add_argument("--no-predict", action="store_true", help="no tok/s prediction")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader plan``: the memory table, resident set and predicted tok/s."""
    if (status := mlx_lm_missing("plan")) is not None:
        return status
    try:
        target = model_location(args.model) if args.model is not None else default_model()
    except FileNotFoundError as exc:
        return fail("plan", f"no such model directory or config: {exc}")
    quant = ({"bits": args.bits, "group_size": args.group_size} if args.bits else None)
    kv_bits = None if args.kv_bits == 16 else args.kv_bits
    try:
        budget = residency.model_budget(target, kv_bits=kv_bits, quantization=quant,
                                        experts=parse_amount(args.experts),
                                        expert_source=args.expert_source)
        ram = args.ram if args.ram is not None else "auto"
        kv = residency.KVSpec(context=args.context, priority=args.priority, bits=kv_bits)
        p = residency.plan(budget, ram, kv=kv, calibration=None)
        cal = None
        # A plan that does not fit predicts no speed: nothing to measure for it.
        if p.fits and not args.no_predict and budget.experts == "layer":
            t0 = time.monotonic()
            measured = True  # said only when it measured: a cached one may load slowly
            if args.calibrate:
                cal = residency.calibrate(target, force=True, budget=budget,
                                          kernels=args.kernels)
            elif (cal := residency.cached_calibration(target, budget,
                                                      kernels=args.kernels)) is None:
                print("measuring this machine once (disk and compute; cached) ...",
                      file=sys.stderr, flush=True)
                cal = residency.calibrate_machine(
                    residency.format_of(budget, target, args.kernels))
            else:
                measured = False
            if measured:
                why = cal.detail.get("contended")
                print(f"measured in {time.monotonic() - t0:.0f} s"
                      + (f", under contention ({why}): reused for an hour, then measured "
                         "again" if why else ", cached"), file=sys.stderr)
        if cal is not None:
            p = residency.plan(budget, ram, kv=kv, calibration=cal, kernels=args.kernels)
    except (OSError, ValueError, KeyError, TypeError, MemoryError) as exc:
        return fail("plan", f"{target}: {exc}")
    print(json.dumps(p.to_dict(), indent=1) if args.json else p.render())
    return 0 if p.fits else 1
