"""Expert-streaming benchmark: bytes read per token, decode speed and memory of expert
caches against layer streaming and plain mlx-lm on a ≥ 1 GB mixture-of-experts model.

The model is a random-weight 4-bit qwen3_moe (64 experts, top-4) from
``benchlib.synthetic.make_moe_model``, whose routing has locality (see
docs/expert-streaming.md). Each round runs in a fresh ``stream`` child
(``bench/benchlib/workloads/stream.py``): it loads the model and runs the prompt and the
first token (set-up), then the timed phase decodes ``PYLOADER_EXPERTS_TOKENS`` tokens,
sampled at temperature 1 from a fixed seed (a random model's greedy text repeats a few
tokens, which would overstate locality; the seeded sampler gives every configuration the
same varied tokens). Child-side numbers go to ``extra_info``; ``bench/experts_report.py``
turns the JSON into the table, the targets and the plot.

    pytest bench/test_experts_bench.py --benchmark-json=bench/results/raw/experts.json
    python bench/experts_report.py bench/results/raw/experts.json

The physical bound of a configuration is max(bytes it read per token / the disk bandwidth
measured in the same run, compute per token); compute per token is the decode time of the
same configuration with every expert in memory (``experts-100`` for the cases that stream
the rest of each layer, ``experts-100-resident`` for the others: all experts read at load,
no miss while decoding). ``bench/experts_report.py`` computes it.

Environment: ``PYLOADER_EXPERTS_BENCH_SIZE`` (bytes, default 1.2e9),
``PYLOADER_EXPERTS_ROUNDS`` (default 3), ``PYLOADER_EXPERTS_TOKENS`` (default 16).
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
from benchlib.synthetic import make_moe_model
from pyloader.io.repack import repack
from benchlib.workloads import STREAM

SIZE = int(float(os.environ.get("PYLOADER_EXPERTS_BENCH_SIZE", 1.2e9)))
ROUNDS = int(os.environ.get("PYLOADER_EXPERTS_ROUNDS", 3))
TOKENS = int(os.environ.get("PYLOADER_EXPERTS_TOKENS", 16))
COMMON = ["--sample-seed", "0", "--prompt-tokens", "32"]

# (id, child arguments, page cache, model). The first case is the reference for tokens.
# The expert cases stream the rest of every layer (resident 0: the least memory) unless
# "-resident" (resident 1.0). "experts-100" and "experts-100-resident" hold every expert
# (read at load, no miss while decoding): the compute per token of the streamed and the
# resident cases; "experts-100" also records the routing trace. "layer-budget" gets the
# memory "experts-25" used (filled in when that case has run).
CASES = [
    ("mlx-lm", ["--mode", "mlx-lm"], "cold", "raw"),
    ("experts-100", ["--experts", "1.0", "--trace"], "cold", "raw"),
    ("experts-100-resident", ["--experts", "1.0", "--resident", "1.0"], "cold", "raw"),
    ("experts-50", ["--experts", "0.5"], "cold", "raw"),
    ("experts-25", ["--experts", "0.25"], "cold", "raw"),
    ("experts-12.5", ["--experts", "0.125"], "cold", "raw"),
    ("experts-25-lfu", ["--experts", "0.25", "--expert-policy", "lfu"], "cold", "raw"),
    ("experts-25-resident", ["--experts", "0.25", "--resident", "1.0"], "cold", "raw"),
    ("experts-25-warm", ["--experts", "0.25", "--keep-page-cache"], "warm", "raw"),
    ("experts-25-pagecache", ["--experts", "0.25", "--expert-source", "mmap"], "cold",
     "aligned"),
    ("layer-0", ["--resident", "0"], "cold", "raw"),
    ("layer-budget", ["--resident", "{budget}"], "cold", "raw"),
]

_shared: dict = {}


@pytest.fixture(scope="session")
def models():
    raw = make_moe_model(cache_dir(f"moe-model-{SIZE}-q4", create=False), SIZE, bits=4)
    aligned = cache_dir(f"moe-model-{SIZE}-q4-aligned", create=False)
    if not (aligned / "config.json").exists():
        repack(raw, aligned, overwrite=True)  # zero-copy views for the page-cache source
    return {"raw": str(raw), "aligned": str(aligned)}


@pytest.fixture(scope="session")
def disk_bandwidth(models):
    """Cold read speed of the model's file(s), measured in this run (median of 2)."""
    speeds = []
    for _ in range(2):
        r = measure_once(models["raw"], "pread", "cold")
        speeds.append(r["bytes"] / r["t_read_all"])
    return statistics.median(speeds)


