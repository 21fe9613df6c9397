"""How much memory a load may still take, and a pre-flight check against it.

A load that copies tensors (``pread``, and ``mmap`` for misaligned tensors)
allocates anonymous memory. Under a memory cgroup the kernel does not fail
such an allocation: it kills the process once the pages are touched, half way
through the load. Checking before the first allocation turns that into a
``MemoryError`` naming the file, the bytes needed and the bytes available,
and nothing is allocated.
"""

from __future__ import annotations

from pathlib import Path

_UNLIMITED = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def _cgroup_headroom() -> tuple[int, str] | None:
    """Limit minus non-reclaimable usage of this process's memory cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if "memory" in controllers.split(","):  # v1
            d = Path("/sys/fs/cgroup/memory") / rel
            stat = _stat(d / "memory.stat")
            limit = min(stat.get("hierarchical_memory_limit", _UNLIMITED),
                        _read_int(d / "memory.limit_in_bytes") or _UNLIMITED)
            usage = _read_int(d / "memory.usage_in_bytes")
            cache = stat.get("total_cache", stat.get("cache", 0))
        elif controllers == "":  # v2
            d = Path("/sys/fs/cgroup") / rel
            limit = _read_int(d / "memory.max") or _UNLIMITED
            usage = _read_int(d / "memory.current")
            cache = _stat(d / "memory.stat").get("file", 0)
        else:
            continue
        if usage is None or limit >= _UNLIMITED:
            continue
        # Page cache is reclaimable: it does not stand in a copy's way.
        return max(0, limit - max(0, usage - cache)), f"memory cgroup limit {limit} bytes"
    return None


def available_memory() -> tuple[int, str]:
    """(bytes a load may still allocate, where that figure comes from)."""
    best = (_UNLIMITED, "no limit found")
    meminfo = _stat_meminfo()
    if meminfo is not None:
        best = (meminfo, "MemAvailable")
    cg = _cgroup_headroom()
    if cg is not None and cg[0] < best[0]:
        best = cg
    return best


def _stat_meminfo() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(nbytes: int, what: str) -> None:
    """Raise ``MemoryError`` when ``nbytes`` of copies cannot fit."""
    avail, source = available_memory()
    if nbytes > avail:
        raise MemoryError(
            f"{what}: the load copies {nbytes} bytes into memory but only {avail} bytes are "
            f"available ({source}); nothing was loaded. Use strategy='mmap' (zero-copy views) "
            f"or stream the model (pyloader.load_model with resident < 1.0)")
