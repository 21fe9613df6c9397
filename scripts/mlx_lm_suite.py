#!/usr/bin/env python3
"""Run mlx-lm's own offline test suite with its loading replaced by pyloader's.

    python scripts/mlx_lm_suite.py                  # baseline + 6 configurations (~3 min)
    python scripts/mlx_lm_suite.py --loading-only   # rerun only the tests that load (~1.5 min)
    python scripts/mlx_lm_suite.py --loading-only --whole mmap:0   # CI: every test in one
    python scripts/mlx_lm_suite.py --configs pread:0.5 --keep

1. The source distribution of the installed mlx-lm (it must be 0.32.2) is downloaded
   once into ``${PYLOADER_CACHE:-~/.cache/pyloader}/mlx-lm-0.32.2-sdist/`` (its sha256
   checked), so reruns are offline; its ``tests/`` are extracted into a fresh directory
   with ``scripts/mlx_lm_suite_conftest.py`` as their ``conftest.py``.
2. Baseline: the whole suite with plain mlx-lm, offline (``HF_HUB_OFFLINE=1`` and an
   empty Hugging Face cache, so the tests that need a hub model fail the same way on
   every machine and drop out of the baseline). The conftest only records which tests
   reach ``mlx_lm.utils.load_model`` or ``mx.load`` of a ``.safetensors`` file.
3. For strategy in (mmap, pread) x resident in (0, 0.5, 1): every baseline-passing test
   is run again with the conftest routing those loads to ``pyloader.load_model`` /
   ``pyloader.load``. ``--loading-only`` reruns only the tests that reached a loader in
   the baseline (the whole class when the load happened in a class-level set-up,
   everything when one happened outside a test): a test that reaches neither runs the
   same code with or without the patch, but not with pyloader imported.

Exit status 1 when a baseline-passing test does not pass under pyloader, when a
configuration made no pyloader load at all, or when nothing in the baseline reached a
loader. Extra test dependencies: ``requests`` (test_server.py) is installed with pip
into the cache when missing; ``lm_eval`` (test_evaluate.py, which pulls in torch) is
not, so that file is skipped unless lm_eval is already installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

MLX_LM_VERSION = "0.32.2"
SDIST = f"mlx_lm-{MLX_LM_VERSION}.tar.gz"
SDIST_SHA256 = "1af8a92f6a141c3e2bf5b0369ac4464203a8e2189c47b9e40d3e921e5b3a1fe9"
CONFTEST = Path(__file__).resolve().with_name("mlx_lm_suite_conftest.py")
CONFIGS = [(s, r) for s in ("mmap", "pread") for r in ("0", "0.5", "1")]
# test module -> the import it needs that the suite does not install
OPTIONAL_IMPORTS = {"test_evaluate.py": "lm_eval"}
EXTRA_PACKAGES = {"requests": "requests"}  # import name -> pip requirement
RUN_TIMEOUT_S = 1200
OUTSIDE = "<outside a test>"


def cache_root() -> Path:
    root = os.environ.get("PYLOADER_CACHE") or Path.home() / ".cache" / "pyloader"
    return Path(root).expanduser() / f"mlx-lm-{MLX_LM_VERSION}-sdist"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(cache: Path) -> Path:
    """The sdist, downloaded once (pip, from PyPI) and checked against its sha256."""
    tarball = cache / SDIST
    if not tarball.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading mlx-lm=={MLX_LM_VERSION} (sdist) into {cache}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"mlx-lm=={MLX_LM_VERSION}", "-d", str(cache)],
                       check=True)
    digest = sha256(tarball)
    if digest != SDIST_SHA256:
        raise SystemExit(f"{tarball}: sha256 {digest}, expected {SDIST_SHA256}; "
                         "delete it to download it again")
    return tarball


def extra_path(cache: Path) -> str | None:
    """A directory with the test dependencies this interpreter lacks (pip --target,
    cached), for PYTHONPATH; None when nothing is missing."""
    missing = [req for mod, req in EXTRA_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    target = cache / f"extra-py{sys.version_info.major}.{sys.version_info.minor}"
    stamp = target / ".installed"
    if not stamp.exists() or stamp.read_text().split() != sorted(missing):
        print(f"installing test dependencies {missing} into {target}", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target",
                        str(target), *missing], check=True)
        stamp.write_text(" ".join(sorted(missing)))
    return str(target)


def extract_tests(tarball: Path, work: Path) -> None:
    prefix = f"mlx_lm-{MLX_LM_VERSION}/tests/"
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for m in members:
            m.name = m.name[len(f"mlx_lm-{MLX_LM_VERSION}/"):]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work, members=members, **safe)
    shutil.copy(CONFTEST, work / "tests" / "conftest.py")
    (work / "pytest.ini").write_text(
        "[pytest]\n# mlx-lm's tests, run by pyloader's scripts/mlx_lm_suite.py\n")


class Runner:
    def __init__(self, work: Path, extra: str | None, hf_cache: bool):
        self.work = work
        self.env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
        if not hf_cache:
            self.env.update(HF_HOME=str(work / "hf"), HF_HUB_CACHE=str(work / "hf" / "hub"))
        if extra:
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (extra, self.env.get("PYTHONPATH")) if p)
        self.ignore = [f"--ignore=tests/{name}" for name, mod in OPTIONAL_IMPORTS.items()
                       if importlib.util.find_spec(mod) is None]

    def run(self, tag: str, targets: list[str], **env: str) -> tuple[dict, float]:
        """One pytest session; returns the conftest's report and the wall time."""
        report, log = self.work / f"{tag}.json", self.work / f"{tag}.log"
        args = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []),
                "-m", "pytest", "-c", "pytest.ini", "--rootdir", ".", "-p", "no:cacheprovider",
                "-q", "-rfE", "--continue-on-collection-errors", *self.ignore]
        if len(targets) > 200:  # keep the command line short: pass them in a file
            (self.work / f"{tag}.args").write_text("\n".join(targets) + "\n")
            targets = [f"@{tag}.args"]
        env = {**self.env, **env, "PYLOADER_SUITE_REPORT": str(report)}
        t0 = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.run(args + targets, cwd=self.work, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                                  check=False)  # test failures are read from the report
        wall = time.perf_counter() - t0
        if not report.exists():
            tail = "\n".join(log.read_text().splitlines()[-30:])
            raise SystemExit(f"{tag}: pytest exited {proc.returncode} without a report "
                             f"(log {log}):\n{tail}")
        return json.loads(report.read_text()), wall


