"""The Python platform layer (pyloader/_util/host.py, darwin.py, procfs.py): every path runs
on this Linux machine.

* ``PYLOADER_NO_PROC=1`` makes Linux look like a machine without /proc, PSI or cgroups:
  the probes, the pre-flight, the pressure monitor, the bench workloads (load, generate,
  call) and ``pyloader compare`` then report None for what is unknown, never a KeyError;
* the macOS readers are fed canned ``sysctl``/``vm_stat`` output through an injected
  runner, and canned kernel structures through a fake libSystem;
* Metal's working-set limit clamps the headroom (a fake MLX module says "Metal GPU").

The tests at the end run only on macOS (the CI's macos-14 job): the real kernel calls.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest

import pyloader
from benchlib.workloads import DISTRIBUTED
from models import make_model_dir
from pyloader._util import darwin, host, memory, procfs
from pyloader._util.memory import MemorySnapshot, headroom_of, limiting_probe
from pyloader.cli import main as cli_main
from pyloader.residency.monitor import under_pressure

MiB = 1 << 20
GiB = 1 << 30
ON_DARWIN = sys.platform == "darwin"

VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12000.
Pages active:                            234567.
Pages inactive:                          200000.
Pages speculative:                         1234.
Pages throttled:                              0.
Pages wired down:                         98765.
Pages purgeable:                           4321.
"Translation faults":                 123456789.
Pages copy-on-write:                    1234567.
Pages zero filled:                     87654321.
Pages reactivated:                       123456.
Pages purged:                             12345.
File-backed pages:                       150000.
Anonymous pages:                         300000.
Pages stored in compressor:              400000.
Pages occupied by compressor:            100000.
Decompressions:                          500000.
Compressions:                            600000.
Pageins:                                 700000.
Pageouts:                                  8000.
Swapins:                                      0.
Swapouts:                                     0.
"""
SYSCTL = {"hw.memsize": "34359738368\n", "hw.pagesize": "16384\n",
          "kern.memorystatus_vm_pressure_level": "2\n"}


class Runner:
    """Canned ``sysctl -n NAME`` / ``vm_stat`` output; records every command run."""

    def __init__(self, sysctl=None, vm_stat=VM_STAT):
        self.sysctl = dict(SYSCTL if sysctl is None else sysctl)
        self.vm_stat = vm_stat
        self.calls: list[tuple] = []

    def __call__(self, argv):
        self.calls.append(tuple(argv))
        if argv[0] == "vm_stat":
            return self.vm_stat
        if argv[:2] == ["sysctl", "-n"]:
            return self.sysctl.get(argv[2])
        return None


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def no_proc(monkeypatch):
    """This process and its children see no /proc, PSI or cgroups."""
    monkeypatch.setenv(procfs.NO_PROC_ENV, "1")
    monkeypatch.delenv(memory.HEADROOM_ENV, raising=False)


@pytest.fixture
def fake_darwin(no_proc):
    """The platform layer answers through a DarwinHost fed canned command output."""
    runner, clock = Runner(), Clock()
    previous = host.set_darwin_host(darwin.DarwinHost(libc=None, runner=runner, clock=clock))
    yield SimpleNamespace(runner=runner, clock=clock)
    host.set_darwin_host(previous)


# ----------------------------------------------------------------------------
# The switch


def test_no_proc_hides_proc_and_sys(monkeypatch):
    assert procfs.read_text("/proc/self/status") is not None  # Linux: there
    assert procfs.io_counters() and procfs.status() and procfs.meminfo()
    monkeypatch.setenv(procfs.NO_PROC_ENV, "1")
    assert procfs.proc_disabled()
    for path in ("/proc/self/status", "/proc/meminfo", "/proc/pressure/memory",
                 "/proc/self/cgroup", "/sys/fs/cgroup/memory/memory.stat"):
        assert procfs.read_text(path) is None, path
    assert procfs.read_raw("/proc/self/io") is None
    assert procfs.status() == {} and procfs.io_counters() == {} and procfs.meminfo() == {}
    assert procfs.pressure("memory") == (None, None) and procfs.runnable_tasks() is None
    assert procfs.other_runnable(samples=2, interval=0) is None
    assert memory.cgroup_memory_path() == (None, None)
    assert procfs.thread_alive(threading.get_native_id()) is None
    assert procfs.reset_peak_rss() is False
    monkeypatch.setenv(procfs.NO_PROC_ENV, "0")
    assert not procfs.proc_disabled()
    assert procfs.thread_alive(threading.get_native_id()) is True


