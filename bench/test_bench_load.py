"""Load benchmark: checkpoint × strategy × cache state × phase.

Every round runs in a fresh ``load`` child (``pyloader.bench.protocol``). The round's
setup (untimed) starts it, waits until its imports are done, then evicts the
files from the page cache (cold) or reads them once (warm); the timed target
only says "go" and waits for the result. ``phase="dict"`` stops once the dict
of materialized arrays exists, ``phase="read_all"`` once every byte has been
read through the arrays. Memory and zero-copy figures go to ``extra_info``.

Run: ``pytest bench/ --benchmark-json=bench.json`` then
``python bench/report.py bench.json``.
"""

from __future__ import annotations

import statistics

import pytest

from pyloader.bench.harness import flatten, prepare_cache
from pyloader.bench.protocol import Child
from pyloader.bench.workloads import load as load_workload
from pyloader.io.pagecache import page_cache_fraction

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
def test_load(benchmark, synthetic_checkpoints, bench_rounds, checkpoint, strategy, cache, phase):
    if strategy == "safetensors" and (why := _safetensors_usable()):
        pytest.skip(why)
    path = synthetic_checkpoints[checkpoint]
    children: list[Child] = []
    cached: list[float] = []  # page-cache fraction of each round's files at "go"
    results: list[dict] = []

    def close_all():
        while children:
            children.pop().close()

    def setup():
        close_all()  # the previous round's child exits here, untimed
        child = Child("load", [path, "--strategy", strategy, "--stop-after", phase],
                      label=f"{strategy} on {path}")
        children.append(child)
        ready = child.start()
        prepare_cache(cache, ready["files"])
        cached.append(page_cache_fraction(path))

    def target():
        child = children[-1]
        result = child.go()
        result["page_cache_before"] = cached[-1]
        results.append(result)

    benchmark.group = f"{checkpoint} {cache} {phase}"
    try:
        benchmark.pedantic(target, setup=setup, rounds=bench_rounds)
    finally:
        close_all()

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