def select(baseline: dict) -> list[str]:
    """The baseline-passing tests that depend on a loader: those whose test body reached
    one, whole classes (or modules) whose set-up or tear-down did, and every test when a
    load happened outside any test."""
    passed = sorted(n for n, o in baseline["outcomes"].items() if o == "passed")
    if OUTSIDE in baseline["reached"]:
        return passed
    chosen = set()
    for nodeid, phases in baseline["reached"].items():
        if set(phases) - {"call"}:  # a class/module fixture: its siblings use what it loaded
            scope = nodeid.split("[")[0].rsplit("::", 1)[0] + "::"
            chosen.update(n for n in passed if n.startswith(scope))
        chosen.add(nodeid)
    return [n for n in passed if n in chosen]


def hub_error(message: str) -> bool:
    return "Hugging Face hub" in message  # the conftest's skip reason


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(f"{s}:{r}" for s, r in CONFIGS),
                    help="strategy:resident pairs, comma-separated (default: all six)")
    ap.add_argument("--loading-only", action="store_true",
                    help="rerun only the baseline-passing tests that reached a loader")
    ap.add_argument("--whole", default="",
                    help="with --loading-only: these strategy:resident pairs still rerun "
                         "every baseline-passing test (comma-separated)")
    ap.add_argument("--hf-cache", action="store_true",
                    help="use the user's Hugging Face cache (default: an empty one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    configs = [tuple(c.split(":")) for c in args.configs.split(",") if c]
    whole = {tuple(c.split(":")) for c in args.whole.split(",") if c}
    if unknown := sorted(whole - set(configs)):
        raise SystemExit(f"--whole names configurations not in --configs: {unknown}")

    installed = importlib.metadata.version("mlx-lm")
    if installed != MLX_LM_VERSION:
        raise SystemExit(f"mlx-lm {installed} is installed; this suite is {MLX_LM_VERSION}'s")
    t_start = time.perf_counter()
    cache = cache_root()
    tarball = fetch_sdist(cache)
    extra = extra_path(cache)
    work = Path(tempfile.mkdtemp(prefix="mlx-lm-suite-"))
    extract_tests(tarball, work)
    runner = Runner(work, extra, args.hf_cache)
    results: dict = {"mlx_lm": MLX_LM_VERSION, "work": str(work), "configs": {}}

    baseline, wall = runner.run("baseline", ["tests"], PYLOADER_SUITE_MODE="record")
    outcomes = baseline["outcomes"]
    passed = sorted(n for n, o in outcomes.items() if o == "passed")
    not_passed = {n: o for n, o in outcomes.items() if o != "passed"}
    hub = sorted(n for n in not_passed if hub_error(baseline["errors"].get(n, "")))
    loading = select(baseline)
    reached_not_passing = sorted(n for n in baseline["reached"]
                                 if n != OUTSIDE and n not in passed)
    print(f"baseline (plain mlx-lm, offline): {len(passed)} passed of {len(outcomes)} "
          f"({len(hub)} skipped: need the hub; {len(not_passed) - len(hub)} other skips or "
          f"failures; {len(baseline['collection_errors'])} collection errors) in {wall:.0f}s",
          flush=True)
    if runner.ignore:
        print("  not collected (optional imports missing): " + ", ".join(runner.ignore))
    print(f"  baseline-passing tests reaching a loader: {len(loading)}; rerun under "
          f"pyloader: " + (f"{len(loading)}" if args.loading_only else "all that passed")
          + (f" ({len(passed)} in {', '.join(f'{s}:{r}' for s, r in sorted(whole))})"
             if args.loading_only and whole else ""), flush=True)
    results["baseline"] = {"wall_s": wall, "passed": passed, "not_passed": not_passed,
                           "needs_hub": hub, "errors": baseline["errors"],
                           "collection_errors": baseline["collection_errors"],
                           "reached": baseline["reached"], "loading": loading,
                           "reached_not_passing": reached_not_passing}
    if not loading:
        print("FAIL: no baseline-passing test reaches load_model or mx.load")
        return 1

    failed = False
    for strategy, resident in configs:
        tag = f"{strategy}-resident{resident}"
        selected = loading if args.loading_only and (strategy, resident) not in whole \
            else passed
        rep, wall = runner.run(tag, selected, PYLOADER_SUITE_MODE="pyloader",
                               PYLOADER_SUITE_STRATEGY=strategy,
                               PYLOADER_SUITE_RESIDENT=resident)
        routed = sum(n for what, n in rep["counts"].items() if "-> pyloader" in what)
        bad = {n: rep["outcomes"].get(n, "not run") for n in selected
               if rep["outcomes"].get(n) != "passed"}
        print(f"{tag:22s} {len(selected) - len(bad):3d}/{len(selected)} passed, "
              f"{routed} calls routed to pyloader "
              f"({rep['counts'].get('pyloader model: streams some layers', 0)} models "
              f"streamed), {wall:.0f}s", flush=True)
        for n, o in bad.items():
            print(f"    {o}: {n}\n        {rep['errors'].get(n, '')[:500]}")
        if routed == 0:
            print("    FAIL: no call reached pyloader in this configuration")
        failed |= bool(bad) or routed == 0
        results["configs"][tag] = {"wall_s": wall, "counts": rep["counts"], "failed": bad,
                                   "selected": selected,
                                   "errors": {n: rep["errors"].get(n, "") for n in bad}}

    total = time.perf_counter() - t_start
    results["total_s"] = total
    print(f"total {total:.0f}s; " + ("FAIL: baseline-passing tests fail under pyloader"
                                     if failed else "every baseline-passing test passes"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.keep or failed:
        print(f"logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
