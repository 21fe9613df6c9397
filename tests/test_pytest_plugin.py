"""pyloader's pytest plugin (pyloader/testing.py), loaded only when asked for.

Two halves: the fixtures as pyloader's own suite gets them (tests/conftest.py asks for the
plugin), and test suites OUTSIDE the repo (a temporary project run with ``python -m
pytest`` in a subprocess) that ask for it (a conftest's ``pytest_plugins`` or ``-p``), with
and without pytest-benchmark, or do not (and then import neither pyloader nor MLX).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pyloader import testing as pytest_plugin
from pyloader.errors import MeasureError

MiB = 2**20

# The temporary projects are as strict as pyloader's own suite.
INI = """\
[pytest]
addopts = --strict-markers --strict-config -p no:cacheprovider
filterwarnings =
    error
"""
#: How a user's suite asks for the plugin (the other way: ``-p pyloader.testing``).
CONFTEST = 'pytest_plugins = ["pyloader.testing"]\n'


# ----------------------------------------------------------------------------
# Functions the children import by name (module level, as isolated() requires)


@dataclass
class Request:
    numpy_mib: int = 0
    mlx_mib: int = 0
    sleep: float = 0.0


_kept: list = []


def allocate(req: Request) -> dict:
    """Allocate (and keep) numpy and MLX memory as asked; returns what it made."""
    import time

    time.sleep(req.sleep)
    a = np.ones(req.numpy_mib * MiB // 8)
    b = mx.ones((req.mlx_mib * MiB // 4,), dtype=mx.float32)
    mx.eval(b)
    _kept.extend([a, b])
    return {"numpy": int(a.size), "mlx": int(b.size), "sum": float(a.sum())}


class Boom(Exception):
    """What :func:`explode` raises."""


def explode(what: str) -> None:
    raise Boom(f"no {what}")


class Holder:
    def method(self) -> int:
        return 1


# ----------------------------------------------------------------------------
# In this process: the plugin as tests/conftest.py asks for it


def test_the_conftest_loads_the_plugin_and_no_entry_point_does(pytestconfig):
    eps = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert not any(v.startswith("pyloader") for v in eps.values()), \
        f"a pytest11 entry point loads pyloader into every pytest run: {eps}"
    assert pytestconfig.pluginmanager.get_plugin("pyloader.testing") is pytest_plugin


def test_page_cache_evict_drops_a_warm_file(page_cache, tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(8 * MiB))
    page_cache.warm(path)
    assert page_cache.fraction(path) > 0.99
    page_cache.evict(path)
    assert page_cache.fraction(path) < 0.01
    assert page_cache.fraction(path) < 0.01, "measuring the fraction read the file in"
    page_cache.warm(str(path))
    assert page_cache.fraction(path) > 0.99


def test_a_directory_is_its_safetensors_files(page_cache, tmp_path):
    for name in ("b.safetensors", "a.safetensors"):
        (tmp_path / name).write_bytes(os.urandom(4 * MiB))
    (tmp_path / "config.json").write_bytes(os.urandom(4 * MiB))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.safetensors").write_bytes(b"x")
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    assert page_cache.files(tmp_path) == [a, b]
    assert page_cache.files([b, tmp_path]) == [b, a]
    page_cache.evict(tmp_path)
    page_cache.warm(a)
    assert 0.45 < page_cache.fraction(tmp_path) < 0.55  # a in, b out, config.json ignored
    assert page_cache.fraction([a]) > 0.99
    (tmp_path / "sub" / "c.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        page_cache.files(tmp_path / "sub")
    with pytest.raises(FileNotFoundError):
        page_cache.files(tmp_path / "missing")


def test_prepare_needs_a_state_outside_marked_tests(page_cache, cache_state, tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(MiB))
    assert cache_state is None and page_cache.state is None
    with pytest.raises(RuntimeError, match="mark.page_cache"):
        page_cache.prepare(path)
    page_cache.prepare(path, "warm")
    assert page_cache.fraction(path) > 0.99
    with pytest.raises(ValueError, match="hot"):
        page_cache.prepare(path, "hot")


def test_isolated_returns_the_value_and_measures_the_call(isolated):
    idle = isolated(allocate, Request(sleep=0.3))
    big = isolated(allocate, Request(numpy_mib=200, mlx_mib=64))
    assert idle.value == {"numpy": 0, "mlx": 0, "sum": 0.0}
    assert big.value == {"numpy": 200 * MiB // 8, "mlx": 64 * MiB // 4, "sum": 200 * MiB / 8}
    assert idle.function == big.function == f"{allocate.__module__}:allocate"
    assert idle.ready["pid"] != big.ready["pid"] != os.getpid()  # a fresh process each
    assert 0.3 <= idle.seconds < 5
    # numpy's 200 MiB and MLX's 64 MiB are resident at the peak and kept (anon).
    assert big.peak_rss - idle.peak_rss > 240 * MiB
    assert big.anon - idle.anon > 240 * MiB
    assert idle.peak_rss - idle.ready["rss"] < 16 * MiB
    assert big.mlx_peak >= 64 * MiB > idle.mlx_peak
    assert idle.rchar is not None and idle.rchar < MiB  # it read nothing
    assert isolated.results == [idle, big]


def test_isolated_raises_the_childs_exception_with_its_traceback(isolated):
    with pytest.raises(MeasureError) as info:
        isolated(explode, what="luck")
    msg = str(info.value)
    assert f"{Boom.__module__}.Boom: no luck" in msg
    assert "child traceback" in msg and 'raise Boom(f"no {what}")' in msg
    assert "in explode" in msg and "workloads/call.py" not in msg
    assert isinstance(info.value.__cause__, Boom)


def test_isolated_reports_a_target_the_child_cannot_import(isolated):
    with pytest.raises(MeasureError, match="ModuleNotFoundError.*no_such_module_here"):
        isolated("no_such_module_here:f")


def test_isolated_refuses_what_a_child_cannot_import_by_name(isolated):
    def nested():
        return 1

    cases = [
        (lambda: 1, "lambda"),
        (nested, "inside another function"),
        (functools.partial(allocate, Request()), "partial"),
        (Holder().method, "bound method"),
        ("no_colon", "module:function"),
    ]
    for fn, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            isolated(fn)
    with pytest.raises(TypeError, match="do not pickle"):
        isolated(allocate, lambda: 1)
    assert isolated.results == []


# ----------------------------------------------------------------------------
# Test suites outside the repo


def _project(tmp_path: Path, files: dict[str, str], *, conftest: bool = True) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text(INI)
    if conftest:
        (project / "conftest.py").write_text(CONFTEST)
    for name, text in files.items():
        (project / name).write_text(textwrap.dedent(text))
    return project


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=900, check=False)


USER_BENCH = """\
    import numpy as np
    import pytest

    DATA = {data!r}
    SIZE = {size}


    def read_all(path):
        with open(path, "rb") as f:
            return len(f.read())


    def allocate(mib):
        return int(np.ones(mib * 2**20 // 8).sum())


    @pytest.mark.page_cache
    def test_read(benchmark, isolated, page_cache, cache_state):
        page_cache.prepare(DATA)
        r = isolated.benchmark(read_all, args=(DATA,), rounds=2)
        assert r.value == SIZE and len(isolated.results) == 2


    def test_alloc(benchmark, isolated):
        r = benchmark.pedantic(isolated, args=(allocate, 128), rounds=1)
        assert r.value == 128 * 2**20 // 8
"""


def test_a_users_suite_with_pytest_benchmark(tmp_path):
    size = 16 * MiB
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(size))
    project = _project(tmp_path, {"test_user_bench.py": USER_BENCH.format(data=str(data),
                                                                             size=size)})
    out = tmp_path / "bench.json"
    proc = _pytest(project, "--page-cache=both", f"--benchmark-json={out}", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    benches = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert set(benches) == {"test_read[cold]", "test_read[warm]", "test_alloc"}
    for b in benches.values():
        info = b["extra_info"]
        for key in ("seconds", "peak_rss", "anon", "mlx_peak", "bytes_read", "rchar"):
            assert isinstance(info.get(key), (int, float)), (b["name"], key, info)
    cold, warm = benches["test_read[cold]"], benches["test_read[warm]"]
    assert cold["params"] == {"cache_state": "cold"} and cold["extra_info"]["cache_state"] == "cold"
    assert cold["stats"]["rounds"] == 2 and len(cold["extra_info"]["isolated"]) == 2
    for run in cold["extra_info"]["isolated"]:  # evicted again before every round
        assert run["page_cache"] < 0.05 and run["bytes_read"] >= 0.9 * size
        assert run["rchar"] >= size
    for run in warm["extra_info"]["isolated"]:
        assert run["page_cache"] > 0.95 and run["bytes_read"] < 0.1 * size
        assert run["rchar"] >= size
    # 128 MiB more at the peak than a process that read 16 MiB.
    assert (benches["test_alloc"]["extra_info"]["peak_rss"]
            - warm["extra_info"]["peak_rss"]) > 80 * MiB


USER_PLAIN = """\
    import sys
    import pytest

    DATA = {data!r}


    def echo(*args, **kwargs):
        print("to stdout, not into the protocol", end="")
        return args, kwargs


    def test_nothing_heavy_is_imported():
        assert "pytest_benchmark" not in sys.modules
        assert "mlx_lm" not in sys.modules


    @pytest.mark.page_cache
    def test_marked(isolated, page_cache, cache_state):
        assert cache_state == page_cache.state == "cold"
        page_cache.prepare(DATA)
        r = isolated(echo, 1, key="v")
        assert r.value == ((1,), {{"key": "v"}})
        assert r.page_cache < 0.05


    def test_benchmark_needs_the_fixture(isolated):
        with pytest.raises(RuntimeError, match="pytest-benchmark"):
            isolated.benchmark(echo)
"""


def test_a_users_suite_without_pytest_benchmark(tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(MiB))
    project = _project(tmp_path, {"test_user_plain.py": USER_PLAIN.format(data=str(data))},
                       conftest=False)
    proc = _pytest(project, "-p", "pyloader.testing", "-p", "no:benchmark",
                   "--page-cache=cold", "-v")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_marked[cold] PASSED" in proc.stdout
    assert "[warm]" not in proc.stdout
    assert "3 passed" in proc.stdout


USER_COLLECT = """\
    import pytest


    @pytest.mark.page_cache
    def test_a(cache_state):
        pass


    @pytest.mark.page_cache
    class TestB:
        def test_b(self, isolated):
            pass


    def test_c(page_cache):
        pass
"""


def test_the_marker_parametrizes_over_page_cache_states(tmp_path):
    project = _project(tmp_path, {
        "test_collect.py": USER_COLLECT,
        "test_bad_args.py": """\
            import pytest

            @pytest.mark.page_cache("model/")
            def test_x(cache_state):
                pass
        """,
        "test_bad_fixtures.py": """\
            import pytest

            @pytest.mark.page_cache
            def test_y():
                pass
        """,
    })
    proc = _pytest(project, "--collect-only", "-q", "--continue-on-collection-errors")
    ids = {line for line in proc.stdout.splitlines() if "::" in line and " " not in line}
    assert ids == {
        "test_collect.py::test_a[cold]", "test_collect.py::test_a[warm]",
        "test_collect.py::TestB::test_b[cold]", "test_collect.py::TestB::test_b[warm]",
        "test_collect.py::test_c",
    }, proc.stdout + proc.stderr
    assert "takes no arguments" in proc.stdout
    assert "a test marked page_cache uses the `page_cache`" in proc.stdout
    assert proc.returncode != 0


def test_a_failing_measuring_child_reports_its_traceback(tmp_path):
    """Any workload's failure (here: the load child on a missing checkpoint) comes back
    with the child's own traceback, not only its last line."""
    from pyloader.compare.protocol import Child

    with pytest.raises(MeasureError) as info, \
            Child("load", [str(tmp_path / "absent"), "--strategy", "mmap"]) as child:
        child.start()
    text = str(info.value)
    assert "--- child traceback ---" in text and "Traceback (most recent call last)" in text
    assert "absent" in text


UNASKED = """\
    import sys


    def test_nothing_of_pyloader_is_imported():
        for name in ("pyloader", "pyloader._core", "mlx", "mlx.core"):
            assert name not in sys.modules, name
"""


def test_a_pytest_run_that_does_not_ask_imports_neither_pyloader_nor_mlx(tmp_path):
    """In an environment with pyloader installed, a pytest run in an empty directory
    (no configuration, no conftest) imports neither pyloader nor MLX."""
    project = tmp_path / "empty"
    project.mkdir()
    (project / "test_unasked.py").write_text(textwrap.dedent(UNASKED))
    proc = _pytest(project, "-p", "no:cacheprovider", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


FIXTURES = """\
    import pytest


    @pytest.mark.page_cache
    def test_fixtures(page_cache, isolated, cache_state):
        assert cache_state == page_cache.state == "warm"
"""


def test_the_fixtures_come_with_dash_p_and_only_then(tmp_path):
    project = _project(tmp_path, {"test_fixtures.py": FIXTURES}, conftest=False)
    proc = _pytest(project, "-p", "pyloader.testing", "--page-cache=warm", "-v")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_fixtures[warm] PASSED" in proc.stdout
    proc = _pytest(project, "-v")
    assert proc.returncode != 0
    assert "'page_cache' not found in `markers`" in proc.stdout + proc.stderr
