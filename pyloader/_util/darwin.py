"""Host and process figures on macOS (XNU), from the kernel's own interfaces.

:class:`Libc` calls libSystem through ctypes; :class:`DarwinHost` falls back to the ``sysctl``
and ``vm_stat`` commands, keeping their answers for :data:`COMMAND_TTL` seconds.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from typing import Callable

#: ``kern.memorystatus_vm_pressure_level`` values (sys/kern_memorystatus.h).
PRESSURE_LEVELS = {1: "normal", 2: "warning", 4: "critical"}
#: Seconds a command fallback's answer is reused.
COMMAND_TTL = 1.0

HOST_VM_INFO64 = 4
TASK_VM_INFO = 22
RUSAGE_INFO_V2 = 2
KERN_SUCCESS = 0

#: ``runner(argv) -> stdout text`` (None when the command fails).
Runner = Callable[[list], str | None]


class VmStatistics64(ctypes.Structure):
    """``struct vm_statistics64`` (mach/vm_statistics.h), 8-byte aligned: 152 bytes."""

    _fields_ = [
        ("free_count", ctypes.c_uint32), ("active_count", ctypes.c_uint32),
        ("inactive_count", ctypes.c_uint32), ("wire_count", ctypes.c_uint32),
        ("zero_fill_count", ctypes.c_uint64), ("reactivations", ctypes.c_uint64),
        ("pageins", ctypes.c_uint64), ("pageouts", ctypes.c_uint64),
        ("faults", ctypes.c_uint64), ("cow_faults", ctypes.c_uint64),
        ("lookups", ctypes.c_uint64), ("hits", ctypes.c_uint64), ("purges", ctypes.c_uint64),
        ("purgeable_count", ctypes.c_uint32), ("speculative_count", ctypes.c_uint32),
        ("decompressions", ctypes.c_uint64), ("compressions", ctypes.c_uint64),
        ("swapins", ctypes.c_uint64), ("swapouts", ctypes.c_uint64),
        ("compressor_page_count", ctypes.c_uint32), ("throttled_count", ctypes.c_uint32),
        ("external_page_count", ctypes.c_uint32), ("internal_page_count", ctypes.c_uint32),
        ("total_uncompressed_pages_in_compressor", ctypes.c_uint64),
    ]


class RusageInfoV2(ctypes.Structure):
    """``struct rusage_info_v2`` (sys/resource.h): 160 bytes."""

    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [(name, ctypes.c_uint64) for name in (
        "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups",
        "ri_pageins", "ri_wired_size", "ri_resident_size", "ri_phys_footprint",
        "ri_proc_start_abstime", "ri_proc_exit_abstime", "ri_child_user_time",
        "ri_child_system_time", "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups",
        "ri_child_pageins", "ri_child_elapsed_abstime", "ri_diskio_bytesread",
        "ri_diskio_byteswritten")]


class TaskVmInfo(ctypes.Structure):
    """The revision-0 part of ``struct task_vm_info`` (mach/task_info.h, packed to 4 bytes)."""

    _pack_ = 4
    _fields_ = [("virtual_size", ctypes.c_uint64), ("region_count", ctypes.c_int32),
                ("page_size", ctypes.c_int32)] + [(name, ctypes.c_uint64) for name in (
                    "resident_size", "resident_size_peak", "device", "device_peak",
                    "internal", "internal_peak", "external", "external_peak", "reusable",
                    "reusable_peak", "purgeable_volatile_pmap",
                    "purgeable_volatile_resident", "purgeable_volatile_virtual",
                    "compressed", "compressed_peak", "compressed_lifetime")]


class Libc:
    """libSystem's calls through ctypes (macOS); every method returns None on failure."""

    def __init__(self, lib=None):
        self.lib = lib if lib is not None else ctypes.CDLL(None, use_errno=True)

    def sysctl(self, name: str) -> int | None:
        """An integer sysctl (4 or 8 bytes)."""
        value = ctypes.c_uint64(0)
        size = ctypes.c_size_t(ctypes.sizeof(value))
        if self.lib.sysctlbyname(name.encode(), ctypes.pointer(value), ctypes.pointer(size),
                                 None, ctypes.c_size_t(0)) != 0:
            return None
        if size.value == 4:
            return value.value & 0xFFFFFFFF
        return value.value if size.value == 8 else None

    def vm_statistics(self) -> VmStatistics64 | None:
        info = VmStatistics64()
        count = ctypes.c_uint32(ctypes.sizeof(info) // 4)
        host = self.lib.mach_host_self()
        if self.lib.host_statistics64(host, HOST_VM_INFO64, ctypes.pointer(info),
                                      ctypes.pointer(count)) != KERN_SUCCESS:
            return None
        return info

    def rusage(self) -> RusageInfoV2 | None:
        info = RusageInfoV2()
        if self.lib.proc_pid_rusage(os.getpid(), RUSAGE_INFO_V2, ctypes.pointer(info)) != 0:
            return None
        return info

    def task_self(self) -> int:
        """This task's port (``mach_task_self()``, a macro for the ``mach_task_self_`` global)."""
        return ctypes.c_uint32.in_dll(self.lib, "mach_task_self_").value

    def task_vm_info(self) -> TaskVmInfo | None:
        info = TaskVmInfo()
        count = ctypes.c_uint32(ctypes.sizeof(info) // 4)
        if self.lib.task_info(self.task_self(), TASK_VM_INFO, ctypes.pointer(info),
                              ctypes.pointer(count)) != KERN_SUCCESS:
            return None
        return info


def parse_sysctl_int(text: str | None) -> int | None:
    """The integer ``sysctl -n NAME`` printed, or None."""
    try:
        return int((text or "").split()[0])
    except (IndexError, ValueError):
        return None


def parse_vm_stat(text: str | None) -> tuple[int | None, dict[str, int]]:
    """(page size, {"Pages free": n, ...}) of ``vm_stat``'s output; (None, {}) for none."""
    page, pages = None, {}
    for line in (text or "").splitlines():
        if "page size of" in line:
            try:
                page = int(line.split("page size of")[1].split()[0])
            except (IndexError, ValueError):
                pass
            continue
        key, _, value = line.partition(":")
        value = value.strip().rstrip(".")
        if value.isdigit():
            pages[key.strip()] = int(value)
    return page, pages


def run_command(argv: list) -> str | None:
    """The default runner: the command's stdout, or None when it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


class DarwinHost:
    """macOS's answers for :mod:`.host`.

    Args:
        libc: A :class:`Libc`, or None for no ctypes access (commands only).
        runner: Runs ``sysctl``/``vm_stat`` when ``libc`` cannot answer.
        clock: Seconds, for the commands' reuse interval.
    """

    def __init__(self, libc: Libc | None = None, runner: Runner = run_command,
                 clock: Callable[[], float] = time.monotonic):
        self.libc, self.runner, self.clock = libc, runner, clock
        self._memsize: int | None = None
        self._page: int | None = None
        self._commands: dict[tuple, tuple[float, str | None]] = {}

    def _run(self, *argv: str) -> str | None:
        now = self.clock()
        hit = self._commands.get(argv)
        if hit is not None and now - hit[0] < COMMAND_TTL:
            return hit[1]
        out = self.runner(list(argv))
        self._commands[argv] = (now, out)
        return out

    def _sysctl(self, name: str) -> int | None:
        value = self.libc.sysctl(name) if self.libc is not None else None
        return value if value is not None else parse_sysctl_int(self._run("sysctl", "-n", name))

    def memsize(self) -> int | None:
        """``hw.memsize`` in bytes (read once)."""
        if self._memsize is None:
            self._memsize = self._sysctl("hw.memsize")
        return self._memsize

    def page_size(self) -> int:
        """``hw.pagesize`` (read once), else this process's page size."""
        if self._page is None:
            self._page = self._sysctl("hw.pagesize") or os.sysconf("SC_PAGE_SIZE")
        return self._page

    def available(self) -> int | None:
        """``(free + inactive) * page size`` in bytes, or None."""
        vm = self.libc.vm_statistics() if self.libc is not None else None
        if vm is not None:
            return (vm.free_count + vm.inactive_count) * self.page_size()
        page, pages = parse_vm_stat(self._run("vm_stat"))
        if "Pages free" not in pages or "Pages inactive" not in pages:
            return None
        return (pages["Pages free"] + pages["Pages inactive"]) * (page or self.page_size())

    def pressure_level(self) -> str | None:
        """``kern.memorystatus_vm_pressure_level`` as a level name, or None."""
        return PRESSURE_LEVELS.get(self._sysctl("kern.memorystatus_vm_pressure_level"))

    def process(self) -> tuple[int | None, int | None, int | None]:
        """(resident, anonymous resident, file-backed resident) bytes of this process
        (``task_info``, else ``proc_pid_rusage`` for the first)."""
        info = self.libc.task_vm_info() if self.libc is not None else None
        if info is not None:
            return info.resident_size, info.internal, info.external
        ru = self.libc.rusage() if self.libc is not None else None
        return (ru.ri_resident_size if ru is not None else None), None, None

    def bytes_read(self) -> int | None:
        """Bytes this process read from storage (``ri_diskio_bytesread``), or None."""
        ru = self.libc.rusage() if self.libc is not None else None
        return ru.ri_diskio_bytesread if ru is not None else None


def default_host() -> DarwinHost | None:
    """This machine's :class:`DarwinHost` on macOS (ctypes, commands as fallback), else None."""
    if sys.platform != "darwin":
        return None
    try:
        libc = Libc()
    except OSError:
        libc = None
    return DarwinHost(libc)
