"""Streaming benchmark: decode speed, overlap and memory of layer
streaming against plain mlx-lm on a ≥1 GB random-weight llama.

Each round runs in a fresh ``stream`` child (``bench/benchlib/workloads/stream.py``):
the child loads the model and runs the prompt and the first token, then the
timed phase is the decode of ``PYLOADER_STREAM_TOKENS`` more tokens. Child-side
measurements (tokens/s, time to first token, load time, wait/compute split,
peak RSS, anonymous RSS, MLX peak) land in ``extra_info``; ``bench/stream_report.py``
turns the JSON into the table and the target ratios.

    pytest bench/test_streaming_bench.py --benchmark-json=bench/results/raw/streaming.json
    python bench/stream_report.py bench/results/raw/streaming.json

Environment: ``PYLOADER_STREAM_BENCH_SIZE`` (bytes, default 1.6e9),
``PYLOADER_STREAM_ROUNDS`` (default 3), ``PYLOADER_STREAM_TOKENS`` (default 8).
"""

from __future__ import annotations

import os
import statistics
import sys

import pytest

from pyloader.compare.system import cache_dir
from benchlib.rounds import child_rounds
from pyloader.compare.harness import measure_once
from pyloader.compare.protocol import Child
from benchlib.synthetic import make_model
from benchlib.workloads import STREAM

SIZE = int(float(os.environ.get("PYLOADER_STREAM_BENCH_SIZE", 1.6e9)))
ROUNDS = int(os.environ.get("PYLOADER_STREAM_ROUNDS", 3))
TOKENS = int(os.environ.get("PYLOADER_STREAM_TOKENS", 8))

# (id, child arguments, cache state). "cold": the model file is evicted before
# each round; streamed units are evicted after use anyway unless
# --keep-page-cache. "warm": read once before each round and kept.
CASES = [
    ("mlx-lm", ["--mode", "mlx-lm"], "cold"),
    ("resident-100", ["--resident", "1.0"], "cold"),
    ("resident-75", ["--resident", "0.75"], "cold"),
    ("resident-50", ["--resident", "0.5"], "cold"),
    ("resident-25", ["--resident", "0.25"], "cold"),
    ("resident-0", ["--resident", "0.0"], "cold"),
    ("resident-0-noprefetch", ["--resident", "0.0", "--prefetch", "0"], "cold"),
    ("resident-0-prefetch2", ["--resident", "0.0", "--prefetch", "2"], "cold"),
    ("resident-0-sublayer", ["--resident", "0.0", "--granularity", "sublayer"], "cold"),
    ("resident-0-pread", ["--resident", "0.0", "--strategy", "pread"], "cold"),
    ("resident-0-pread-uring", ["--resident", "0.0", "--strategy", "pread",
                                "--read-backend", "io_uring"], "cold"),
    ("resident-0-warm", ["--resident", "0.0", "--keep-page-cache"], "warm"),
    # Baselines first: the first case of each batch size gives the reference tokens.
    ("mlx-lm-batch4", ["--mode", "mlx-lm", "--batch", "4"], "cold"),
    ("mlx-lm-batch16", ["--mode", "mlx-lm", "--batch", "16"], "cold"),
    ("resident-0-batch4", ["--resident", "0.0", "--batch", "4"], "cold"),
    ("resident-0-batch16", ["--resident", "0.0", "--batch", "16"], "cold"),
]

_reference_tokens: dict[int, list] = {}


@pytest.fixture(scope="session")
def model_path():
    return str(make_model(cache_dir(f"stream-model-{SIZE}", create=False), SIZE))


@pytest.fixture(scope="session")
def disk_bandwidth(model_path):
    """Cold sequential read speed of this model's file, measured in this run."""
    path = os.path.join(model_path, "model.safetensors")
    speeds = []
    for _ in range(2):
        r = measure_once(path, "pread", "cold")
        speeds.append(os.path.getsize(path) / r["t_read_all"])
    return statistics.median(speeds)


def _child(model_path, args, cache, page_cache):
    child = Child(STREAM, [model_path, "--tokens", str(TOKENS), *args], label=" ".join(args),
                  timeout=1800)
    # Before the child's load (part of its set-up).
    page_cache.prepare(os.path.join(model_path, "model.safetensors"), cache)
    return child


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_streaming(benchmark, page_cache, model_path, disk_bandwidth, case):
    name, args, cache = case
    benchmark.group = "streaming decode"
    readies, results = child_rounds(benchmark, lambda: _child(model_path, args, cache, page_cache),
                                    ROUNDS)

    batch = int(args[args.index("--batch") + 1]) if "--batch" in args else 1
    tokens = results[0]["tokens"]
    if batch not in _reference_tokens:
        assert "--mode" in args, "the first case of a batch size must be the mlx-lm baseline"
        _reference_tokens[batch] = tokens
    med = statistics.median
    info = {
        "cache": cache,
        "batch": batch,
        "rounds": len(results),
        "decode_tps": med(r["decode_tps"] for r in results),
        "decode_s_per_token": med(r["decode_s"] / (TOKENS * batch) for r in results),
        "ttft_s": med(r["ttft_s"] for r in readies),
        "prefill_tps": med(r["prefill_tps"] for r in readies),
        "load_s": med(r["load_s"] for r in readies),
        "VmHWM": med(r["memory"]["VmHWM"] for r in results),
        "RssAnon": med(r["memory"]["RssAnon"] for r in results),
        "mx_peak": med(r["memory"]["mx_peak"] for r in results),
        "tokens_match_mlx_lm": all(r["tokens"] == _reference_tokens[batch] for r in results),
        "disk_bandwidth": disk_bandwidth,
    }
    if "stream" in results[0]:
        st = [r["stream"] for r in results]
        passes = st[0]["passes"] or 1
        info.update({
            "streamed_bytes_per_pass": st[0]["streamed_bytes_per_pass"],
            "streamed_units": st[0]["streamed_units"],
            "wait_s_per_pass": med(s["wait_s"] / passes for s in st),
            "compute_s_per_pass": med(s["compute_s"] / passes for s in st),
            "overlap_efficiency": med(s["overlap_efficiency"] for s in st),
            "s_per_pass": med(r["decode_s"] / max(s["passes"], 1) for r, s in zip(results, st)),
        })
    benchmark.extra_info.update(info)
    print(f"\n{name}: {info['decode_tps']:.3f} tok/s, match={info['tokens_match_mlx_lm']}",
          file=sys.stderr)
    assert info["tokens_match_mlx_lm"], f"{name}: tokens differ from plain mlx-lm"
