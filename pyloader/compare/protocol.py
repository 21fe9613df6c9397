"""The measuring-child protocol (ready, go, result). See docs/compare.md."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from .._util import host
from ..errors import MeasureError

READY = "PYLOADER-READY"
RESULT = "PYLOADER-RESULT"
GO = "go"


def serve(prepare: Callable[[], tuple[dict, Any]], run: Callable[[Any], dict], *,
          wait: bool = True, result_file: str | None = None) -> int:
    """Run one measurement under the protocol; returns the exit status."""
    state = None
    try:
        ready, state = prepare()
        print(READY, json.dumps(ready), flush=True)
        if wait:
            line = sys.stdin.readline()
            if line.strip() != GO:
                raise SystemExit(f"expected {GO!r} on stdin, got {line!r}")
        result = run(state)
        code = 0
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        code = 1
    text = json.dumps(result, default=str)
    print(RESULT, text, flush=True)
    if result_file:
        os.makedirs(os.path.dirname(os.path.abspath(result_file)), exist_ok=True)
        with open(result_file, "w") as f:
            f.write(text)
    del state  # only now: freeing it earlier would land in the parent's timing
    return code


def process_memory(mx) -> dict[str, int | None]:
    """This process's memory figures and MLX's peak/active memory (None: not reported)."""
    return {**host.process_memory().as_status(), "mx_peak": mx.get_peak_memory(),
            "mx_active": mx.get_active_memory()}


def read_bytes() -> host.IoCounters:
    """This process's read counters now; ``later.since(earlier)`` gives the difference."""
    return host.io_counters()


class Child:
    """A measuring child process: ``start()``, ``go()``, ``close()`` (or ``with``).

    Args:
        workload: A name of :data:`pyloader.compare.workloads.WORKLOADS`, or a ``.py`` path.
        args: The workload's arguments.
        label: How errors name this child.
        timeout: Seconds allowed for each of ready and result.
        cgroup: A memory cgroup the child runs in, or None.
        python: Another interpreter to run the workload with; None: this one.
    """

    def __init__(self, workload: str, args: list[str], *, label: str = "",
                 timeout: float = 600.0, cgroup=None, python: str | None = None):
        self.label = label or f"{workload} {' '.join(args)}"
        self.timeout = timeout
        # Not "python -m": a source tree in the cwd would shadow the installed package.
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        boot = (("import sys; " if python else f"import sys; sys.path.insert(0, {here!r}); ")
                + "from pyloader.compare.child import main; sys.exit(main())")
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self._buf = b""
        self.proc = subprocess.Popen([python or sys.executable, "-c", boot, workload, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, bufsize=0,
                                     # "-c" would let a source tree in the cwd shadow the build.
                                     cwd=tempfile.gettempdir() if python else None,
                                     preexec_fn=cgroup.join if cgroup is not None else None)
        self.ready: dict | None = None

    def start(self) -> dict:
        """Wait for the child's ready line; returns what it reported."""
        self.ready = self._expect(READY)
        return self.ready

    def go(self) -> dict:
        """Start the measured work; returns the child's result."""
        self.proc.stdin.write(f"{GO}\n".encode())
        self.proc.stdin.flush()
        return self._expect(RESULT)

    def _expect(self, tag: str) -> dict:
        deadline = time.monotonic() + self.timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                key, _, payload = line.decode(errors="replace").partition(" ")
                if key not in (READY, RESULT):
                    continue  # anything else a library printed
                data = json.loads(payload)
                if "error" in data:
                    raise MeasureError(self._describe(data["error"], data.get("traceback")))
                if key != tag:
                    raise MeasureError(self._describe(f"expected {tag}, got {key}"))
                return data
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise MeasureError(self._describe(f"no {tag} within {self.timeout:.0f} s"))
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait()
                    raise MeasureError(self._describe(
                        f"exited with status {self.proc.returncode} before {tag}"))
                self._buf += chunk

    def _describe(self, what: str, child_traceback: str | None = None) -> str:
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
        msg = f"measuring {self.label}: {what}"
        if child_traceback:
            msg += f"\n--- child traceback ---\n{child_traceback.strip()}"
        return msg + (f"\n--- child stderr ---\n{tail}" if tail else "")

    def close(self) -> None:
        """Stop the child (if still running) and release its pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f and not f.closed:
                with contextlib.suppress(OSError):
                    f.close()
        self._stderr.close()

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_child(workload: str, args: list[str], *, label: str = "", timeout: float = 600.0,
              before_go: Callable[[dict], None] | None = None) -> dict:
    """Start a child, call ``before_go(ready)``, go, and return its result."""
    with Child(workload, args, label=label, timeout=timeout) as child:
        ready = child.start()
        if before_go is not None:
            before_go(ready)
        result = child.go()
    result["ready"] = ready
    return result
