"""Load benchmark: checkpoint × strategy × cache state × phase.

Every round runs in a fresh ``load`` child (``pyloader.compare.protocol``), through the
pyloader pytest plugin (``isolated.benchmark_workload``): the round's setup (untimed)
starts it, waits until its imports are done, then puts the checkpoint in the case's
page-cache state (``page_cache.prepare``: evicted for cold, read once for warm); the
timed target only says "go" and waits for the result. ``phase="dict"`` stops once the
dict of materialized arrays exists, ``phase="read_all"`` once every byte has been read
through the arrays. Memory and zero-copy figures go to ``extra_info``.

Run: ``pytest bench/ --benchmark-json=bench.json`` then
``python bench/report.py bench.json``; ``--page-cache=cold`` (or ``warm``) runs one
cache state only.
"""

from __future__ import annotations

import statistics

import pytest

from pyloader.compare.harness import flatten
from pyloader.compare.workloads import load as load_workload

CHECKPOINTS = ("aligned", "mlx-written")
CACHES = ("warm", "cold")

# Per-round numbers kept in extra_info (medians) and, round by round, in "rounds".
EXTRA = ("t_dict", "t_read_all", "anon_delta", "rss_anon", "rss_file", "peak_rss", "mx_peak",
         "mx_active", "zero_copy_fraction", "copied_bytes", "page_cache_before")


def _safetensors_usable() -> str | None:
    try:
        import ml_dtypes  # noqa: F401 - bf16 through safetensors' numpy path
        import safetensors  # noqa: F401
    except ImportError as exc:
        return f"safetensors strategy needs safetensors and ml_dtypes ({exc})"
    return None


@pytest.mark.parametrize("phase", load_workload.PHASES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("strategy", load_workload.STRATEGIES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_load(benchmark, isolated, page_cache, synthetic_checkpoints, bench_rounds, checkpoint,
              strategy, cache, phase):
    if strategy == "safetensors" and (why := _safetensors_usable()):
        pytest.skip(why)
    path = synthetic_checkpoints[checkpoint]
    page_cache.prepare(path, cache)  # and again in every round, once the child is ready
    benchmark.group = f"{checkpoint} {cache} {phase}"
    results = isolated.benchmark_workload(
        "load", [path, "--strategy", strategy, "--stop-after", phase],
        rounds=bench_rounds, label=f"{strategy} on {path}")

    rows = [flatten(r) for r in results]
    info = benchmark.extra_info
    info.update(checkpoint=checkpoint, strategy=strategy, cache=cache, phase=phase,
                path=path, bytes=rows[0]["bytes"], tensors=rows[0]["tensors"],
                zero_copy_verified=all(r["zero_copy_verified"] for r in rows))
    for key in EXTRA:
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            info[key] = statistics.median(vals)
    info["rounds"] = [{k: r.get(k) for k in EXTRA} for r in rows]
    if cache == "cold":
        assert info["page_cache_before"] < 0.05, "eviction left the files in the page cache"
