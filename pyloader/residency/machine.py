"""Machine probes: load conditions, settled timings, :func:`calibrate_machine`."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from .._util.fs import cache_dir
from .._util.procfs import loadavg, other_runnable, pressure
from ..io.checkpoint import Checkpoint
from ..io.pagecache import evict
from ..io.readers import MmapReader, PreadReader
from ..kernels import install as install_kernels
from .budget import ModelBudget
from .calibration_cache import CONTENDED_LIFETIME_S, load_calibration, save_calibration
from .cost import Calibration, fit_stream_bandwidth
from .formats import MAX_UNIT_MIB, ComputeFormat

__all__ = ["BUSY_LOAD_PER_CPU", "BUSY_PSI", "BUSY_RUNNABLE_PER_CPU", "CONTENDED_LIFETIME_S",
           "MAX_BATCHES", "PROBE_BYTES", "STABLE", "calibrate_machine", "conditions",
           "contention", "default_format", "judge", "load_calibration", "machine_key",
           "timed"]


def machine_key(fmt: ComputeFormat, device_of: Path) -> str:
    return f"machine-v2-{platform.node()}-{os.stat(device_of).st_dev}-{fmt.key}".replace("/", "_")


#: Contention thresholds: other runnable tasks per CPU, PSI, and load average.
BUSY_RUNNABLE_PER_CPU = 0.25
BUSY_LOAD_PER_CPU = 0.5
BUSY_PSI = 10.0
#: Batches until two consecutive medians agree within STABLE, at most MAX_BATCHES.
STABLE = 0.05
MAX_BATCHES = 6


def conditions() -> dict:
    """The machine's load now: runnable tasks, load average, CPU count, CPU/IO pressure."""
    la = loadavg()
    return {"runnable_other": other_runnable(), "loadavg1": la[0] if la else None,
            "cpus": os.cpu_count(), "psi_cpu_some": pressure("cpu")[0],
            "psi_io_some": pressure("io")[0]}


def contention(c: dict) -> str | None:
    """Why conditions ``c`` are too busy to calibrate in, or None."""
    why = []
    cpus = c.get("cpus")
    if c.get("runnable_other") is not None and cpus:
        if c["runnable_other"] > BUSY_RUNNABLE_PER_CPU * cpus:
            why.append(f"{c['runnable_other']:.1f} other tasks running on {cpus} CPUs")
    elif c.get("loadavg1") is not None and cpus and c["loadavg1"] > BUSY_LOAD_PER_CPU * cpus:
        why.append(f"load average {c['loadavg1']:.2f} on {cpus} CPUs")
    for key, name in (("psi_cpu_some", "CPU"), ("psi_io_some", "I/O")):
        if c.get(key) is not None and c[key] > BUSY_PSI:
            why.append(f"{name} pressure {c[key]:.0f}%")
    return "; ".join(why) or None


def timed(fn) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_time(fn, repeats: int) -> float:
    return statistics.median(timed(fn) for _ in range(repeats))


def _stable_time(fn, repeats: int) -> tuple[float, bool]:
    """Median seconds of ``fn`` in batches until two agree within STABLE: (seconds, stable)."""
    meds = []
    for _ in range(MAX_BATCHES):
        meds.append(_median_time(fn, repeats))
        if len(meds) >= 2 and abs(meds[-1] - meds[-2]) <= STABLE * min(meds[-2:]):
            return statistics.mean(meds[-2:]), True
    return statistics.median(meds), False


def judge(cal: Calibration, before: dict, stable: bool) -> Calibration:
    """Record the conditions around a measurement; mark it contended if busy or unstable."""
    after = conditions()
    cal.detail["conditions"] = {"before": before, "after": after, "stable": stable}
    why = (contention(before) or contention(after)
           or ("the timings did not settle" if not stable else None))
    if why:
        cal.detail["contended"] = why
    return cal