def test_process_memory_and_io_without_proc(no_proc, tmp_path):
    pm = host.process_memory()
    assert pm.source == "getrusage"
    assert pm.rss is None and pm.rss_anon is None and pm.rss_file is None
    assert pm.peak_rss == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > 0
    assert pm.as_status() == {"VmHWM": pm.peak_rss, "VmRSS": None, "RssAnon": None,
                              "RssFile": None}
    io0 = host.io_counters()
    assert io0.rchar is None and io0.read_bytes is not None and io0.read_bytes % 512 == 0
    # A file written and read back through the page cache: no storage read needed, and no
    # rchar to report.
    f = tmp_path / "x"
    f.write_bytes(b"x" * MiB)
    f.read_bytes()
    delta = host.io_counters().since(io0)
    assert delta["rchar"] is None and delta["read_bytes"] >= 0


def test_process_memory_and_io_with_proc():
    pm = host.process_memory()
    assert pm.source == "proc" and pm.rss and pm.rss_anon and pm.rss_file is not None
    io0 = host.io_counters()
    with open(__file__, "rb") as f:
        n = len(f.read())
    delta = host.io_counters().since(io0)
    assert delta["rchar"] >= n  # the read above, and not the counter file's own read
    assert delta["read_bytes"] is not None


def test_read_memory_without_proc_has_a_sensible_headroom(no_proc):
    s = memory.read_memory()
    assert s.cgroup_version is None and s.cgroup_limit is None
    assert s.psi_some_avg10 is None and s.pressure_level is None
    assert s.rss is None and s.peak_rss > 0
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert s.mem_total == total
    # sysconf's available pages (free RAM): positive, at most the machine.
    assert 0 < s.mem_available <= total and s.headroom == s.mem_available
    assert limiting_probe(s, page_cache="used") == "MemAvailable"


def test_preflight_without_proc_still_refuses_up_front(no_proc, monkeypatch, tmp_path):
    """No /proc: the pre-flight still reads a headroom and still refuses a load that
    cannot fit, before anything is read (PYLOADER_HEADROOM clamps sysconf's figure)."""
    path = make_model_dir(tmp_path / "m", "llama")
    monkeypatch.setenv(memory.HEADROOM_ENV, "64KB")
    with pytest.raises(MemoryError, match="nothing was loaded"):
        pyloader.load_model(path, tokenizer=False, options=pyloader.StreamOptions(strategy="pread"))
    monkeypatch.delenv(memory.HEADROOM_ENV)
    model, _ = pyloader.load_model(path, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="pread"))
    st = pyloader.stats(model)
    assert st["VmRSS"] is None and st["RssAnon"] is None and st["VmHWM"] > 0


# ----------------------------------------------------------------------------
# macOS's readers on canned output


def test_vm_stat_and_sysctl_parsers():
    page, pages = darwin.parse_vm_stat(VM_STAT)
    assert page == 16384
    assert pages["Pages free"] == 12000 and pages["Pages inactive"] == 200000
    assert pages["Pages occupied by compressor"] == 100000
    assert pages["File-backed pages"] == 150000
    assert darwin.parse_vm_stat("") == (None, {})
    assert darwin.parse_vm_stat(None) == (None, {})
    assert darwin.parse_sysctl_int("34359738368\n") == 34359738368
    assert darwin.parse_sysctl_int("") is None
    assert darwin.parse_sysctl_int("sysctl: unknown oid") is None


def test_darwin_host_from_commands_reads_memsize_once_and_reuses_vm_stat():
    runner, clock = Runner(), Clock()
    h = darwin.DarwinHost(libc=None, runner=runner, clock=clock)
    assert h.memsize() == 32 * GiB
    assert h.available() == (12000 + 200000) * 16384
    assert h.pressure_level() == "warning"
    for _ in range(50):  # a monitor reading every forward pass
        h.memsize()
        h.available()
    assert runner.calls.count(("sysctl", "-n", "hw.memsize")) == 1
    assert runner.calls.count(("vm_stat",)) == 1  # reused within COMMAND_TTL
    clock.t += darwin.COMMAND_TTL
    runner.vm_stat = VM_STAT.replace("Pages free:                               12000.",
                                     "Pages free:                               1000.")
    assert h.available() == (1000 + 200000) * 16384
    assert runner.calls.count(("vm_stat",)) == 2
    assert h.process() == (None, None, None) and h.bytes_read() is None


