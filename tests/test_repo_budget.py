"""Benchmark results stay small in git: only summaries are tracked, under a size budget,
and docs/results.md is what they render to (bench/results_page.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import results_page as results

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {"section", "title", "date", "machine", "loadavg", "command", "guide", "format",
                "table"}


def tracked(pattern: str) -> list[Path]:
    """Files git tracks under ``pattern``; skips when this is not a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the budget is on tracked files")
    out = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"git ls-files failed: {out.stderr.strip()}")
    return [ROOT / p for p in out.stdout.split("\0") if p]


def over_budget(files: list[Path]) -> list[str]:
    """Why ``files`` break the budget (empty when they keep it)."""
    sizes = {f: f.stat().st_size for f in files if f.exists()}
    bad = [f"{f.name}: {n} bytes > {results.BUDGET_FILE}"
           for f, n in sizes.items() if n > results.BUDGET_FILE]
    if sum(sizes.values()) > results.BUDGET_TOTAL:
        bad.append(f"{sum(sizes.values())} bytes of result JSON in all > {results.BUDGET_TOTAL}")
    return bad


def test_tracked_result_json_keeps_the_budget():
    files = tracked("bench/**.json")
    assert files, "no tracked summaries: docs/results.md is generated from them"
    assert not over_budget(files), "\n".join(over_budget(files))
    raw = [f for f in files if results.RAW in f.parents]
    assert not raw, f"raw results are tracked (bench/results/raw/ is ignored): {raw}"


def test_the_budget_check_catches_a_large_file(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "BUDGET_TOTAL", 100)
    monkeypatch.setattr(results, "BUDGET_FILE", 60)
    small, big = tmp_path / "small.json", tmp_path / "big.json"
    small.write_text("x" * 50)
    big.write_text("x" * 61)
    assert over_budget([small]) == []
    assert over_budget([big]) == ["big.json: 61 bytes > 60"]
    assert over_budget([small, small.with_name("s2.json")]) == []  # a missing file counts 0
    (tmp_path / "s3.json").write_text("x" * 55)
    assert over_budget([small, tmp_path / "s3.json"]) == ["105 bytes of result JSON in all > 100"]


def test_tracked_summaries_are_summaries():
    for f in tracked("bench/results/*.json"):
        s = json.loads(f.read_text())
        assert set(s) == SUMMARY_KEYS, f"{f.name}: keys {sorted(set(s) ^ SUMMARY_KEYS)}"
        assert s["section"] == f.stem and s["format"] in ("markdown", "text")
        assert all(isinstance(s[k], str) and s[k] for k in SUMMARY_KEYS), f.name


def test_results_page_is_generated_from_the_summaries():
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == results.render(ROOT / "bench" / "results"), (
        "docs/results.md is out of date: run python bench/results_page.py")


def test_a_raw_result_reduces_to_its_table_date_and_load(tmp_path):
    raw = {"model": "m", "read_file": "f", "rounds": 2, "loadavg_start": [1.5, 1.25, 1.0],
           "loadavg_end": [1, 1, 1], "s_per_token": {"alone": [0.5, 0.7]},
           "median": {"alone": 0.6}, "cpus": 2}
    (tmp_path / "io-interference.json").write_text(json.dumps(raw))
    section = next(s for s in results.SECTIONS if s.name == "io-interference")
    s = results.summarize(section, tmp_path)
    assert set(s) == SUMMARY_KEYS
    assert s["loadavg"] == "1.50 / 1.25 / 1.00" and s["machine"] == "2 CPUs"
    assert "| alone | 0.600 | 2 |" in s["table"]
    assert results.summarize(section, tmp_path / "none") is None


def test_machine_and_load_are_read_wherever_a_suite_records_them(tmp_path):
    """pytest-benchmark files carry them in machine_info, the suites in env/machine."""
    bench = {"machine_info": {"cpu": {"brand_raw": "CPU X", "count": 2}, "system": "Linux",
                              "loadavg": [0.5, 0.25, 0.125]},
             "datetime": "2026-01-02T03:04:05", "benchmarks": []}
    assert results._machine(bench) == "CPU X, 2 CPUs, Linux"
    assert results._loadavg(bench) == "0.50 / 0.25 / 0.12"
    assert results._date(bench, tmp_path) == "2026-01-02"
    suite = {"env": {"cpus": 2, "mlx": "0.32.4", "loadavg": [1, 1, 1]},
             "machine": {"cpu": "CPU Y"}}
    assert results._machine(suite) == "CPU Y, 2 CPUs, mlx 0.32.4"
    assert results._loadavg(suite) == "1.00 / 1.00 / 1.00"
    assert results._loadavg({}) == results._machine({}) == "not recorded"
