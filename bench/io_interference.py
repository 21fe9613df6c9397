"""How much concurrent disk reading slows compute on this machine:
plain mlx-lm decoding a resident model alone, and while another process reads a
file in a loop with ``O_DIRECT`` (what pread streaming does) or through the page cache,
evicting it after each pass (what mmap streaming does). Interleaved rounds, medians.

    python bench/io_interference.py                  # 1 GB f16 llama, reads a 1.6 GB file
    python bench/io_interference.py --rounds 5

Results: ``bench/results/raw/io-interference.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib.paths import RAW

RESULTS = RAW

# pyloader's own eviction (the platform layer's: posix_fadvise on Linux), not
# os.posix_fadvise, which macOS does not have.
EVICT = "import sys, pyloader; pyloader.evict_file(sys.argv[1])"


def reader(mode: str, path: Path) -> subprocess.Popen | None:
    if mode == "alone":
        return None
    if mode == "direct-read":
        if not sys.platform.startswith("linux"):
            raise SystemExit("io_interference: the direct-read mode uses GNU dd's "
                             "iflag=direct (Linux only)")
        loop = f"while true; do dd if={path} of=/dev/null bs=16M iflag=direct status=none; done"
    else:
        loop = (f"while true; do dd if={path} of=/dev/null bs=16M status=none; "
                f"{sys.executable} -c '{EVICT}' {path}; done")
    return subprocess.Popen(["bash", "-c", loop], start_new_session=True)


def main(argv=None) -> int:
    import os

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from pyloader.compare.system import cache_dir
    from pyloader.compare.system import loadavg
    from benchlib.synthetic import make_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=7)
    a = ap.parse_args(argv)
    model_dir = make_model(cache_dir("stream-model-1000000000-f16", create=False), 10**9,
                           dtype="f16")
    other = make_model(cache_dir("stream-model-1600000000", create=False), 1_600_000_000)
    path = other / "model.safetensors"
    model, _ = load_model(model_dir)

    def decode() -> float:
        steps = generate_step(mx.array([1, 2, 3, 4, 5, 6, 7, 8]), model, max_tokens=a.tokens)
        next(steps)
        t = time.perf_counter()
        n = sum(1 for _ in steps)
        return (time.perf_counter() - t) / n

    decode()
    modes = ("alone", "direct-read", "buffered-read")
    res: dict = {m: [] for m in modes}
    start = loadavg()
    for _ in range(a.rounds):
        for mode in modes:
            proc = reader(mode, path)
            time.sleep(0.5)
            res[mode].append(decode())
            if proc is not None:
                os.killpg(proc.pid, 9)
                proc.wait()
    out = {"model": str(model_dir), "read_file": str(path), "rounds": a.rounds,
           "loadavg_start": start, "loadavg_end": loadavg(), "s_per_token": res,
           "median": {m: statistics.median(v) for m, v in res.items()}}
    base = out["median"]["alone"]
    for m in modes:
        print(f"{m:14s} {out['median'][m]:.3f} s/token ({out['median'][m] / base:.2f}x alone) "
              f"{[round(x, 3) for x in res[m]]}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "io-interference.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