def test_darwin_host_when_commands_fail():
    h = darwin.DarwinHost(libc=None, runner=lambda argv: None)
    assert h.memsize() is None and h.available() is None and h.pressure_level() is None
    unknown = darwin.DarwinHost(libc=None, runner=Runner(
        sysctl={"kern.memorystatus_vm_pressure_level": "3"}))
    assert unknown.pressure_level() is None  # not a level the kernel defines


def test_platform_layer_through_canned_darwin(fake_darwin):
    s = memory.read_memory()
    assert s.mem_total == 32 * GiB and s.mem_available == (12000 + 200000) * 16384
    assert s.pressure_level == "warning" and s.psi_some_avg10 is None
    assert s.headroom == s.mem_available
    pm = host.process_memory()
    assert pm.source == "darwin" and pm.peak_rss > 0 and pm.rss is None
    assert host.io_counters().rchar is None
    assert under_pressure(s, psi_threshold=10.0)
    fake_darwin.runner.sysctl["kern.memorystatus_vm_pressure_level"] = "1\n"
    assert under_pressure(memory.read_memory(), psi_threshold=10.0)  # reused for 1 s
    fake_darwin.clock.t += darwin.COMMAND_TTL
    assert not under_pressure(memory.read_memory(), psi_threshold=10.0)


def test_kernel_structures_have_the_sizes_of_the_headers():
    # mach/vm_statistics.h, sys/resource.h, mach/task_info.h (TASK_VM_INFO_REV0_COUNT 36)
    assert ctypes.sizeof(darwin.VmStatistics64) == 152
    assert ctypes.sizeof(darwin.RusageInfoV2) == 160
    assert darwin.RusageInfoV2.ri_diskio_bytesread.offset == 144
    assert ctypes.sizeof(darwin.TaskVmInfo) == 36 * 4
    assert darwin.TaskVmInfo.internal.offset == 48 and darwin.TaskVmInfo.external.offset == 64


class FakeLib:
    """libSystem's calls as Python functions writing canned kernel structures."""

    def __init__(self):
        self.calls = []

    def sysctlbyname(self, name, valp, sizep, newp, newlen):
        self.calls.append(name)
        values = {b"hw.memsize": (64 * GiB, 8), b"hw.pagesize": (16384, 8),
                  b"kern.memorystatus_vm_pressure_level": (4, 4)}
        if name not in values:
            return -1
        value, size = values[name]
        valp.contents.value = value
        sizep.contents.value = size
        return 0

    def mach_host_self(self):
        return 3

    def host_statistics64(self, host_port, flavor, infop, countp):
        assert flavor == darwin.HOST_VM_INFO64 and countp.contents.value == 38
        infop.contents.free_count, infop.contents.inactive_count = 1000, 3000
        infop.contents.active_count = 99999
        return 0

    def proc_pid_rusage(self, pid, flavor, infop):
        assert pid == os.getpid() and flavor == darwin.RUSAGE_INFO_V2
        infop.contents.ri_resident_size = 500 * MiB
        infop.contents.ri_diskio_bytesread = 123 * MiB
        return 0

    def task_info(self, task, flavor, infop, countp):
        assert task == 7 and flavor == darwin.TASK_VM_INFO and countp.contents.value == 36
        infop.contents.resident_size = 400 * MiB
        infop.contents.internal = 300 * MiB
        infop.contents.external = 100 * MiB
        return 0


class FakeLibc(darwin.Libc):
    def task_self(self) -> int:
        return 7


