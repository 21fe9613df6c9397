"""pytest-benchmark glue of the suites: rounds of fresh measuring children, and the
benchmark JSON read back by the reports (bench/stream_report.py, bench/experts_report.py,
bench/results_page.py)."""

from __future__ import annotations

from collections.abc import Callable

from pyloader.compare.protocol import Child


def child_rounds(benchmark, make_child: Callable[[], Child], rounds: int
                 ) -> tuple[list[dict], list[dict]]:
    """pytest-benchmark's pedantic rounds with one fresh measuring child each: set-up
    (untimed) calls ``make_child()`` (which prepares the page cache) and starts the child
    up to its ready message; only the child's measured phase (``go``) is timed. Returns
    the ready messages and the results, one per round."""
    readies: list[dict] = []
    results: list[dict] = []
    state: dict = {}

    def setup():
        child = make_child()
        readies.append(child.start())
        state["child"] = child

    def target():
        with state.pop("child") as child:
            results.append(child.go())

    benchmark.pedantic(target, setup=setup, rounds=rounds, iterations=1)
    return readies, results


def benchmark_cases(data: dict) -> dict[str, dict]:
    """pytest-benchmark's JSON (``--benchmark-json``) as {parameter id: the benchmark's
    ``extra_info`` and its median seconds (``median_s``)}: what the suites' reports read."""
    return {b["name"].split("[", 1)[1].rstrip("]"): {**b["extra_info"],
                                                    "median_s": b["stats"]["median"]}
            for b in data["benchmarks"]}
