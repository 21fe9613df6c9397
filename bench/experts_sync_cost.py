"""Where the time of an expert cache goes with the layers resident, warm page cache:
every expert in memory without a hook, every expert hooked (the per-layer routing
synchronization alone), and a 25% cache (synchronization + reads from the page cache).

    python bench/experts_sync_cost.py MODEL_DIR [--rounds 2]

Each setting runs in its own process (a 32-token prompt, then 32 decoded tokens, one
forward pass each), alternating settings round by round; prints the median ms/token.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"all": 1.0, "all-hooked": 1.0, "25%": 0.25}


def child(path: str, setting: str) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from pyloader.loading import load_model
    from pyloader.streaming import StreamOptions, controller_of

    options = StreamOptions(experts=SETTINGS[setting], keep_page_cache=True)
    model, _ = load_model(path, resident=1.0, options=options, tokenizer=False)
    hooked = setting == "all-hooked"
    with controller_of(model).routing_trace() if hooked else contextlib.nullcontext():
        cache = make_prompt_cache(model)
        toks = np.random.default_rng(0).integers(0, model.args.vocab_size, size=64)
        mx.eval(model(mx.array(toks[:32])[None], cache=cache))
        times = []
        for t in toks[32:]:
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[int(t)]]), cache=cache))
            times.append(time.perf_counter() - t0)
    print(f"{statistics.median(times) * 1e3:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.child)
        return 0
    from pyloader.io.checkpoint import Checkpoint
    from pyloader.io.pagecache import warm

    warm(Checkpoint(args.model).files)
    results: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.rounds):
        for s in SETTINGS:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), args.model,
                                  "--child", s],
                                 check=True, capture_output=True, text=True)
            results[s].append(float(out.stdout.strip().splitlines()[-1]))
    for s, v in results.items():
        print(f"{s:>11}: {' '.join(f'{x:.1f}' for x in v)} ms/token (median {statistics.median(v):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
