"""This process's memory and I/O counters and the machine's memory, on every platform.

Sources: Linux ``/proc``, the macOS kernel's interfaces (:mod:`.darwin`), else ``getrusage`` and
``sysconf``. A figure the platform does not report is None, never a missing key or a stand-in.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

from . import darwin
from .procfs import io_counters as proc_io
from .procfs import meminfo, status

_DARWIN: darwin.DarwinHost | None = None


def darwin_host() -> darwin.DarwinHost | None:
    """This process's :class:`.darwin.DarwinHost` on macOS (made once), else None."""
    global _DARWIN
    if _DARWIN is None and sys.platform == "darwin":
        _DARWIN = darwin.default_host()
    return _DARWIN


def set_darwin_host(host: darwin.DarwinHost | None) -> darwin.DarwinHost | None:
    """Answer through ``host`` from now on (for tests); None restores this machine's."""
    global _DARWIN
    previous, _DARWIN = _DARWIN, host
    return previous


@dataclass(frozen=True)
class ProcessMemory:
    """This process's memory in bytes; None: not reported on this platform.

    Attributes:
        rss: Resident set size.
        peak_rss: Peak resident set size (known everywhere).
        rss_anon: Anonymous resident memory.
        rss_file: File-backed resident memory, mapped weights included.
        source: ``"proc"``, ``"darwin"`` or ``"getrusage"``.
    """

    rss: int | None
    peak_rss: int | None
    rss_anon: int | None
    rss_file: int | None
    source: str

    def as_status(self) -> dict[str, int | None]:
        """``/proc/self/status``-style figures, every key present, None where unknown."""
        return {"VmHWM": self.peak_rss, "VmRSS": self.rss, "RssAnon": self.rss_anon,
                "RssFile": self.rss_file}


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (``VmHWM``, else ``getrusage``)."""
    peak = status().get("VmHWM")
    if peak is not None:
        return peak
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if sys.platform == "darwin" else ru * 1024  # macOS: bytes; Linux: KiB


def process_memory() -> ProcessMemory:
    """This process's :class:`ProcessMemory` now."""
    st = status()
    if st:
        peak = st.get("VmHWM")
        return ProcessMemory(rss=st.get("VmRSS"), peak_rss=peak if peak is not None else
                             peak_rss(), rss_anon=st.get("RssAnon"),
                             rss_file=st.get("RssFile"), source="proc")
    host = darwin_host()
    if host is not None:
        rss, anon, file = host.process()
        return ProcessMemory(rss=rss, peak_rss=peak_rss(), rss_anon=anon, rss_file=file,
                             source="darwin")
    return ProcessMemory(rss=None, peak_rss=peak_rss(), rss_anon=None, rss_file=None,
                         source="getrusage")


@dataclass(frozen=True)
class IoCounters:
    """This process's read counters in bytes since it started; None: not counted here.

    Attributes:
        read_bytes: Bytes fetched from storage, page faults on mapped files included.
        rchar: Bytes through read calls, page-cache hits included (Linux only).
        self_rchar: What reading ``/proc/self/io`` itself adds to ``rchar``.
    """

    read_bytes: int | None
    rchar: int | None
    self_rchar: int = 0

    def since(self, before: IoCounters) -> dict[str, int | None]:
        """``{"read_bytes": ..., "rchar": ...}`` between ``before`` and this reading (``before``'s
        own read of ``/proc/self/io`` left out); None where either reading lacks the counter."""
        def diff(a: int | None, b: int | None, own: int = 0) -> int | None:
            return None if a is None or b is None else a - b - own

        return {"read_bytes": diff(self.read_bytes, before.read_bytes),
                "rchar": diff(self.rchar, before.rchar, before.self_rchar)}


def io_counters() -> IoCounters:
    """This process's :class:`IoCounters` now."""
    io = proc_io()
    if io:
        return IoCounters(read_bytes=io.get("read_bytes"), rchar=io.get("rchar"),
                          self_rchar=io["self_rchar"] if "rchar" in io else 0)
    host = darwin_host()
    if host is not None:
        return IoCounters(read_bytes=host.bytes_read(), rchar=None)
    if sys.platform.startswith("linux"):
        blocks = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
        return IoCounters(read_bytes=blocks * 512, rchar=None)
    return IoCounters(read_bytes=None, rchar=None)


def _sysconf_pages(name: str) -> int | None:
    try:
        pages = os.sysconf(name)
        page = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of the machine; None where unknown."""
    info = meminfo()
    if "MemAvailable" in info:
        return info.get("MemTotal"), info["MemAvailable"]
    host = darwin_host()
    if host is not None:
        return host.memsize(), host.available()
    return _sysconf_pages("SC_PHYS_PAGES"), _sysconf_pages("SC_AVPHYS_PAGES")


def pressure_level() -> str | None:
    """The kernel's memory-pressure level (``"normal"``, ``"warning"``, ``"critical"``: macOS), or
    None (Linux: see :func:`.procfs.pressure`)."""
    host = darwin_host()
    return host.pressure_level() if host is not None else None