def _resident(args: list[str]) -> str:
    """The child's ``--resident`` (the stream workload's default: 0)."""
    return args[args.index("--resident") + 1] if "--resident" in args else "0.0"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_experts(benchmark, page_cache, models, disk_bandwidth, case):
    name, args, cache, which = case
    if "{budget}" in " ".join(args):
        if "budget" not in _shared:
            pytest.skip("needs the experts-25 case's memory (run the whole file)")
        args = [a.replace("{budget}", f"{_shared['budget']}B") for a in args]
    path = models[which]

    def make_child():
        child = Child(STREAM, [path, "--tokens", str(TOKENS), *COMMON, *args],
                      label=f"{name}", timeout=3600)
        page_cache.prepare(path, cache)  # its *.safetensors; before the child's load (set-up)
        return child

    benchmark.group = "expert streaming decode"
    readies, results = child_rounds(benchmark, make_child, ROUNDS)

    tokens = results[0]["tokens"]
    _shared.setdefault("reference", tokens)
    med = statistics.median
    s_tok = med(r["decode_s"] / TOKENS for r in results)
    info = {
        "cache": cache, "model": which, "rounds": len(results), "tokens": TOKENS,
        "decode_tps": med(r["decode_tps"] for r in results),
        "decode_s_per_token": s_tok,
        "ttft_s": med(r["ttft_s"] for r in readies),
        "load_s": med(r["load_s"] for r in readies),
        "VmHWM": med(r["memory"]["VmHWM"] for r in results),
        "RssAnon": med(r["memory"]["RssAnon"] for r in results),
        "mx_peak": med(r["memory"]["mx_peak"] for r in results),
        "tokens_match_mlx_lm": all(r["tokens"] == _shared["reference"] for r in results),
        "disk_bandwidth": disk_bandwidth,
    }
    layer_bytes = 0
    if "stream" in results[0]:
        st = [r["stream"] for r in results]
        layer_bytes = med(s["bytes_read"] for s in st) / TOKENS
        info.update(resident_bytes=st[0]["resident_bytes"],
                    streamed_bytes_per_pass=st[0]["streamed_bytes_per_pass"])
    expert_bytes = 0
    if "experts" in results[0]:
        ex = [r["experts"] for r in results]
        dec = [e["decode"] for e in ex]
        expert_bytes = med(d["bytes_read"] for d in dec) / TOKENS
        info.update(
            expert_setting=ex[0]["setting"], expert_source=ex[0]["source"],
            expert_policy=ex[0]["policy"], bank_bytes=ex[0]["bank_bytes"],
            decode_hit_rate=med(d["hits"] / d["routed"] if d["routed"] else 1.0 for d in dec),
            decode_stall_s_per_token=med(d["stall_s"] for d in dec) / TOKENS,
            live_total={k: ex[0]["total"][k] for k in (
                "calls", "rounds", "routed", "hits", "misses", "evictions")})
        if name == "experts-25":
            _shared["budget"] = info["resident_bytes"]
    info["bytes_per_token"] = layer_bytes + expert_bytes
    info["layers"] = "resident" if name == "mlx-lm" or _resident(args) == "1.0" else "streamed"
    if name == "experts-100":
        info["trace"] = results[0]["trace"]
    benchmark.extra_info.update(info)
    print(f"\n{name}: {info['decode_tps']:.2f} tok/s, {info['bytes_per_token'] / 1e6:.1f} MB/token, "
          f"match={info['tokens_match_mlx_lm']}", file=sys.stderr)
    assert info["tokens_match_mlx_lm"], f"{name}: tokens differ from plain mlx-lm"
