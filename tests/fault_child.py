"""Fault scenarios, each run in its own process by tests/test_faults.py so
that a SIGBUS or a hang fails one test instead of killing pytest.

    python tests/fault_child.py <scenario> <model dir> <strategy> [args]

Prints one JSON line with what happened.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import pyloader
from pyloader import _core
from pyloader.streaming import controller_of

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 5, 9, 11, 200]


def process_resources(path: Path) -> dict:
    """Open descriptors and mappings of files under `path`, and threads. Where /proc/self
    is missing, prints a skip for the parent (tests/test_faults.py: `child`) and exits."""
    if not os.path.isdir("/proc/self/fd"):
        print(json.dumps({"skip": "counts descriptors, mappings and threads in /proc/self, "
                                  "which this platform does not have"}))
        sys.exit(0)
    root = str(path)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                fds += 1
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if root in line)
    return {"fds": fds, "maps": maps, "threads": len(os.listdir("/proc/self/task"))}


def reference_tokens(path: Path, n: int) -> list[int]:
    model, _ = mlx_lm_load_model(path)
    out = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]
    del model
    return out


def tokens(model, n: int, out: list[int]) -> None:
    for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n):
        out.append(int(t))


def error_info(e: BaseException) -> dict:
    return {"type": type(e).__name__, "errno": getattr(e, "errno", None),
            "filename": getattr(e, "filename", None), "offset": getattr(e, "offset", None),
            "message": str(e)}


def change_file(f: Path, how: str) -> None:
    data = f.read_bytes()
    if how == "truncate":
        os.truncate(f, len(data) // 2)
    elif how == "grow":
        with open(f, "ab") as fh:
            fh.write(b"\0" * 4096)
    elif how == "rewrite":
        # Same size, same inode, other bytes in the data section (in place).
        with open(f, "r+b") as fh:
            fh.seek(len(data) // 2)
            fh.write(bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 65536]))
    elif how == "rewrite_keep_mtime":
        # The same in-place rewrite with the modification time put back (as a
        # careless sync tool or an attacker would): only the ctime tells.
        st = f.stat()
        with open(f, "r+b") as fh:
            fh.seek(len(data) // 2)
            fh.write(bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 65536]))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert f.stat().st_mtime_ns == st.st_mtime_ns
    elif how == "replace":
        # A new version renamed over the old one (what downloaders do).
        tmp = f.with_suffix(".new")
        tmp.write_bytes(data[:len(data) // 2] + bytes(b ^ 0xFF for b in data[len(data) // 2:]))
        os.replace(tmp, f)
    else:
        raise ValueError(how)


def scenario_changed(path: Path, strategy: str, how: str) -> dict:
    """The checkpoint is changed between two tokens of a streamed generation."""
    n = 12
    ref = reference_tokens(path, n)
    model, _ = pyloader.load_model(path, resident=0.5,
                                   options=pyloader.StreamOptions(strategy=strategy, prefetch=1))
    got: list[int] = []
    err = None
    gen = generate_step(mx.array(PROMPT), model, max_tokens=n)
    try:
        for i, (t, _) in enumerate(gen):
            got.append(int(t))
            if i == 3:
                change_file(path / "model.safetensors", how)
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = error_info(e)
    return {"reference": ref, "tokens": got, "error": err,
            "pending": pyloader.stats(model)["reads_in_flight"]}


def scenario_changed_experts(path: Path, strategy: str, source: str) -> dict:
    """An MoE checkpoint rewritten in place (modification time restored) between two
    tokens of a generation whose experts come through a cache of 4 slots per layer."""
    n = 16
    ref = reference_tokens(path, n)
    model, _ = pyloader.load_model(
        path, resident=1.0, tokenizer=False,
        options=pyloader.StreamOptions(strategy=strategy, experts=4, expert_source=source))
    got: list[int] = []
    err = None
    try:
        for i, (t, _) in enumerate(generate_step(mx.array(PROMPT), model, max_tokens=n)):
            got.append(int(t))
            if i == 3:
                for f in sorted(path.glob("*.safetensors")):
                    change_file(f, "rewrite_keep_mtime")
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = error_info(e)
    return {"reference": ref, "tokens": got, "error": err}


def scenario_truncate_race(path: Path, strategy: str, trials: str, seed: str) -> dict:
    """The checkpoint is truncated at a random moment (0-300 ms) while a
    generation runs: each trial must end in OSError or complete, never a
    signal; tokens before the error are compared with the reference."""
    import random
    import shutil

    n = 64
    ref = reference_tokens(path, n)
    rng = random.Random(int(seed))
    outcomes = {"errors": 0, "completed": 0, "wrong_token_trials": 0, "tokens_checked": 0,
                "errnos": {}}
    guarded0 = _core._guarded_faults()
    for trial in range(int(trials)):
        work = path.parent / f"race{trial}"
        shutil.copytree(path, work)
        f = work / "model.safetensors"
        model, _ = pyloader.load_model(
            work, resident=0.5, options=pyloader.StreamOptions(strategy=strategy, prefetch=1))
        delay = rng.uniform(0, 0.3)
        timer = threading.Timer(delay, lambda: os.truncate(f, f.stat().st_size // 3))
        timer.start()
        got: list[int] = []
        try:
            tokens(model, n, got)
            outcomes["completed"] += 1
        except OSError as e:
            outcomes["errors"] += 1
            outcomes["errnos"][str(e.errno)] = outcomes["errnos"].get(str(e.errno), 0) + 1
        timer.join()
        outcomes["tokens_checked"] += len(got)
        outcomes["wrong_token_trials"] += got != ref[:len(got)]
        del model
        gc.collect()
        shutil.rmtree(work)
    outcomes["guarded_faults"] = _core._guarded_faults() - guarded0
    return outcomes


def scenario_sigbus_guard(path: Path, strategy: str) -> dict:
    """A zero-copy view of a tensor whose pages are cut off by a truncation is
    read: without the guard this is a SIGBUS."""
    reader = pyloader.MmapReader(path)
    last = max(reader.checkpoint.tensors(), key=lambda t: t.offset)
    view = reader.get(last.name)
    os.truncate(path, last.offset)  # every page of the tensor is past the end
    before = _core._guarded_faults()
    total = mx.sum(view).item()
    faults = _core._guarded_faults() - before
    err = None
    try:
        reader.check_unchanged()
    except OSError as e:
        err = error_info(e)
    return {"sum": total, "faults": faults, "nbytes": last.nbytes, "error": err}


def scenario_io_error(path: Path, strategy: str) -> dict:
    """An injected EIO under a streamed layer; then the fault clears and the
    same model must generate the right tokens again."""
    n = 8
    ref = reference_tokens(path, n)
    model, _ = pyloader.load_model(path, resident=0,
                                   options=pyloader.StreamOptions(strategy=strategy, prefetch=2))
    unit = controller_of(model).layout.units[1]
    meta = next(iter(unit.sources.values()))
    before = process_resources(path)
    f = str(path / "model.safetensors")
    _core._set_read_fault(f, meta.offset + meta.nbytes // 2, errno.EIO)
    err = None
    got: list[int] = []
    try:
        tokens(model, n, got)
    except Exception as e:  # noqa: BLE001
        err = error_info(e)
    pending = pyloader.stats(model)["reads_in_flight"]
    _core._clear_read_faults()
    again: list[int] = []
    tokens(model, n, again)
    return {"reference": ref, "error": err, "tensor_offset": meta.offset,
            "tensor_nbytes": meta.nbytes, "pending_after_error": pending, "again": again,
            "threads_before": before["threads"],
            "threads_after": process_resources(path)["threads"]}


def scenario_interrupt_generation(path: Path, strategy: str) -> dict:
    """SIGINT (Ctrl-C) during a long streamed generation."""
    reference_tokens(path, 2)  # MLX's own threads exist before the baseline
    base = process_resources(path)
    model, _ = pyloader.load_model(path, resident=0,
                                   options=pyloader.StreamOptions(strategy=strategy, prefetch=1))
    got: list[int] = []
    started = threading.Event()

    def fire():
        started.wait()
        time.sleep(0.5)
        fire.at = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()
    interrupted = False
    try:
        for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=1_000_000):
            got.append(int(t))
            started.set()
    except KeyboardInterrupt:
        interrupted = True
    latency = time.perf_counter() - fire.at
    pending = pyloader.stats(model)["reads_in_flight"]
    during = process_resources(path)
    del model
    gc.collect()
    return {"interrupted": interrupted, "latency_s": latency, "tokens": len(got),
            "pending": pending, "base": base, "during": during,
            "after": process_resources(path)}


def scenario_interrupt_load(path: Path, strategy: str) -> dict:
    """SIGINT during a long load (`path` is a large .safetensors file): loads
    repeat until the interrupt lands."""
    mx.eval(mx.ones(4) + 1)  # MLX's own threads exist before the baseline
    base = process_resources(path.parent)
    started = threading.Event()

    def fire():
        started.wait()
        time.sleep(0.3)
        fire.at = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()
    def one_load():
        # The arrays live in this frame only, so they die with the
        # interrupt's traceback wherever the interrupt lands.
        arrays = pyloader.load(path, strategy=strategy)
        mx.eval(list(arrays.values()))

    loads, interrupted, t_load = 0, False, 0.0
    try:
        while True:
            started.set()
            t0 = time.perf_counter()
            one_load()
            t_load = time.perf_counter() - t0
            loads += 1
            pyloader.evict_file(path)
    except KeyboardInterrupt:
        interrupted = True
    latency = time.perf_counter() - fire.at
    gc.collect()
    return {"interrupted": interrupted, "latency_s": latency, "loads": loads,
            "one_load_s": t_load, "base": base, "after": process_resources(path.parent)}


def main() -> None:
    # Ctrl-C must raise KeyboardInterrupt here even when this process was started with
    # SIGINT ignored (a shell starts background jobs so, and Python then keeps it
    # ignored): the interrupt scenarios test pyloader, not how the tests were launched.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    scenario, path, strategy, *rest = sys.argv[1:]
    fn = globals()[f"scenario_{scenario}"]
    result = fn(Path(path), strategy, *rest)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main()