def _unit_ranges(ckpt, unit: int, tensors: int, count: int) -> list[list[tuple[int, int]]]:
    """``count`` units of ``unit`` bytes in ``tensors`` ranges each, back to back."""
    start = ckpt["t0"].offset
    count = max(2, min(count, sum(ckpt[f"t{i}"].nbytes for i in range(8)) // unit))
    piece = max(1, unit // max(1, tensors))
    return [[(start + k * unit + j * piece, piece) for j in range(unit // piece)]
            for k in range(count)]


def _advise_each(reader: MmapReader, ranges, *hints: str) -> None:
    f = reader.checkpoint.files[0]
    for hint in hints:
        for off, n in ranges:
            reader.advise_range(f, off, n, hint)


def _measure_units(ckpt, unit: int, tensors: int = 1, count: int = 16
                   ) -> tuple[float, float]:
    """Emulated streamed units on the probe file: (cold read bytes/s, drop seconds/byte)."""
    reader = MmapReader(ckpt)
    units = _unit_ranges(ckpt, unit, tensors, count)
    rates, drops = [], []
    os.sync()  # writeback of freshly written files would compete with the cold reads
    try:
        evict(ckpt.files)
        for ranges in units:  # the first read of the stream (not timed)
            _advise_each(reader, ranges, "populate", "dontneed")
        evict(ckpt.files)
        for ranges in units:
            t0 = time.perf_counter()
            _advise_each(reader, ranges, "populate")
            rates.append(unit / (time.perf_counter() - t0))
            _advise_each(reader, ranges, "dontneed")
        for ranges in units:  # cached now: populate them, then time their eviction
            _advise_each(reader, ranges, "populate", "dontneed")
        for ranges in units:
            t0 = time.perf_counter()
            _advise_each(reader, ranges, "evict")
            drops.append((time.perf_counter() - t0) / unit)
    finally:
        reader.close()
    return statistics.median(rates), statistics.median(drops)


def _emulate_stream(ckpt, unit: int, tensors: int, computes: list, count: int = 16
                    ) -> tuple[float, float, int]:
    """The mmap streaming pipeline emulated on the probe file: (cold s, warm s, units)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    reader = MmapReader(ckpt)
    units = _unit_ranges(ckpt, unit, tensors, count)
    reads = ThreadPoolExecutor(1, thread_name_prefix="pyloader-probe")
    drops = ThreadPoolExecutor(1, thread_name_prefix="pyloader-probe-drop")

    def populate(ranges, after: Future | None) -> None:
        if after is not None:
            after.result()  # the releases queued before this request
        _advise_each(reader, ranges, "populate")

    def release(ranges, cold: bool) -> None:
        _advise_each(reader, ranges, "dontneed", *(("evict",) if cold else ()))

    def passes(n: int, cold: bool) -> float:
        order = units * n
        dropped: Future | None = None
        fut = reads.submit(populate, order[0], dropped)
        t0 = 0.0
        for j, ranges in enumerate(order):
            if j == len(order) - len(units):
                t0 = time.perf_counter()
            fut.result()
            if j + 1 < len(order):
                fut = reads.submit(populate, order[j + 1], dropped)
            computes[j % len(computes)]()
            dropped = drops.submit(release, ranges, cold)
        t1 = time.perf_counter()  # the pass ends with its compute; its releases trail
        dropped.result()
        return t1 - t0

    os.sync()
    try:
        evict(ckpt.files)
        t_cold = passes(2, cold=True)
        return t_cold, passes(2, cold=False), len(units)
    finally:
        reads.shutdown()
        drops.shutdown()
        evict(ckpt.files)
        reader.close()


def default_format(kernels: str | None = None) -> ComputeFormat:
    """The format without a model: a bf16 4096x4096 matrix in 32 MiB units."""
    return ComputeFormat("bfloat16", "bfloat16", kernels=kernels)


#: Weight bytes multiplied per probe step: large enough to stream from memory.
PROBE_BYTES = 32 << 20


class _Probe(nn.Module):
    """The probe's linear layers, where :func:`pyloader.kernels.install` finds them."""

    def __init__(self, layers: list):
        super().__init__()
        self.layers = layers


def _probe_matrices(fmt: ComputeFormat):
    """Copies of ``fmt.shapes`` as linear layers: (layers, widths, bytes each, report)."""
    wdt = getattr(mx, fmt.weights)
    mats, widths, sizes = [], [], []
    while sum(sizes) < PROBE_BYTES:
        for out, inp in fmt.shapes:
            layer = nn.Linear(inp, out, bias=False)
            layer.weight = (mx.random.normal((out, inp)) * 0.02).astype(wdt)
            if fmt.quantized:
                kw = {} if fmt.mode == "affine" else {"mode": fmt.mode}
                layer = nn.QuantizedLinear.from_linear(layer, group_size=fmt.group_size,
                                                       bits=fmt.bits, **kw)
            mx.eval(layer.parameters())
            sizes.append(sum(a.nbytes for _, a in tree_flatten(layer.parameters())))
            mats.append(layer)
            widths.append(inp)
    return mats, widths, sizes, install_kernels(_Probe(mats), fmt.kernels)


def _probe_budget(unit: int, units: int) -> ModelBudget:
    """A model of ``units`` equal layers of ``unit`` bytes, for the cost model."""
    return ModelBudget(source="config", name="probe", model_type="probe",
                       weights_dtype="probe", quantization=None, kv_bits=None,
                       kv_dtype="float16", nonlayer_bytes=0, layer_bytes=[unit] * units,
                       caches=[], hidden_size=0, intermediate_size=0, vocab_size=0,
                       num_heads=0, max_position_embeddings=None,
                       compute_bytes=unit * units)


def _measure_direct(ckpt) -> float | None:
    """Median direct-I/O cold read bytes/s; None without direct reads."""
    reader = PreadReader(ckpt, readahead=False)
    names = [f"t{i}" for i in range(4)]
    reader.reserve_buffers(1, max(reader.layout_bytes([n]) for n in names), direct=True)
    if not reader.direct:
        return None
    rates = []
    for n in names:
        evict(ckpt.files)
        t0 = time.perf_counter()
        arrays = reader.load([n], reuse=True)
        rates.append(ckpt[n].nbytes / (time.perf_counter() - t0))
        del arrays  # the buffer goes back for the next one
    return statistics.median(rates)


def calibrate_machine(fmt: ComputeFormat | None = None, *, force: bool = False,
                      prefill_tokens: int = 8) -> Calibration:
    """Measures the cost model without a checkpoint, in ``fmt``; cached unless contended."""
    fmt = fmt or default_format()
    root = cache_dir("calibration")
    key = machine_key(fmt, root)
    if not force and (cached := load_calibration(key)) is not None:
        return cached
    before = conditions()
    probe = root / "disk-probe.safetensors"
    size = 4 * (MAX_UNIT_MIB << 20)  # four units of the largest size
    if not probe.exists() or probe.stat().st_size < size:
        header = json.dumps({f"t{i}": {"dtype": "U8", "shape": [size // 8],
                                       "data_offsets": [i * size // 8, (i + 1) * size // 8]}
                             for i in range(8)}).encode()
        header += b" " * (-(8 + len(header)) % 8)
        tmp = probe.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for _ in range(size // (16 << 20)):
                f.write(os.urandom(16 << 20))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, probe)
    bw, drop = _measure_units(Checkpoint(probe), fmt.unit_bytes, fmt.unit_tensors)
    direct_bw = _measure_direct(Checkpoint(probe))

    mats, widths, mat_bytes, kernel_report = _probe_matrices(fmt)
    nbytes = sum(mat_bytes)
    adt = getattr(mx, fmt.activation)
    x1 = [mx.random.normal((1, n)).astype(adt) for n in widths]
    xp = [mx.random.normal((prefill_tokens, n)).astype(adt) for n in widths]
    mx.eval(x1, xp)

    def step(xs):
        return lambda: mx.eval([mm(x) for mm, x in zip(mats, xs)])

    step(x1)()
    step(xp)()
    t1, stable1 = _stable_time(step(x1), 5)
    tp, stablep = _stable_time(step(xp), 3)
    small = mx.ones((64,))
    sync = _median_time(lambda: mx.eval(small + 1), 51)

    # Each unit's compute is a group of products of about a unit's bytes.
    groups, group, gbytes, group_bytes = [], [], 0, []
    for mm, x, nb in zip(mats, x1, mat_bytes):
        group.append((mm, x))
        gbytes += nb
        if gbytes >= fmt.unit_bytes:
            groups.append(group)
            group_bytes.append(gbytes)
            group, gbytes = [], 0
    if not groups:  # a unit larger than the probe's weights: all of them, repeated
        reps = max(1, round(fmt.unit_bytes / gbytes))
        groups, group_bytes = [group * reps], [gbytes * reps]
    computes = [lambda g=g: mx.eval([mm(x) for mm, x in g]) for g in groups]
    t_cold, t_warm, n_units = _emulate_stream(Checkpoint(probe), fmt.unit_bytes,
                                              fmt.unit_tensors, computes)
    # Products timed again after the disk work; contention only slows, so keep the faster.
    t1b, stable1b = _stable_time(step(x1), 5)
    if t1b < t1:
        t1, stable1 = t1b, stable1b
    # ``o``: what the warm pass took beyond its products' compute.
    per_unit = statistics.mean(group_bytes[j % len(groups)] for j in range(n_units))
    o = max(sync, t_warm / n_units - per_unit * t1 / nbytes)
    # Compute taken from the warm pass, so the fit sees only what the disk adds.
    k_stream = max(0.0, t_warm / n_units - o) / fmt.unit_bytes
    stream_bw = fit_stream_bandwidth(_probe_budget(fmt.unit_bytes, n_units), k_stream, o,
                                     drop, bw, t_cold, 1)
    cal = Calibration(
        disk_bytes_per_s=bw, decode_s_per_byte=t1 / nbytes, release_s_per_byte=drop,
        prefill_s_per_byte_token=tp / (nbytes * prefill_tokens), unit_overhead_s=o,
        stream_bytes_per_s=stream_bw, direct_bytes_per_s=direct_bw,
        prefill_tokens=prefill_tokens, source="machine", key=key,
        detail={"format": fmt.to_dict(), "probe_bytes": nbytes, "probe_file": str(probe),
                "t_stream_pass_s": t_cold, "t_stream_warm_pass_s": t_warm,
                "stream_units": n_units, "sync_s": sync,
                "kernel_report": kernel_report.summary()})
    return save_calibration(judge(cal, before, stable1 and stablep))
