"""Launch a distributed run whose exit status is its ranks' (``pyloader launch``).

Each rank prints ``PYLOADER-RANK-EXIT <rank> <status> <size>``; the run exits 0 only when every
rank reported 0 (``mlx.launch`` itself exits 0 whatever its ranks do). See docs/distributed.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import TextIO

#: The line each wrapped rank prints when its command has ended.
RANK_EXIT = "PYLOADER-RANK-EXIT"


def _world_size() -> int | None:
    """The group size from the launcher's environment (ring: the hostfile's entries)."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return len(json.load(f))
    except (KeyError, OSError, ValueError, TypeError):  # unset or empty, unreadable, not JSON
        return None


def run_rank(command: list[str]) -> int:
    """Runs ``command`` (this rank's), forwards SIGTERM and SIGINT to it, then prints the
    :data:`RANK_EXIT` line and returns its status (negative: killed by that signal)."""
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    try:
        child = subprocess.Popen(command)
    except OSError as e:
        print(f"pyloader launch: rank {rank}: cannot run {command[0]!r}: {e}",
              file=sys.stderr, flush=True)
        status = 127
    else:
        def forward(signum, _frame):
            child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        status = child.wait()
    size = _world_size()
    sys.stdout.write(f"{RANK_EXIT} {rank} {status} {size if size else '?'}\n")
    sys.stdout.flush()
    return status


@dataclass
class LaunchResult:
    """What :func:`launch` saw: each rank's status, the launcher's own, the verdict."""

    launcher_status: int
    statuses: dict[int, int] = field(default_factory=dict)
    size: int | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def status(self) -> int:
        """0 when every rank and the launcher reported 0, else 1 (or the launcher's own status)."""
        return self.launcher_status or (1 if self.failures else 0)


def _expected_size(mlx_args: list[str]) -> int | None:
    """The rank count asked of mlx.launch (``-n``/``--nproc`` or ``--hosts``), if given."""
    for i, a in enumerate(mlx_args):
        value = None
        if a in ("-n", "--nproc", "--hosts") and i + 1 < len(mlx_args):
            value = mlx_args[i + 1]
        elif a.startswith(("--nproc=", "--hosts=")):
            value = a.split("=", 1)[1]
        if value is None:
            continue
        if a.startswith("--hosts"):
            return len([h for h in value.split(",") if h])
        try:
            return int(value)
        except ValueError:
            return None
    return None


def launch(mlx_args: list[str], command: list[str], *, out: TextIO | None = None,
           err: TextIO | None = None) -> LaunchResult:
    """Runs ``mlx.launch`` with every rank wrapped by :func:`run_rank`; each rank's status."""
    out = out or sys.stdout
    err = err or sys.stderr
    if not command:
        raise ValueError("pyloader launch: no command to run on the ranks (give it after --)")
    exe = shutil.which("mlx.launch")
    if exe is None:
        raise FileNotFoundError("pyloader launch: mlx.launch is not on PATH (it comes with "
                                "the mlx package)")
    wrapped = [sys.executable, "-m", "pyloader.launcher", "--", *command]
    proc = subprocess.Popen([exe, *mlx_args, "--", *wrapped], stdout=subprocess.PIPE,
                            text=True, errors="replace")
    statuses: dict[int, int] = {}
    sizes: set[int] = set()
    assert proc.stdout is not None
    for line in proc.stdout:
        at = line.find(RANK_EXIT + " ")
        if at >= 0:  # after the command's last unterminated line, if any
            parts = line[at:].split()
            try:
                statuses[int(parts[1])] = int(parts[2])
                if parts[3] != "?":
                    sizes.add(int(parts[3]))
                line = line[:at] + ("\n" if at else "")
            except (IndexError, ValueError):
                pass
        out.write(line)
        out.flush()
    result = LaunchResult(launcher_status=proc.wait(), statuses=statuses)
    expected = _expected_size(mlx_args)
    result.size = expected or (max(sizes) if sizes else None)
    ranks = range(result.size) if result.size else sorted(statuses)
    for r in ranks:
        s = statuses.get(r)
        if s is None:
            result.failures.append(f"rank {r} reported no exit status (killed, or its host "
                                   "lost)")
        elif s < 0:
            result.failures.append(f"rank {r} was killed by signal {-s}")
        elif s:
            result.failures.append(f"rank {r} exited with status {s}")
    if not ranks:
        result.failures.append("no rank reported an exit status")
    for f in result.failures:
        err.write(f"pyloader launch: {f}\n")
    if result.launcher_status:
        err.write(f"pyloader launch: mlx.launch exited with status {result.launcher_status}\n")
    err.flush()
    return result


def _main(argv: list[str]) -> int:
    """``python -m pyloader.launcher -- COMMAND...``: one rank's wrapper."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m pyloader.launcher -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    status = run_rank(argv)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
