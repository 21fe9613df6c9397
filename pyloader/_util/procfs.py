"""This process's and machine's counters from ``/proc`` and ``/sys`` (Linux; empty results or None
elsewhere)."""

from __future__ import annotations

import os

#: The fields of ``/proc/self/status`` pyloader reports (bytes once read).
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
#: Set to ``1`` to hide ``/proc`` and ``/sys`` from pyloader.
NO_PROC_ENV = "PYLOADER_NO_PROC"
_HIDDEN = ("/proc/", "/sys/")


def proc_disabled() -> bool:
    """True when ``PYLOADER_NO_PROC`` (non-empty, not ``0``) hides ``/proc`` and ``/sys``."""
    return os.environ.get(NO_PROC_ENV, "") not in ("", "0")


def _hidden(path: str | os.PathLike[str]) -> bool:
    return proc_disabled() and os.fspath(path).startswith(_HIDDEN)


def read_text(path: str | os.PathLike[str]) -> str | None:
    """A small file's text, or None when unreadable or hidden by ``PYLOADER_NO_PROC``."""
    if _hidden(path):
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_raw(path: str | os.PathLike[str]) -> bytes | None:
    """A small file's bytes, or None (like :func:`read_text`)."""
    if _hidden(path):
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def proc_available() -> bool:
    """True when this process's ``/proc/self`` can be read (Linux, not hidden)."""
    return not proc_disabled() and os.path.isdir("/proc/self/task")


def thread_alive(native_id: int) -> bool | None:
    """Whether OS thread ``native_id`` of this process still exists; None where unknown."""
    if not proc_available():
        return None
    return os.path.exists(f"/proc/self/task/{native_id}")


def status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile`` in bytes; empty when not Linux."""
    out = {}
    for line in (read_text("/proc/self/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            out[key] = int(value.split()[0]) * 1024
    return out


def io_counters() -> dict[str, int]:
    """``/proc/self/io``'s counters (``rchar``, ``read_bytes``, ...)."""
    raw = read_raw("/proc/self/io")
    if raw is None:
        return {}
    out = {}
    for line in raw.splitlines():
        key, _, value = line.partition(b":")
        out[key.decode()] = int(value)
    out["self_rchar"] = len(raw)
    return out


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS; False where that is not possible."""
    if proc_disabled():
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``kB`` fields converted); empty when missing."""
    out = {}
    for line in (read_text("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def loadavg() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, or None where unknown."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def parse_psi(text: str | None) -> tuple[float | None, float | None]:
    """``some`` and ``full`` avg10 (percent) of a PSI file's text (None where absent)."""
    some = full = None
    for line in (text or "").splitlines():
        fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        try:
            if line.startswith("some"):
                some = float(fields["avg10"])
            elif line.startswith("full"):
                full = float(fields["avg10"])
        except (KeyError, ValueError):
            pass
    return some, full


def pressure(resource: str) -> tuple[float | None, float | None]:
    """System-wide PSI of ``"cpu"``, ``"io"`` or ``"memory"``: ``some``/``full`` avg10."""
    return parse_psi(read_text(f"/proc/pressure/{resource}"))


def runnable_tasks() -> int | None:
    """Tasks running or ready to run machine-wide now, caller included; None where unknown."""
    for line in (read_text("/proc/stat") or "").splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return None


def other_runnable(samples: int = 20, interval: float = 0.05) -> float | None:
    """Mean number of *other* runnable tasks over ``samples`` readings ``interval`` s apart."""
    import time

    seen = []
    for i in range(samples):
        n = runnable_tasks()
        if n is None:
            return None
        seen.append(max(0, n - 1))
        if i + 1 < samples:
            time.sleep(interval)
    return sum(seen) / len(seen)
