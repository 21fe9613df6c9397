"""The ``call`` workload: one importable function, called once, measured."""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import importlib
import importlib.util
import os
import pickle
import sys
import time
import traceback

import mlx.core as mx

from ..._util import host
from ..._util.procfs import reset_peak_rss
from ..protocol import process_memory

#: A pickled exception larger than this is not sent back (its text and traceback are).
MAX_PICKLED_EXCEPTION = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="the call's spec (a pickle written by the parent)")
    p.add_argument("--out", required=True, help="where the pickled return value goes")


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 points at stderr inside the block (C-level writes included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def describe(exc: BaseException, during: str, skip: int = 0) -> dict:
    """An exception as the parent gets it: type, message, traceback, pickle (if any)."""
    kind = type(exc)
    tb = exc.__traceback__
    for _ in range(skip):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    try:
        pickled = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        encoded = base64.b64encode(pickled).decode() if len(pickled) <= MAX_PICKLED_EXCEPTION \
            else None
    except Exception:  # noqa: BLE001 - the text and traceback still go back
        encoded = None
    return {"type": name, "message": str(exc), "during": during,
            "traceback": "".join(traceback.format_exception(kind, exc, tb)),
            "pickled": encoded}


def _same_file(a: str | None, b: str) -> bool:
    if not a:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def import_target(module: str, qualname: str, file: str | None):
    """The object ``module:qualname``, imported by name or executed from ``file``."""
    mod = None
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if not file:
            raise
    if file and (mod is None or not _same_file(getattr(mod, "__file__", None), file)):
        spec = importlib.util.spec_from_file_location(module, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {module} from {file}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    return functools.reduce(getattr, qualname.split("."), mod)


def prepare(args: argparse.Namespace) -> tuple[dict, dict]:
    with open(args.spec, "rb") as f:
        spec = pickle.load(f)
    state = {"raised": None}
    target = f"{spec['module']}:{spec['qualname']}"
    sys.path[1:1] = [p for p in spec["sys_path"] if p not in sys.path]
    try:
        with stdout_to_stderr():
            state["fn"] = import_target(spec["module"], spec["qualname"], spec["file"])
            state["args"], state["kwargs"] = pickle.loads(spec["args"])
    except Exception as exc:  # noqa: BLE001 - reported at ready, with the traceback
        state["raised"] = describe(exc, f"importing {target} or unpickling its arguments")
    mx.eval(mx.max(mx.zeros((16,), dtype=mx.uint16)))  # MLX's start-up is not the call's
    mx.reset_peak_memory()
    peak_reset = reset_peak_rss()
    s = host.process_memory()
    return {"pid": os.getpid(), "target": target, "raised": state["raised"],
            "peak_rss": s.peak_rss, "anon": s.rss_anon, "rss": s.rss,
            "peak_rss_reset": peak_reset}, state


def run(args: argparse.Namespace, state: dict) -> dict:
    """Call the function; the return value stays in ``state`` until the result is out."""
    if state["raised"]:
        return {"raised": state["raised"]}
    fn = state.pop("fn")
    call_args, call_kwargs = state.pop("args"), state.pop("kwargs")
    io0 = host.io_counters()
    t0 = time.perf_counter()
    try:
        with stdout_to_stderr():
            value = fn(*call_args, **call_kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit from the function included
        return {"raised": describe(exc, "the call", skip=1),
                "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    read = host.io_counters().since(io0)
    del call_args, call_kwargs
    mem = process_memory(mx)
    state["value"] = value
    result = {
        "seconds": seconds,
        "peak_rss": mem.get("VmHWM"),
        "anon": mem.get("RssAnon"),
        "rss": mem.get("VmRSS"),
        "rss_file": mem.get("RssFile"),
        "mlx_peak": mem["mx_peak"],
        "mlx_active": mem["mx_active"],
        "bytes_read": read["read_bytes"],
        "rchar": read["rchar"],
    }
    try:
        with open(args.out, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - the value cannot cross the process boundary
        result["raised"] = describe(exc, "pickling the return value")
    return result
