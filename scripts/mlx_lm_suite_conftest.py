"""pytest conftest for mlx-lm's own test suite with its loading replaced by pyloader's.

``scripts/mlx_lm_suite.py`` copies this file to ``tests/conftest.py`` of the tests it
extracts from mlx-lm's source distribution. It is not a test of pyloader's own suite
(which collects ``tests/`` only).

Two modes (``PYLOADER_SUITE_MODE``):

* ``record``: plain mlx-lm. ``mlx_lm.utils.load_model`` and ``mx.load`` are wrapped by
  functions that call the originals unchanged and note which test reached them (the
  driver re-runs only those tests under pyloader).
* ``pyloader`` (default): ``mlx_lm.utils.load_model`` is ``pyloader.load_model`` and
  ``mx.load`` of a ``.safetensors`` path is ``pyloader.load``, with
  ``PYLOADER_SUITE_STRATEGY`` (``mmap`` | ``pread``) and ``PYLOADER_SUITE_RESIDENT``
  (the fraction of decoder layers kept resident, a float: ``1`` means every layer, not
  one layer). Other ``mx.load`` calls (npz, gguf, file objects, a ``stream=``) go to
  MLX's own.

pyloader builds its lazy skeleton with mlx-lm's ``load_model`` (which calls ``mx.load``);
calls made while pyloader is running go to the originals, so nothing loops.

``PYLOADER_SUITE_REPORT`` names a JSON file written at the end of the session: each
test's outcome, the tests that reached a patched function (and in which phase), and the
call counts. The counts are also printed in the terminal summary.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
import pytest

MODE = os.environ.get("PYLOADER_SUITE_MODE", "pyloader")
STRATEGY = os.environ.get("PYLOADER_SUITE_STRATEGY", "mmap")
# Always a fraction: an int would be a layer count (resident=1 is one layer).
RESIDENT = float(os.environ.get("PYLOADER_SUITE_RESIDENT", "1"))
REPORT = os.environ.get("PYLOADER_SUITE_REPORT")

if MODE not in ("record", "pyloader"):
    raise pytest.UsageError(f"PYLOADER_SUITE_MODE={MODE!r}: expected 'record' or 'pyloader'")
if MODE == "pyloader":
    import pyloader

MLX_LOAD_MODEL = mlx_lm.utils.load_model
MX_LOAD = mx.load
# mlx-lm's default class lookup, taken from the signature rather than by its private name.
DEFAULT_GET_CLASSES = inspect.signature(MLX_LOAD_MODEL).parameters["get_model_classes"].default

COUNTS: Counter[str] = Counter()
REACHED: dict[str, set[str]] = {}  # test node id -> phases ("setup", "call", "teardown")
OUTCOMES: dict[str, str] = {}
ERRORS: dict[str, str] = {}
COLLECTION_ERRORS: dict[str, str] = {}
NEEDS_HUB_REASON = "Skipped: needs a model from the Hugging Face hub (offline run)"
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}

_state = threading.local()
_current: list = [None, None]  # the running test's node id and phase


def _inside_pyloader() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextmanager
def _pyloader_running():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _reached(what: str) -> None:
    nodeid, phase = _current
    REACHED.setdefault(nodeid or "<outside a test>", set()).add(phase or "collect")
    COUNTS[what] += 1


def load_model(model_path, lazy=False, strict=True, model_config=None,
               get_model_classes=DEFAULT_GET_CLASSES, trust_remote_code=False):
    """``mlx_lm.utils.load_model``'s signature; pyloader's loading behind it."""
    if _inside_pyloader():  # pyloader's own lazy skeleton
        COUNTS["load_model -> mlx-lm (inside pyloader)"] += 1
        return MLX_LOAD_MODEL(model_path, lazy, strict, model_config, get_model_classes,
                              trust_remote_code)
    if MODE == "record":
        _reached("load_model -> mlx-lm")
        return MLX_LOAD_MODEL(model_path, lazy, strict, model_config, get_model_classes,
                              trust_remote_code)
    _reached("load_model -> pyloader.load_model")
    extra = {}
    if get_model_classes is not DEFAULT_GET_CLASSES:
        extra["get_model_classes"] = get_model_classes
    with _pyloader_running():
        model, _tok, config = pyloader.load_model(
            model_path, tokenizer=False, return_config=True, lazy=lazy, strict=strict,
            model_config=model_config, trust_remote_code=trust_remote_code,
            resident=RESIDENT, options=pyloader.StreamOptions(strategy=STRATEGY), **extra)
    try:
        streamed = pyloader.stats(model)["streamed_units"]
    except ValueError:  # built without pyloader's controller (a directory without weights)
        streamed = None
    COUNTS["pyloader model: streams some layers" if streamed
           else "pyloader model: nothing streamed"] += 1
    return model, config


load_model.__doc__ = (MLX_LOAD_MODEL.__doc__ or "") + "\n(pyloader suite: patched)"


def _is_safetensors(file, fmt) -> bool:
    if not isinstance(file, (str, os.PathLike)):
        return False
    return fmt == "safetensors" or (fmt is None and os.fspath(file).endswith(".safetensors"))


def load(file, /, format=None, return_metadata=False, *, stream=None):
    """``mx.load``'s signature; ``.safetensors`` paths go to ``pyloader.load``."""
    if _inside_pyloader():
        COUNTS["mx.load -> mlx (inside pyloader)"] += 1
        return MX_LOAD(file, format=format, return_metadata=return_metadata, stream=stream)
    if stream is not None or not _is_safetensors(file, format):
        COUNTS["mx.load -> mlx (not a .safetensors path)"] += 1
        return MX_LOAD(file, format=format, return_metadata=return_metadata, stream=stream)
    if MODE == "record":
        _reached("mx.load(.safetensors) -> mlx")
        return MX_LOAD(file, format=format, return_metadata=return_metadata, stream=stream)
    _reached("mx.load(.safetensors) -> pyloader.load")
    with _pyloader_running():
        return pyloader.load(Path(file), strategy=STRATEGY, return_metadata=return_metadata)


