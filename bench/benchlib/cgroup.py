"""A memory cgroup (v1) for measuring children: the memory-limit proofs (tests) and the
scale runs (``bench/seed_scale.py``).

Creating one needs root and the v1 memory controller at ``/sys/fs/cgroup/memory``;
:func:`unavailable_reason` says why it cannot be made here (tests skip with it).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

from pyloader.compare.system import NO_PROC_ENV, proc_disabled

ROOT = Path("/sys/fs/cgroup/memory")


def unavailable_reason() -> str | None:
    """Why a memory cgroup cannot be created here, or None when it can."""
    if proc_disabled():  # pyloader could not see the limit it is to be proven against
        return f"{NO_PROC_ENV} hides cgroups from pyloader"
    if not ROOT.is_dir():
        return f"no cgroup v1 memory controller at {ROOT}"
    probe = ROOT / f"pyloader-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text("1073741824")
    except OSError as e:
        return f"cannot create a memory cgroup under {ROOT}: {e}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


class MemoryCgroup:
    """Creates ``/sys/fs/cgroup/memory/pyloader-<id>`` with a hard limit (swap included
    where the kernel accounts it); children join it before they exec (:meth:`run`, or
    :meth:`join` as a ``preexec_fn``); removed on exit."""

    def __init__(self, limit_bytes: int):
        self.path = ROOT / f"pyloader-{uuid.uuid4().hex[:12]}"
        self.limit = limit_bytes

    def __enter__(self) -> "MemoryCgroup":
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():  # no swapping around the limit either
            swap.write_text(str(self.limit))
        return self

    def join(self) -> None:
        """Moves the calling process into the cgroup (a ``preexec_fn``: the child joins
        between fork and exec, so everything it allocates is charged)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def run(self, args: list[str], timeout: float, cwd: str | None = None,
            env: dict[str, str] | None = None):
        """Runs ``args`` as a child inside this cgroup (``env``: its environment, by default
        this process's); returns the completed process."""
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=self.join, cwd=cwd, env=env)

    def read(self, name: str) -> int:
        """A counter of the cgroup, e.g. ``memory.max_usage_in_bytes``, ``memory.failcnt``."""
        return int((self.path / name).read_text().split()[0])

    def oom_kills(self) -> int:
        """Processes the kernel killed at this cgroup's limit (``oom_kill`` in
        ``memory.oom_control``; 0 on kernels that do not report it)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # the last child's exit is accounted asynchronously
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
