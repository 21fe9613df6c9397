"""Turn ``pytest bench/test_compare_bench.py --benchmark-json=FILE`` into the table
``pyloader compare`` prints.

    python bench/compare_report.py FILE [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os

from pyloader.compare import genbench, harness


def report_from_benchmark(data: dict) -> dict:
    """A ``pyloader compare`` report built from pytest-benchmark's JSON."""
    rows, cases = [], {}
    for b in data["benchmarks"]:
        info = b["extra_info"]
        label = os.path.basename(os.path.normpath(info["model"]))
        cases[label] = {"label": label, "path": info["model"], "files": [],
                        "bytes": info.get("bytes", 0), "tensors": 0, "aligned_bytes": 0}
        for i, rnd in enumerate(info["rounds"]):
            rows.append({"checkpoint": label, "path": info["model"], "cache": info["cache"],
                         "run": i, "strategy": info["config"], **rnd,
                         "text": None, "samples": []})
    runs = max((b["stats"]["rounds"] for b in data["benchmarks"]), default=0)
    tokens = {b["extra_info"].get("max_tokens") for b in data["benchmarks"]}
    report = {"env": data.get("machine_info", {}), "workload": "generate",
              "strategies": [b["extra_info"]["config"] for b in data["benchmarks"]],
              "options": {"max_tokens": "/".join(str(t) for t in sorted(tokens))},
              "caches": sorted({r["cache"] for r in rows}), "runs_per_case": runs,
              "cases": list(cases.values()), "runs": rows}
    genbench.finish(rows, report)
    w = genbench.WORKLOAD
    report["summary"] = harness.summarize(rows, w.metrics, w.baseline, w.order)
    report["targets"] = []
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="pytest-benchmark JSON")
    p.add_argument("--markdown", action="store_true", help="wrap the table in a code block")
    args = p.parse_args(argv)
    with open(args.json) as f:
        report = report_from_benchmark(json.load(f))
    text = genbench.render(report)
    print(f"```\n{text}\n```" if args.markdown else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