def _install() -> list[str]:
    """Patch ``mlx_lm.utils.load_model`` and ``mx.load`` and every module that holds
    them under another name (``from .utils import load_model``); the modules imported
    later get the patched attributes."""
    mlx_lm.utils.load_model = load_model
    mx.load = load
    patched = ["mlx_lm.utils.load_model", "mlx.core.load"]
    for name, module in list(sys.modules.items()):
        if not name.startswith(("mlx_lm", "mlx.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is MLX_LOAD_MODEL:
                setattr(module, attr, load_model)
                patched.append(f"{name}.{attr}")
            elif value is MX_LOAD:
                setattr(module, attr, load)
                patched.append(f"{name}.{attr}")
    return patched


PATCHED = _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _current[:] = [item.nodeid, "setup"]
    yield
    _current[:] = [None, None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[:] = [item.nodeid, "call"]
    yield
    _current[:] = [None, None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    _current[:] = [item.nodeid, "teardown"]
    yield
    _current[:] = [None, None]


def _needs_hub(exc: BaseException | None) -> bool:
    """The exception (or one it was raised from) is an offline hub lookup that failed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names = {c.__name__ for c in type(exc).__mro__}
        if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"}:
            return True
        if isinstance(exc, OSError) and "huggingface.co" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails because it needs a model from the Hugging Face hub is reported
    as skipped: the suite runs offline."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and _needs_hub(call.excinfo.value):
        path, lineno, _ = item.location
        report.outcome = "skipped"
        report.longrepr = (path, lineno + 1, NEEDS_HUB_REASON)


def _outcome(report) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "skipped" if report.skipped else "passed"


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2]
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return f"{crash.message}  [{Path(crash.path).name}:{crash.lineno}]"
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_runtest_logreport(report):
    """The worst outcome over a test's phases and subtests."""
    outcome = _outcome(report)
    previous = OUTCOMES.get(report.nodeid)
    if previous is None or _RANK[outcome] > _RANK[previous]:
        OUTCOMES[report.nodeid] = outcome
        if outcome != "passed":
            ERRORS[report.nodeid] = _message(report)


def pytest_collectreport(report):
    if report.failed:
        COLLECTION_ERRORS[report.nodeid] = _message(report)


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    where = ("plain mlx-lm (recording)" if MODE == "record"
             else f"pyloader strategy={STRATEGY} resident={RESIDENT:g}")
    tr.section(f"mlx-lm suite: {where}")
    tr.write_line("patched: " + ", ".join(PATCHED))
    for what in sorted(COUNTS):
        tr.write_line(f"{COUNTS[what]:6d}  {what}")
    if not COUNTS:
        tr.write_line("     0  calls to a patched function")
    tr.write_line(f"tests that reached a patched loader: {len(REACHED)}")
    if REPORT:
        Path(REPORT).write_text(json.dumps({
            "mode": MODE, "strategy": STRATEGY, "resident": RESIDENT,
            "patched": PATCHED, "counts": dict(COUNTS),
            "reached": {k: sorted(v) for k, v in REACHED.items()},
            "outcomes": OUTCOMES, "errors": ERRORS,
            "collection_errors": COLLECTION_ERRORS,
        }, indent=1, sort_keys=True))