def test_darwin_host_from_the_kernel_calls():
    lib = FakeLib()
    runner = Runner()
    h = darwin.DarwinHost(FakeLibc(lib), runner=runner)
    assert h.memsize() == 64 * GiB and h.pressure_level() == "critical"
    assert h.available() == (1000 + 3000) * 16384
    assert h.process() == (400 * MiB, 300 * MiB, 100 * MiB)
    assert h.bytes_read() == 123 * MiB
    h.memsize()
    assert lib.calls.count(b"hw.memsize") == 1 and runner.calls == []  # no command run

    class NoTask(FakeLib):
        def task_info(self, *args):
            return 5  # KERN_FAILURE

    assert darwin.DarwinHost(FakeLibc(NoTask())).process() == (500 * MiB, None, None)


# ----------------------------------------------------------------------------
# Metal's working set


class FakeMetalMx:
    """What MLX says on a Mac: the default device is the GPU, Metal is available."""

    gpu, cpu = "gpu", "cpu"

    def __init__(self, working_set: int, active: int):
        self.working_set, self.active = working_set, active
        self.metal = SimpleNamespace(is_available=lambda: True)
        self.asked = 0

    def default_device(self):
        return SimpleNamespace(type=self.gpu)

    def device_info(self, device):
        self.asked += 1
        return {"max_recommended_working_set_size": self.working_set}

    def get_active_memory(self):
        return self.active

    def get_peak_memory(self):
        return self.active

    def get_cache_memory(self):
        return 0


def test_metal_working_set_clamps_the_headroom(monkeypatch):
    monkeypatch.setattr(memory, "_WORKING_SET", {})
    fake = FakeMetalMx(working_set=10 * GiB, active=7 * GiB)
    monkeypatch.setitem(sys.modules, "mlx.core", fake)
    s = memory.read_memory()
    monkeypatch.setitem(sys.modules, "mlx.core", mx)
    assert s.device_limit == 10 * GiB and s.device_headroom == 3 * GiB
    if s.mem_available > 3 * GiB:  # 24 GiB machine: the GPU's limit is the smaller
        assert s.headroom == 3 * GiB
        assert "max_recommended_working_set_size" in limiting_probe(s, page_cache="used")
    assert memory.metal_working_set(fake) == 10 * GiB and fake.asked == 1  # read once
    snap = MemorySnapshot(time=0.0, mem_available=20 * GiB, device_limit=8 * GiB,
                          mlx_active=GiB)
    assert headroom_of(snap, page_cache="reclaimable") == 7 * GiB
    # MLX's CPU backend (this machine): no limit from the device.
    assert memory.metal_working_set(mx) is None
    assert memory.read_memory().device_limit is None


# ----------------------------------------------------------------------------
# The pressure monitor


def test_pressure_monitor_counts_the_kernel_level_where_psi_is_missing():
    calm = MemorySnapshot(time=0.0, mem_available=GiB, pressure_level="normal")
    warn = MemorySnapshot(time=0.0, mem_available=GiB, pressure_level="warning")
    psi = MemorySnapshot(time=0.0, mem_available=GiB, psi_some_avg10=5.0,
                         pressure_level="critical")
    assert not under_pressure(calm, 10.0) and under_pressure(warn, 10.0)
    assert not under_pressure(psi, 10.0)  # PSI, where known, decides
    assert not under_pressure(MemorySnapshot(time=0.0), 10.0)


def test_pressure_monitor_runs_without_proc(no_proc, tmp_path):
    from pyloader.residency import PressureMonitor, PressureSettings

    path = make_model_dir(tmp_path / "m", "llama", num_hidden_layers=4)
    model, _ = pyloader.load_model(path, tokenizer=False)
    mon = PressureMonitor(model, PressureSettings(low_water=1, high_water=2, window=2,
                                                  every=1)).attach()
    for _ in range(3):
        mx.eval(model(mx.array([[1, 2, 3]])))
    assert mon.calls == 3 and len(mon.samples) == 2 and all(h > 0 for h in mon.samples)
    assert mon.events == []  # plenty of headroom: nothing shed


# ----------------------------------------------------------------------------
# The measuring children and `pyloader compare` without /proc


