"""pyloader's pytest plugin: page-cache control, process isolation. See docs/benchmarks.md."""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import pickle
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from .errors import MeasureError
from .io.pagecache import cached_fraction, evict_file, prepare_cache
from .io.pagecache import warm as read_once
from .compare.protocol import Child

STATES = ("cold", "warm")
CHOICES = (*STATES, "both")
#: Measurements that go into ``benchmark.extra_info`` (medians).
METRICS = ("seconds", "peak_rss", "anon", "mlx_peak", "bytes_read", "rchar", "page_cache")

PathArg = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


def files_of(path: PathArg) -> list[str]:
    """The files ``path`` stands for: a file, a directory's ``*.safetensors``, or a list."""
    items = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    out: list[str] = []
    for item in items:
        p = os.path.abspath(os.fspath(item))
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in os.listdir(p)
                           if n.endswith(".safetensors") and os.path.isfile(os.path.join(p, n)))
            if not found:
                raise FileNotFoundError(
                    f"{p}: no *.safetensors file in this directory; pass the files your "
                    "loader reads (a path or a list of paths)")
            out += found
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return list(dict.fromkeys(out))


class PageCache:
    """The ``page_cache`` fixture; ``state`` is the test's ``cache_state``."""

    def __init__(self, state: str | None = None):
        self.state = state
        self._prepared: dict[tuple[str, ...], str] = {}  # files -> state, latest wins

    files = staticmethod(files_of)

    def evict(self, path: PathArg) -> None:
        """Drop the files' pages from the page cache; pages a live process maps stay."""
        for f in files_of(path):
            evict_file(f)

    def warm(self, path: PathArg) -> None:
        """Read every byte of the files once, so they sit in the page cache."""
        read_once(files_of(path))

    def fraction(self, path: PathArg) -> float:
        """Share of the files' pages in the page cache now, 0..1 (``mincore``)."""
        return cached_fraction(files_of(path))

    def prepare(self, path: PathArg, state: str | None = None) -> None:
        """Put the files in ``state`` now and before every later ``isolated`` call."""
        state = state or self.state
        if state is None:
            raise RuntimeError(
                "page_cache.prepare(path) without a state needs a test marked "
                "@pytest.mark.page_cache; or pass state='cold' or 'warm'")
        if state not in STATES:
            raise ValueError(f"unknown page-cache state {state!r}; expected one of {STATES}")
        files = files_of(path)
        prepare_cache(state, files)
        self._prepared.pop(tuple(files), None)  # re-applied in the order last prepared
        self._prepared[tuple(files)] = state

    def _reapply(self) -> float | None:
        """Reapply prepared states; the prepared files' cached fraction (None if none)."""
        for files, state in self._prepared.items():
            prepare_cache(state, files)
        if not self._prepared:
            return None
        return cached_fraction(dict.fromkeys(f for files in self._prepared for f in files))


@dataclass
class IsolatedResult:
    """One call in a fresh process; memory measured right after the call.

    Attributes:
        value: What the function returned (unpickled).
        seconds: Wall time of the call in the child.
        peak_rss, anon, mlx_peak: The child's memory (peaks reset at the call's start).
        bytes_read, rchar: Bytes read during the call (None where not counted).
        page_cache: Prepared files' cached share at the call's start (None if none).
        ready, extra: The child's figures before the call, and everything else it reported.
    """

    value: Any
    seconds: float
    peak_rss: int | None
    anon: int | None
    mlx_peak: int
    bytes_read: int | None
    rchar: int | None
    page_cache: float | None
    function: str
    ready: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def metrics(self) -> dict:
        """The measurements (no value) as a JSON-friendly dict."""
        return {**{k: getattr(self, k) for k in METRICS}, "function": self.function}


