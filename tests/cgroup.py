"""A memory cgroup (v1) for one child process, for the memory-limit proofs."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def unavailable_reason() -> str | None:
    """Why a memory cgroup cannot be created here, or None when it can."""
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
    """Creates ``/sys/fs/cgroup/memory/pyloader-<id>`` with a hard limit; runs
    commands inside it; removes it on exit."""

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

    def run(self, args: list[str], timeout: float, cwd: str | None = None):
        """Runs `args` as a child that joins this cgroup before exec."""
        procs = str(self.path / "cgroup.procs")

        def join():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=join, cwd=cwd)

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def __exit__(self, *exc) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                import time
                time.sleep(0.1)


PYTHON = sys.executable
