"""The ``pyloader compare`` configurations as a pytest-benchmark suite.

Same children, page-cache control and metrics as ``pyloader compare MODEL`` (both use
:mod:`pyloader.compare.genbench`): each round starts a fresh ``generate`` child,
waits for its imports, evicts the model from the page cache (cold) or reads it once
(warm), and the timed target is the child's whole measured work (load, prompt, decode).
Child-side numbers (load s, TTFT, prompt and decode tok/s, peak RSS, RssAnon, MLX
peak, bytes read) go to ``extra_info`` (medians, plus every round in ``rounds``);
benchmarks are grouped by strategy. Every round's tokens must equal the mlx-lm
baseline's. ``bench/compare_report.py`` turns the JSON into its table.

    pytest bench/test_compare_bench.py --benchmark-json=bench/results/raw/compare-default.json
    python bench/compare_report.py bench/results/raw/compare-default.json

Environment: ``PYLOADER_COMPARE_MODEL`` (default: the default model),
``PYLOADER_COMPARE_ROUNDS`` (default 2), ``PYLOADER_COMPARE_TOKENS`` (default 16),
``PYLOADER_COMPARE_CACHE`` (cold or warm, default cold),
``PYLOADER_COMPARE_CONFIGS`` (comma-separated labels, default: as ``pyloader compare``).
"""

from __future__ import annotations

import os
import statistics

import pytest

from pyloader.compare import genbench

ROUNDS = int(os.environ.get("PYLOADER_COMPARE_ROUNDS", 2))
TOKENS = int(os.environ.get("PYLOADER_COMPARE_TOKENS", 16))
CACHE = os.environ.get("PYLOADER_COMPARE_CACHE", "cold")
CONFIGS = (os.environ["PYLOADER_COMPARE_CONFIGS"].split(",")
           if os.environ.get("PYLOADER_COMPARE_CONFIGS")
           else genbench.configurations(genbench.STRATEGIES, genbench.DEFAULT_RESIDENT,
                                        genbench.KV_MODES))
# The baseline runs first: it gives the reference tokens.
CONFIGS = sorted(CONFIGS, key=lambda c: c != genbench.BASELINE)

_reference: dict[str, list[int]] = {}


@pytest.fixture(scope="session")
def compare_model() -> str:
    path = os.environ.get("PYLOADER_COMPARE_MODEL")
    if path:
        return path
    from pyloader.default_model import default_model_path

    return str(default_model_path())


@pytest.mark.parametrize("config", CONFIGS)
def test_generation(benchmark, compare_model, config):
    state: dict = {}
    results: list[dict] = []

    def setup():
        state["child"], state["before"] = genbench.start_child(
            compare_model, config, CACHE, max_tokens=TOKENS)

    def target():
        child = state.pop("child")
        with child:
            result = child.go()
        result["page_cache_before"] = state["before"]
        results.append(result)

    benchmark.group = genbench.Config.parse(config).strategy
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1)

    rows = [genbench.flatten(r) for r in results]
    if config == genbench.BASELINE:
        _reference[compare_model] = rows[0]["tokens"]
    ref = _reference.get(compare_model)
    info = benchmark.extra_info
    info.update(config=config, cache=CACHE, model=compare_model, max_tokens=TOKENS,
                identical=[r["tokens"] == ref for r in rows] if ref is not None else None)
    keys = [k for k, _, _ in genbench.METRICS] + ["bytes", "prompt_tokens", "page_cache_before"]
    for key in keys:
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            info[key] = statistics.median(vals)
    info["rounds"] = [{k: r.get(k) for k in keys + ["tokens"]} for r in rows]
    if CACHE == "cold":
        assert info["page_cache_before"] < 0.05, "eviction left the model in the page cache"
    assert ref is None or all(info["identical"]), f"{config}: tokens differ from mlx-lm"