def target_of(fn: Callable | str) -> tuple[str, str, str | None]:
    """(module, qualname, file) of an importable function or ``"module:qualname"``."""
    if isinstance(fn, str):
        module, sep, qualname = fn.partition(":")
        if not (sep and module and qualname):
            raise ValueError(f"{fn!r}: a target string is 'package.module:function'")
        return module, qualname, None
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(
            f"isolated() calls a module-level function by name; {fn!r} has no "
            "__module__/__qualname__ (a partial or a callable object?): define a function "
            "at module level, or pass 'module:function'")
    if "<lambda>" in qualname:
        raise TypeError(
            f"isolated() cannot run a lambda ({module}:{qualname}): the child process "
            "imports the function by name; define it with def at module level")
    if "<locals>" in qualname:
        raise TypeError(
            f"isolated() cannot run {module}:{qualname}, a function defined inside "
            "another function (a nested function or closure): the child process imports "
            "the function by name; move it to module level and pass what it closed over "
            "as arguments")
    if module == "__main__":
        raise TypeError(f"isolated() cannot run {qualname} from __main__: the child "
                        "process cannot import the parent's script; put it in a module")
    mod = sys.modules.get(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        raise TypeError(
            f"isolated() cannot run {fn!r}: {module}:{qualname} does not name it (a bound "
            "method? a function replaced by a decorator?); pass a module-level function")
    return module, qualname, getattr(mod, "__file__", None)


def _child_error(raised: dict, function: str) -> MeasureError:
    err = MeasureError(f"isolated {function}: {raised['type']}: {raised['message']} (raised "
                       f"in the child process, during {raised['during']})\n--- child traceback "
                       f"---\n{raised['traceback'].rstrip()}")
    err.child_type = raised["type"]
    err.child_traceback = raised["traceback"]
    err.__cause__ = None
    if raised.get("pickled"):
        # The message has the text and traceback if the exception does not unpickle here.
        with contextlib.suppress(Exception):
            err.__cause__ = pickle.loads(base64.b64decode(raised["pickled"]))
    return err


class _Call:
    """One child running one call: started, armed (page cache), gone, finished."""

    def __init__(self, owner: Isolated, target: tuple[str, str, str | None],
                 args: tuple, kwargs: dict):
        module, qualname, file = target
        self.function = f"{module}:{qualname}"
        n = next(owner._count)
        self.out = os.path.join(owner._dir(), f"call{n}.value")
        spec = os.path.join(owner._dir(), f"call{n}.spec")
        try:
            payload = pickle.dumps((tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"isolated {self.function}: the arguments do not pickle ({exc}); "
                            "they must cross into the child process") from exc
        with open(spec, "wb") as f:
            pickle.dump({"module": module, "qualname": qualname, "file": file,
                         "sys_path": list(sys.path), "args": payload}, f)
        self.page_cache: float | None = None
        self.child = Child("call", [spec, "--out", self.out], label=f"isolated {self.function}",
                           timeout=owner.timeout)
        try:
            self.ready = self.child.start()
        except BaseException:
            self.child.close()
            raise
        if self.ready.get("raised"):  # importing the function or its arguments failed
            self.child.close()
            raise _child_error(self.ready["raised"], self.function)

    def go(self) -> dict:
        raw = self.child.go()
        if raw.get("raised"):
            raise _child_error(raw["raised"], self.function)
        return raw

    def result(self, raw: dict) -> IsolatedResult:
        with open(self.out, "rb") as f:
            value = pickle.load(f)
        os.unlink(self.out)
        known = {"seconds", "peak_rss", "anon", "mlx_peak", "bytes_read", "rchar"}
        return IsolatedResult(value=value, page_cache=self.page_cache, function=self.function,
                              ready={k: v for k, v in self.ready.items()
                                     if k not in ("raised", "target")},
                              extra={k: v for k, v in raw.items() if k not in known},
                              **{k: raw.get(k) for k in known})

    def close(self) -> None:
        self.child.close()


class Isolated:
    """The ``isolated`` fixture: ``results`` of every call; ``timeout`` in seconds."""

    def __init__(self, request: pytest.FixtureRequest, page_cache: PageCache):
        self._request = request
        self._page_cache = page_cache
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._count = itertools.count(1)
        self.results: list[IsolatedResult] = []
        self.timeout = 600.0

    def __call__(self, fn: Callable | str, /, *args, **kwargs) -> IsolatedResult:
        """Call ``fn(*args, **kwargs)`` in a fresh process (MeasureError if it raises)."""
        call = _Call(self, target_of(fn), args, kwargs)
        try:
            call.page_cache = self._page_cache._reapply()
            raw = call.go()
        finally:
            call.close()
        result = call.result(raw)
        self._record([result])
        return result

    def benchmark(self, fn: Callable | str, args: tuple = (),
                  kwargs: dict | None = None, *, rounds: int = 3) -> IsolatedResult:
        """``benchmark.pedantic`` over ``fn``, one fresh process per round; only the call timed."""
        target = target_of(fn)

        def start() -> _Call:
            call = _Call(self, target, args, kwargs or {})
            call.page_cache = self._page_cache._reapply()
            return call

        calls, raws = self._pedantic("benchmark", start, rounds)
        results = [c.result(r) for c, r in zip(calls, raws)]
        self._record(results)
        return results[-1]

    def benchmark_workload(self, workload: str, args: list[str], *, rounds: int = 3,
                           label: str = "") -> list[dict]:
        """Like :meth:`benchmark` for a pyloader workload; returns every round's raw result."""
        states: list[dict] = []

        def start() -> Child:
            child = Child(workload, args, label=label, timeout=self.timeout)
            ready = child.start()
            states.append({"page_cache_before": self._page_cache._reapply(), "ready": ready})
            return child

        _, results = self._pedantic("benchmark_workload", start, rounds)
        for result, state in zip(results, states):
            result.update(state)
        return results

    def _pedantic(self, who: str, start: Callable[[], Any], rounds: int) -> tuple[list, list]:
        """``benchmark.pedantic`` with a child ``start()`` makes (untimed) per round; the
        children and what each one's timed ``go()`` returned."""
        bench = self._benchmark()
        if bench is None:
            raise RuntimeError(
                f"isolated.{who}() needs pytest-benchmark's `benchmark` fixture: add "
                "`benchmark` to the test's arguments (pip install pytest-benchmark)")
        children: list = []
        raws: list[dict] = []

        def setup():
            for c in children:
                c.close()  # the previous round's child exits here, untimed
            children.append(start())

        try:
            bench.pedantic(lambda: raws.append(children[-1].go()), setup=setup, rounds=rounds,
                           iterations=1)
        finally:
            for c in children:
                c.close()
        return children, raws

    def _benchmark(self):
        req = self._request
        return req.getfixturevalue("benchmark") if "benchmark" in req.fixturenames else None

    def _record(self, results: list[IsolatedResult]) -> None:
        self.results += results
        bench = self._benchmark()
        if bench is None:
            return
        info = bench.extra_info
        rows = [r.metrics() for r in self.results]
        for key in METRICS:
            values = [row[key] for row in rows if row[key] is not None]
            if values:
                info[key] = statistics.median(values)
        if self._page_cache.state is not None:
            info["cache_state"] = self._page_cache.state
        info["isolated"] = rows

    def _dir(self) -> str:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pyloader-isolated-")
        return self._tmp.name

    def close(self) -> None:
        """Remove the call files (the fixture's teardown)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def pytest_addoption(parser: pytest.Parser) -> None:
    """The option ``--page-cache=cold|warm|both``."""
    parser.getgroup("pyloader", "pyloader: page cache and process isolation").addoption(
        "--page-cache", dest="pyloader_page_cache", choices=CHOICES, default="both",
        help="page-cache states of tests marked page_cache: cold, warm or both (default)")


def pytest_configure(config: pytest.Config) -> None:
    """The marker ``page_cache``."""
    config.addinivalue_line(
        "markers",
        "page_cache: run once per state of --page-cache (the `cache_state` fixture); "
        "page_cache.prepare(path) puts files in it (pyloader's plugin)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``page_cache``: one case per state of ``--page-cache``."""
    marker = metafunc.definition.get_closest_marker("page_cache")
    if marker is None:
        return
    name = metafunc.definition.nodeid
    if marker.args or marker.kwargs:
        pytest.fail(f"{name}: @pytest.mark.page_cache takes no arguments; call "
                    "page_cache.prepare(path) in the test", pytrace=False)
    if "cache_state" not in metafunc.fixturenames:
        pytest.fail(f"{name}: a test marked page_cache uses the `page_cache`, `isolated` "
                    "or `cache_state` fixture", pytrace=False)
    choice = metafunc.config.getoption("pyloader_page_cache")
    metafunc.parametrize("cache_state", STATES if choice == "both" else (choice,), indirect=True)


@pytest.fixture
def cache_state(request: pytest.FixtureRequest) -> str | None:
    """``"cold"`` or ``"warm"`` in a test marked ``page_cache``, else None."""
    return getattr(request, "param", None)


@pytest.fixture
def page_cache(cache_state: str | None) -> PageCache:
    """Page-cache control: ``evict``, ``warm``, ``fraction``, ``prepare`` (:class:`PageCache`)."""
    return PageCache(cache_state)


@pytest.fixture
def isolated(request: pytest.FixtureRequest, page_cache: PageCache):
    """Calls in a fresh process (:class:`Isolated`)."""
    runner = Isolated(request, page_cache)
    with contextlib.closing(runner):
        yield runner