def read_back(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def test_isolated_call_without_proc(no_proc, isolated, aligned_file):
    r = isolated(read_back, str(aligned_file))
    assert r.value == aligned_file.stat().st_size
    assert r.peak_rss > 0 and r.anon is None and r.rchar is None
    assert r.bytes_read is not None and r.bytes_read >= 0
    assert r.ready["rss"] is None and r.ready["peak_rss_reset"] is False


def test_compare_load_only_without_proc(no_proc, aligned_file, tmp_path, capsys):
    out = tmp_path / "load"
    assert cli_main(["compare", str(aligned_file), "--load-only", "--strategies", "mlx,mmap",
                     "--warm", "--runs", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    report = json.loads((out / "results.json").read_text())
    assert {r["strategy"] for r in report["runs"]} == {"mlx", "mmap"}
    for r in report["runs"]:
        assert "error" not in r, r
        assert r["peak_rss"] > 0 and r["mx_peak"] >= 0
        assert r["rss_anon"] is None and r["anon_delta"] is None and r["rss"] is None
    assert "t_dict s" in printed.out


def test_compare_generation_without_proc(no_proc, tmp_path, capsys):
    path = make_model_dir(tmp_path / "m", "llama")
    out = tmp_path / "cmp"
    code = cli_main(["compare", str(path), "--strategies", "mlx-lm,mmap,stream",
                     "--resident", "0", "--runs", "1", "--max-tokens", "4",
                     "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    report = json.loads((out / "results.json").read_text())
    assert all("error" not in r for r in report["runs"])
    assert len(report["runs"]) >= 3 and all(r["identical"] for r in report["runs"])
    for r in report["runs"]:
        assert r["peak_rss"] > 0 and r["mx_peak"] > 0
        assert r["rss_anon"] is None and r["peak_anon"] is None and r["rchar"] is None
        assert r["read_bytes"] is not None  # getrusage's ru_inblock
    assert (out / "memory.png").stat().st_size > 0


def test_distributed_workload_without_proc(no_proc, tmp_path):
    """The distributed workload in one process (no ranks): its memory and read counters
    are None where unknown, and it still loads, streams and generates."""
    path = make_model_dir(tmp_path / "m", "llama")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pyloader.compare.child", DISTRIBUTED, "--no-wait",
         "--result-file", str(out), str(path), "--strategy", "pread", "--resident", "0.5",
         "--prefetch", "1", "--tokens", "4"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert len(r["tokens"]) == 4
    assert r["load_io"]["rchar"] is None and r["load_io"]["read_bytes"] is not None
    assert r["memory"]["VmRSS"] is None and r["memory"]["VmHWM"] > 0
    assert r["stats"]["VmRSS"] is None and r["stats"]["VmHWM"] > 0


def test_proc_checks_skip_with_a_reason_where_proc_is_missing():
    from proc_files import proc_reason, require_proc

    assert proc_reason("/proc/self/status", "/proc/self/maps") is None  # here: present
    reason = proc_reason("/proc/self/status", "/proc/self/no-such-file")
    assert "/proc/self/no-such-file" in reason and "/proc/self/status" not in reason
    with pytest.raises(pytest.skip.Exception, match="no-such-file"):
        require_proc("/proc/self/no-such-file")


def test_server_thread_wait_without_proc(no_proc):
    from pyloader.serving import server

    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    t0 = time.monotonic()
    server._wait_for_thread_exit(t.native_id, grace_s=0.05)
    assert 0.05 <= time.monotonic() - t0 < 5  # a fixed grace: /proc/self/task is hidden


# ----------------------------------------------------------------------------
# The real kernel calls (macOS only: the CI's macos-14 job)

darwin_only = pytest.mark.skipif(not ON_DARWIN, reason="macOS's kernel calls: run by the "
                                 "macos-14 CI job (.github/workflows/ci.yml)")


@darwin_only
def test_darwin_readers_on_this_mac():
    h = darwin.default_host()
    assert h.libc is not None
    total = h.memsize()
    assert total and total >= 4 * GiB
    assert 0 < h.available() < total
    assert h.page_size() in (4096, 16384)
    assert h.pressure_level() in ("normal", "warning", "critical")
    rss, anon, file = h.process()
    assert rss > 10 * MiB and anon > 0 and file is not None
    block = bytearray(256 * MiB)  # anonymous memory this process touches
    block[::4096] = b"x" * (len(block) // 4096)
    assert h.process()[1] - anon > 200 * MiB
    del block
    assert h.bytes_read() is not None
    s = memory.read_memory()
    assert s.mem_available and s.pressure_level and s.rss and s.headroom
    if mx.metal.is_available() and mx.default_device() == mx.gpu:
        assert s.device_limit and s.device_limit <= total
