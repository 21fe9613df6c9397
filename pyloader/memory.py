"""Memory probes: how much this process can still commit, from every limit that applies.

``read_memory()`` returns a :class:`MemorySnapshot` with

* ``mem_available``: the kernel's ``MemAvailable`` (``/proc/meminfo``; on macOS
  ``hw.memsize`` minus the wired, active and compressed pages from ``vm_stat``),
* the memory cgroup of *this* process (``/proc/self/cgroup``; v2 ``memory.max`` /
  ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``),
* PSI memory pressure (the cgroup's ``memory.pressure`` on v2, else
  ``/proc/pressure/memory``), ``some``/``full`` avg10 in percent,
* this process's RSS, anonymous RSS and file RSS (``/proc/self/status``),
* MLX's active and peak memory.

``headroom`` is the smallest of what is left: ``MemAvailable`` and the cgroup's
``limit - usage`` (the cgroup's usage counts its page cache: conservative on
purpose, a plan must never count on the kernel dropping pages it needs).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

__all__ = ["MemorySnapshot", "cgroup_memory_path", "read_memory"]

_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of every memory number pyloader plans with (bytes; None = unknown)."""

    time: float
    mem_total: Optional[int] = None
    mem_available: Optional[int] = None
    cgroup_version: Optional[int] = None
    cgroup_path: Optional[str] = None
    cgroup_limit: Optional[int] = None     # None: no limit
    cgroup_usage: Optional[int] = None
    psi_some_avg10: Optional[float] = None  # percent of time some task stalled on memory
    psi_full_avg10: Optional[float] = None
    rss: Optional[int] = None
    rss_anon: Optional[int] = None
    rss_file: Optional[int] = None
    peak_rss: Optional[int] = None
    mlx_active: Optional[int] = None
    mlx_peak: Optional[int] = None
    mlx_cache: Optional[int] = None

    @property
    def cgroup_headroom(self) -> Optional[int]:
        if self.cgroup_limit is None or self.cgroup_usage is None:
            return None
        return max(0, self.cgroup_limit - self.cgroup_usage)

    @property
    def headroom(self) -> Optional[int]:
        """Bytes this process can still commit: min(MemAvailable, cgroup limit - usage)."""
        found = [x for x in (self.mem_available, self.cgroup_headroom) if x is not None]
        return min(found) if found else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom"] = self.headroom
        d["cgroup_headroom"] = self.cgroup_headroom
        return d


def _read(path: str | Path) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _int_or_max(text: Optional[str]) -> tuple[bool, Optional[int]]:
    """(present, value) of a cgroup number file: "max" is present with value None."""
    if text is None:
        return False, None
    text = text.strip()
    if text == "max":
        return True, None
    try:
        v = int(text.split()[0])
    except (ValueError, IndexError):
        return False, None
    return True, (None if v >= _UNLIMITED else v)


def _meminfo() -> dict[str, int]:
    text = _read("/proc/meminfo") or ""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def cgroup_memory_path(root: str = "/sys/fs/cgroup",
                       proc_cgroup: str = "/proc/self/cgroup") -> tuple[Optional[int], Optional[Path]]:
    """(version, directory) of this process's memory cgroup, or (None, None).

    v1: the hierarchy whose controllers include ``memory``; v2: the ``0::`` entry.
    A v1 memory hierarchy wins when both are mounted (it is the one that limits).
    """
    text = _read(proc_cgroup)
    if not text:
        return None, None
    v2 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers and "memory" in controllers.split(","):
            for base in (Path(root) / "memory", Path(root) / controllers):
                d = base / rel
                if (d / "memory.limit_in_bytes").exists():
                    return 1, d
        elif controllers == "":
            for base in (Path(root), Path(root) / "unified"):
                d = base / rel
                if (d / "memory.current").exists() or (d / "memory.max").exists():
                    v2 = d
                    break
    return (2, v2) if v2 is not None else (None, None)


def _psi(text: Optional[str]) -> tuple[Optional[float], Optional[float]]:
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


def _status() -> dict[str, int]:
    out = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _darwin_memory() -> tuple[Optional[int], Optional[int]]:
    """(total, available) on macOS: hw.memsize minus wired + active + compressed pages."""
    try:
        total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True,
                                   text=True, timeout=5).stdout)
        vm = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return None, None
    page = 4096
    pages = {}
    for line in vm.splitlines():
        if "page size of" in line:
            page = int(line.split("page size of")[1].split()[0])
        key, _, v = line.partition(":")
        v = v.strip().rstrip(".")
        if v.isdigit():
            pages[key.strip()] = int(v)
    used = sum(pages.get(k, 0) for k in ("Pages wired down", "Pages active",
                                         "Pages occupied by compressor"))
    return total, max(0, total - used * page)


def _mlx() -> tuple[Optional[int], Optional[int], Optional[int]]:
    mx = sys.modules.get("mlx.core")
    if mx is None:  # never import MLX just to read zeros
        return None, None, None
    return mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()


def read_memory() -> MemorySnapshot:
    """Reads every probe once (cheap: a few small files)."""
    info = _meminfo()
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    if avail is None and sys.platform == "darwin":
        total, avail = _darwin_memory()
    version, path = cgroup_memory_path()
    limit = usage = None
    psi_text = None
    if version == 1:
        _, limit = _int_or_max(_read(path / "memory.limit_in_bytes"))
        _, usage = _int_or_max(_read(path / "memory.usage_in_bytes"))
    elif version == 2:
        _, limit = _int_or_max(_read(path / "memory.max"))
        _, usage = _int_or_max(_read(path / "memory.current"))
        psi_text = _read(path / "memory.pressure")
    if psi_text is None:
        psi_text = _read("/proc/pressure/memory")
    some, full = _psi(psi_text)
    st = _status()
    if not st:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        st = {"VmHWM": peak if sys.platform == "darwin" else peak * 1024}
    active, peak, cache = _mlx()
    return MemorySnapshot(
        time=time.monotonic(), mem_total=total, mem_available=avail,
        cgroup_version=version, cgroup_path=str(path) if path else None,
        cgroup_limit=limit, cgroup_usage=usage, psi_some_avg10=some, psi_full_avg10=full,
        rss=st.get("VmRSS"), rss_anon=st.get("RssAnon"), rss_file=st.get("RssFile"),
        peak_rss=st.get("VmHWM"), mlx_active=active, mlx_peak=peak, mlx_cache=cache)


def headroom() -> Optional[int]:
    """``read_memory().headroom``."""
    return read_memory().headroom

