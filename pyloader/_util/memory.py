"""Memory probes: how much this process can still commit, from every limit that applies.

:func:`read_memory` returns a :class:`MemorySnapshot`; :func:`headroom_of` is the one headroom
rule, with the page cache counted as ``"used"`` (plans) or ``"reclaimable"`` (pre-flight checks).
See docs/memory-planning.md.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from .host import host_memory, pressure_level, process_memory
from .procfs import parse_psi, read_text
from .sizes import parse_bytes

#: How a headroom treats the page cache charged to the cgroup (see the module doc).
PAGE_CACHE_RULES = ("used", "reclaimable")
_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number
HEADROOM_ENV = "PYLOADER_HEADROOM"


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of every memory number pyloader plans with (bytes; None = unknown)."""

    time: float
    mem_total: int | None = None
    mem_available: int | None = None
    cgroup_version: int | None = None
    cgroup_path: str | None = None
    cgroup_limit: int | None = None     # None: no limit
    cgroup_usage: int | None = None
    cgroup_cache: int | None = None     # page cache charged to the cgroup (in its usage)
    psi_some_avg10: float | None = None  # percent of time some task stalled on memory
    psi_full_avg10: float | None = None
    pressure_level: str | None = None   # macOS: "normal" | "warning" | "critical"
    rss: int | None = None
    rss_anon: int | None = None
    rss_file: int | None = None
    peak_rss: int | None = None
    mlx_active: int | None = None
    mlx_peak: int | None = None
    mlx_cache: int | None = None
    device_limit: int | None = None     # Metal GPU: max_recommended_working_set_size
    clamp: int | None = None            # PYLOADER_HEADROOM, when set

    @property
    def device_headroom(self) -> int | None:
        """Metal's ``device_limit - mlx_active``, or None (no Metal GPU by default)."""
        if self.device_limit is None:
            return None
        return max(0, self.device_limit - (self.mlx_active or 0))

    @property
    def cgroup_headroom(self) -> int | None:
        """The cgroup's ``limit - usage`` (page cache counted as used), or None."""
        if self.cgroup_limit is None or self.cgroup_usage is None:
            return None
        return max(0, self.cgroup_limit - self.cgroup_usage)

    @property
    def headroom(self) -> int | None:
        """``headroom_of(self, page_cache="used")``: what a plan may count on."""
        return headroom_of(self, page_cache="used")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom"] = self.headroom
        d["cgroup_headroom"] = self.cgroup_headroom
        return d


def headroom_of(snap: MemorySnapshot, *, page_cache: Literal["used", "reclaimable"]
                ) -> int | None:
    """Bytes this process can still commit: the least of every limit (``MemAvailable``, cgroup,
    Metal, ``PYLOADER_HEADROOM``), the page cache counted as ``page_cache`` says."""
    if page_cache not in PAGE_CACHE_RULES:
        raise ValueError(f"page_cache must be one of {PAGE_CACHE_RULES}, got {page_cache!r}")
    found = [] if snap.mem_available is None else [snap.mem_available]
    if snap.cgroup_limit is not None and snap.cgroup_usage is not None:
        usage = snap.cgroup_usage
        if page_cache == "reclaimable":
            usage -= min(usage, snap.cgroup_cache or 0)
        found.append(max(0, snap.cgroup_limit - usage))
    if snap.device_headroom is not None:
        found.append(snap.device_headroom)
    if snap.clamp is not None:
        found.append(snap.clamp)
    return min(found) if found else None


def limiting_probe(snap: MemorySnapshot, *, page_cache: Literal["used", "reclaimable"]) -> str:
    """Which probe sets :func:`headroom_of` (for messages)."""
    if snap.clamp is not None and snap.clamp == headroom_of(snap, page_cache=page_cache):
        return f"{HEADROOM_ENV}={snap.clamp}"
    cg = None
    if snap.cgroup_limit is not None and snap.cgroup_usage is not None:
        cg = headroom_of(MemorySnapshot(time=snap.time, cgroup_limit=snap.cgroup_limit,
                                        cgroup_usage=snap.cgroup_usage,
                                        cgroup_cache=snap.cgroup_cache), page_cache=page_cache)
    dev = snap.device_headroom
    if dev is not None and dev == headroom_of(snap, page_cache=page_cache) and (
            cg is None or dev < cg):
        return (f"Metal max_recommended_working_set_size {snap.device_limit} bytes "
                f"({snap.mlx_active or 0} in use by MLX)")
    if cg is not None and (snap.mem_available is None or cg <= snap.mem_available):
        return f"memory cgroup v{snap.cgroup_version} limit {snap.cgroup_limit} bytes"
    return "MemAvailable" if snap.mem_available is not None else "no limit found"


def _int_or_max(text: str | None) -> tuple[bool, int | None]:
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


def _stat_file(text: str | None) -> dict[str, int]:
    out = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def cgroup_memory_path(root: str = "/sys/fs/cgroup",
                       proc_cgroup: str = "/proc/self/cgroup") -> tuple[int | None, Path | None]:
    """(version, directory) of this process's memory cgroup, or (None, None)."""
    text = read_text(proc_cgroup)
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


def cgroup_memory(version: int | None, path: Path | None
                  ) -> tuple[int | None, int | None, int | None]:
    """(limit, usage, page cache) of the cgroup at ``path`` (None where unknown or unlimited)."""
    if version == 1:
        stat = _stat_file(read_text(path / "memory.stat"))
        _, limit = _int_or_max(read_text(path / "memory.limit_in_bytes"))
        hier = stat.get("hierarchical_memory_limit")
        if hier is not None and hier < _UNLIMITED:  # a parent's limit applies too
            limit = hier if limit is None else min(limit, hier)
        _, usage = _int_or_max(read_text(path / "memory.usage_in_bytes"))
        return limit, usage, stat.get("total_cache", stat.get("cache"))
    if version == 2:
        _, limit = _int_or_max(read_text(path / "memory.max"))
        _, usage = _int_or_max(read_text(path / "memory.current"))
        return limit, usage, _stat_file(read_text(path / "memory.stat")).get("file")
    return None, None, None


_WORKING_SET: dict[str, int | None] = {}


def metal_working_set(mx) -> int | None:
    """Metal's ``max_recommended_working_set_size`` when ``mx`` runs on a Metal GPU, else None."""
    if mx is None:
        return None
    try:
        if mx.default_device().type != mx.gpu or not mx.metal.is_available():
            return None
        if "gpu" not in _WORKING_SET:
            value = mx.device_info(mx.gpu).get("max_recommended_working_set_size")
            _WORKING_SET["gpu"] = int(value) if value else None
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return _WORKING_SET["gpu"]


def _mlx() -> tuple[int | None, int | None, int | None, int | None]:
    mx = sys.modules.get("mlx.core")
    if mx is None:  # never import MLX just to read zeros
        return None, None, None, None
    return (mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(),
            metal_working_set(mx))


def read_memory() -> MemorySnapshot:
    """Reads every probe once (no process is started)."""
    total, avail = host_memory()
    version, path = cgroup_memory_path()
    limit, usage, cache = cgroup_memory(version, path)
    psi_text = read_text(path / "memory.pressure") if version == 2 else None
    if psi_text is None:
        psi_text = read_text("/proc/pressure/memory")
    some, full = parse_psi(psi_text)
    proc = process_memory()
    active, peak, mlx_cache, working_set = _mlx()
    return MemorySnapshot(
        time=time.monotonic(), mem_total=total, mem_available=avail,
        cgroup_version=version, cgroup_path=str(path) if path else None,
        cgroup_limit=limit, cgroup_usage=usage, cgroup_cache=cache,
        psi_some_avg10=some, psi_full_avg10=full, pressure_level=pressure_level(),
        rss=proc.rss, rss_anon=proc.rss_anon, rss_file=proc.rss_file,
        peak_rss=proc.peak_rss, mlx_active=active, mlx_peak=peak, mlx_cache=mlx_cache,
        device_limit=working_set, clamp=headroom_clamp())


def headroom_clamp() -> int | None:
    """``PYLOADER_HEADROOM`` in bytes, or None when unset."""
    text = os.environ.get(HEADROOM_ENV)
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"{HEADROOM_ENV}: {e}") from None
