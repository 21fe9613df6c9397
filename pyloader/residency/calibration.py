"""Calibration: the measured constants of the cost model (:mod:`.cost`), cached on disk.

* :func:`calibrate_model` / :func:`calibrate_loaded`: on a checkpoint (every layer
  resident, then streamed from a warm and a cold page cache);
* :func:`calibrate_machine`: without a checkpoint, from a probe file and matrix products
  of the model's own format (:class:`.formats.ComputeFormat`: activation dtype,
  quantization, a few of its shapes, and the kernels that compute them);
* :func:`calibrate` / :func:`cached_calibration`: the checkpoint's own when it has
  weights, else the machine's. Cached under the pyloader cache directory
  (``calibration/``).

The load around a calibration (other runnable tasks, the 1-minute load average, CPU and
I/O pressure) is read before and after, timings are repeated until two batches agree, and
the conditions go into the entry (``detail["conditions"]``, shown by
:meth:`Calibration.describe`). A contended or unstable result is marked
(``detail["contended"]``) and cached for :data:`CONTENDED_LIFETIME_S` only (a settled
one never expires), so a busy machine is not re-measured on every plan: within the hour
the plan reuses it and says so; after it, the next plan measures again. A contended
result never replaces a settled one in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from .._util.fs import cache_dir, write_atomic
from .._util.procfs import loadavg, other_runnable, pressure
from ..io.checkpoint import Checkpoint
from ..io.pagecache import evict, warm
from ..io.readers import MmapReader, PreadReader
from ..kernels import effective_choice
from ..kernels import install as install_kernels
from ..kernels import installed as installed_kernels
from ..loading import load_model
from ..streaming import StreamOptions, controller_of
from .budget import ModelBudget, model_budget
from .cost import Calibration, fit_stream_bandwidth
from .formats import MAX_UNIT_MIB, ComputeFormat, compute_format


def _calibration_file(key: str) -> Path:
    return cache_dir("calibration") / f"{key}.json"


def _model_key(path: Path, strategy: str, kernels: str) -> str:
    ckpt = Checkpoint(path)
    h = hashlib.sha256()
    for f in ckpt.files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(strategy.encode())
    h.update(f"kernels={kernels}".encode())
    return "model-" + h.hexdigest()[:16]


def _machine_key(fmt: ComputeFormat, device_of: Path) -> str:
    dev = os.stat(device_of).st_dev
    # v2: with the direct-read bandwidth pread streaming uses (direct_bytes_per_s).
    return f"machine-v2-{platform.node()}-{dev}-{fmt.key}".replace("/", "_")


#: Around a calibration, other tasks running or ready to run (sampled over a second)
#: above this share of the CPUs, or CPU or I/O pressure (PSI ``some`` avg10, percent)
#: above BUSY_PSI, means other work competes. Where the runnable count is unknown, the
#: 1-minute load average above BUSY_LOAD_PER_CPU of the CPUs does (it also holds the
#: last minute of this process's own work, so it is not the test where a better exists).
BUSY_RUNNABLE_PER_CPU = 0.25
BUSY_LOAD_PER_CPU = 0.5
BUSY_PSI = 10.0
#: Timings are taken in batches until two consecutive batch medians agree within STABLE
#: (relative), at most MAX_BATCHES batches.
STABLE = 0.05
MAX_BATCHES = 6


def conditions() -> dict:
    """The machine's load now: other runnable tasks (mean over a second), 1-minute load
    average, CPU count, CPU and I/O pressure."""
    la = loadavg()
    return {"runnable_other": other_runnable(), "loadavg1": la[0] if la else None,
            "cpus": os.cpu_count(), "psi_cpu_some": pressure("cpu")[0],
            "psi_io_some": pressure("io")[0]}


def contention(c: dict) -> Optional[str]:
    """Why the conditions ``c`` (from :func:`conditions`) are too busy to calibrate in,
    or None."""
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


def _stable_time(fn, repeats: int) -> tuple[float, bool]:
    """Median seconds of ``fn`` over batches of ``repeats`` runs, taken until two
    consecutive batch medians agree within :data:`STABLE`: (seconds, stable)."""
    meds = []
    for _ in range(MAX_BATCHES):
        meds.append(_median_time(fn, repeats))
        if len(meds) >= 2 and abs(meds[-1] - meds[-2]) <= STABLE * min(meds[-2:]):
            return statistics.mean(meds[-2:]), True
    return statistics.median(meds), False


def _judge(cal: Calibration, before: dict, stable: bool) -> Calibration:
    """Record the conditions around a measurement; mark it contended when the machine
    was busy or the timings did not settle."""
    after = conditions()
    cal.detail["conditions"] = {"before": before, "after": after, "stable": stable}
    why = (contention(before) or contention(after)
           or ("the timings did not settle" if not stable else None))
    if why:
        cal.detail["contended"] = why
    return cal


#: How long a calibration measured under contention is reused (seconds).
CONTENDED_LIFETIME_S = 3600.0


def load_calibration(key: str, *, expired: bool = False) -> Optional[Calibration]:
    """The calibration cached under ``key``, or None when there is none, it is unreadable,
    or it was measured under contention more than :data:`CONTENDED_LIFETIME_S` ago
    (``expired=True`` returns that one too)."""
    f = _calibration_file(key)
    if not f.exists():
        return None
    try:
        cal = Calibration.from_dict(json.loads(f.read_text()))
    except (ValueError, TypeError, KeyError):
        return None
    if not expired and cal.detail.get("contended") and \
            time.time() - cal.measured_at > CONTENDED_LIFETIME_S:
        return None
    return cal


def _save(cal: Calibration) -> Calibration:
    """Cache ``cal`` (a contended one with :data:`CONTENDED_LIFETIME_S` to live, and never
    over a settled one)."""
    if cal.detail.get("contended"):
        cal.detail["expires_at"] = cal.measured_at + CONTENDED_LIFETIME_S
        old = load_calibration(cal.key, expired=True)
        if old is not None and not old.detail.get("contended"):
            return cal
    write_atomic(_calibration_file(cal.key), json.dumps(cal.to_dict(), indent=1))
    return cal


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_reads(ckpt, groups: list[list[str]],
                   evict_files: bool = True) -> tuple[float, float]:
    """Cold reads through the streaming reader's own path (exact-range populate):
    (bytes per second, seconds per byte of dropping them from the page cache again)."""
    reader = MmapReader(ckpt)
    rates, drops = [], []
    try:
        for names in groups:
            if evict_files:
                evict(ckpt.files)
            for n in names:
                reader.advise(n, "evict")
            nbytes = sum(ckpt[n].nbytes for n in names)
            t0 = time.perf_counter()
            reader.wait(reader.prefetch(names, "populate"))
            rates.append(nbytes / (time.perf_counter() - t0))
            for n in names:
                reader.advise(n, "dontneed")
            t0 = time.perf_counter()
            for n in names:
                reader.advise(n, "evict")
            drops.append((time.perf_counter() - t0) / nbytes)
    finally:
        reader.close()
    return statistics.median(rates), statistics.median(drops)


def _unit_ranges(ckpt, unit: int, tensors: int, count: int) -> list[list[tuple[int, int]]]:
    """``count`` units of ``unit`` bytes in ``tensors`` ranges each, back to back on the
    probe file (as a layer's tensors lie in an aligned checkpoint)."""
    start = ckpt["t0"].offset
    span = sum(ckpt[f"t{i}"].nbytes for i in range(8))
    count = max(2, min(count, span // unit))
    piece = max(1, unit // max(1, tensors))
    return [[(start + k * unit + j * piece, piece) for j in range(unit // piece)]
            for k in range(count)]


def _advise_each(reader: MmapReader, ranges, hint: str) -> None:
    f = reader.checkpoint.files[0]
    for off, n in ranges:
        reader.advise_range(f, off, n, hint)


def _measure_units(ckpt, unit: int, tensors: int = 1, count: int = 16
                   ) -> tuple[float, float]:
    """Streamed units of ``unit`` bytes in ``tensors`` ranges each, emulated on the probe
    file through the reader's exact-range hints (as the streaming reader populates and
    releases a layer tensor by tensor), alone: (cold read bytes per second, seconds per
    byte of a page-cache drop). Dirty pages are flushed first (``os.sync``).
    The units are read cold twice and the second pass is timed: a stream reads the same
    bytes again every token, and a virtual machine's host serves a repeated read from its
    own cache (here 0.35–0.57 GB/s for the first read of a file after a while, 0.8–1.7
    GB/s for the next one, both evicted from this machine's page cache first)."""
    reader = MmapReader(ckpt)
    units = _unit_ranges(ckpt, unit, tensors, count)
    rates, drops = [], []
    os.sync()  # writeback of freshly written files would compete with the cold reads
    try:
        evict(ckpt.files)
        for ranges in units:  # the first read of the stream (not timed)
            _advise_each(reader, ranges, "populate")
            _advise_each(reader, ranges, "dontneed")
        evict(ckpt.files)
        for ranges in units:
            t0 = time.perf_counter()
            _advise_each(reader, ranges, "populate")
            rates.append(unit / (time.perf_counter() - t0))
            _advise_each(reader, ranges, "dontneed")
        for ranges in units:  # cached now: populate them, then time their eviction
            _advise_each(reader, ranges, "populate")
            _advise_each(reader, ranges, "dontneed")
        for ranges in units:
            t0 = time.perf_counter()
            _advise_each(reader, ranges, "evict")
            drops.append((time.perf_counter() - t0) / unit)
    finally:
        reader.close()
    return statistics.median(rates), statistics.median(drops)


def _emulate_stream(ckpt, unit: int, tensors: int, computes: list, count: int = 16
                    ) -> tuple[float, float, int]:
    """The mmap streaming pipeline, emulated on the probe file with the reader's own
    exact-range calls: unit ``j+1`` is populated on a reader thread while unit ``j``'s
    compute (``computes[j % len]``, which evaluates) runs; then unit ``j`` is released
    (and evicted, when cold) on a drop thread of its own, and a populate queued after a
    release starts only once that release has run (as :meth:`MmapReader.drop` orders
    them). Passes over the units: cold (not timed), cold (timed: steady state, every read
    overlapping a compute), warm (not timed: fills the page cache), warm (timed: the same
    loop without the disk). Returns (cold seconds, warm seconds, units)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    reader = MmapReader(ckpt)
    units = _unit_ranges(ckpt, unit, tensors, count)
    reads = ThreadPoolExecutor(1, thread_name_prefix="pyloader-probe")
    drops = ThreadPoolExecutor(1, thread_name_prefix="pyloader-probe-drop")

    def populate(ranges, after: Optional[Future]) -> None:
        if after is not None:
            after.result()  # the releases queued before this request
        _advise_each(reader, ranges, "populate")

    def release(ranges, cold: bool) -> None:
        _advise_each(reader, ranges, "dontneed")
        if cold:
            _advise_each(reader, ranges, "evict")

    def passes(n: int, cold: bool) -> float:
        order = units * n
        dropped: Optional[Future] = None
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
        t_warm = passes(2, cold=False)
        return t_cold, t_warm, len(units)
    finally:
        reads.shutdown()
        drops.shutdown()
        evict(ckpt.files)
        reader.close()


def decode_steps(model, prompt: list[int], n: int) -> tuple[float, list[float], list[int]]:
    """Greedy decoding of ``n`` tokens after ``prompt`` with mlx-lm's ``generate_step``:
    (prefill seconds incl. first token, per-step decode seconds, tokens)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n + 1)
    t0 = time.perf_counter()
    tokens = [int(next(steps)[0])]
    t_first = time.perf_counter() - t0
    times = []
    t = time.perf_counter()
    for tok, _ in steps:
        tokens.append(int(tok))
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return t_first, times, tokens


def prefill_time(model, prompt: list[int], repeats: int = 3) -> float:
    """Median seconds of one forward pass over ``prompt`` with a fresh cache (after a
    warm-up pass)."""
    from mlx_lm.models.cache import make_prompt_cache

    def once():
        cache = make_prompt_cache(model)
        out = model(mx.array([prompt]), cache=cache)
        mx.eval(out, [c.state for c in cache])

    once()  # warm-up
    return _median_time(once, repeats)


def calibrate_model(path, *, strategy: str = "mmap", tokens: int = 5,
                    prefill_tokens: int = 16, force: bool = False,
                    kernels: Optional[str] = None) -> Calibration:
    """Measures the cost model on a checkpoint, in this process (cached on disk):
    loads it with every layer resident, its products computed by ``kernels`` (as
    :func:`pyloader.load_model` takes it; None: what a load now would use), and runs
    :func:`calibrate_loaded`."""
    path = Path(path)
    kernels = effective_choice(kernels)
    key = _model_key(path, strategy, kernels)
    if not force and (cached := load_calibration(key)) is not None:
        return cached
    before = conditions()
    model, _ = load_model(path, resident=1.0, tokenizer=False, kernels=kernels,
                          options=StreamOptions(strategy=strategy))
    cal = calibrate_loaded(model, path, tokens=tokens, prefill_tokens=prefill_tokens, key=key)
    del model
    mx.clear_cache()
    return _save(_judge(cal, before, stable=True))


def calibrate_loaded(model, path, *, tokens: int = 5, prefill_tokens: int = 16,
                     key: Optional[str] = None) -> Calibration:
    """Measures the cost model on a model from :func:`pyloader.load_model` (its resident
    set is changed during the measurement and restored after; nothing is cached).

    * ``k``: median decode step with every layer resident, over the model's compute
      bytes (layers + output projection); prefill: a timed chunk of ``prefill_tokens``.
    * ``bw``: cold exact-range reads (the streaming reader's own populate path) of up
      to four layers, after they were streamed out and evicted.
    * ``d``: seconds per byte of dropping those layers' pages from the page cache again
      (mmap streaming without ``keep_page_cache``; 0 otherwise).
    * ``o``: median decode step with every layer streamed from a warm page cache (no
      disk): ``(t_warm - t_resident) / units``.
    * streaming bandwidth: fitted so that the simulated all-streamed pass
      (:func:`.cost.pass_time`) takes the measured median decode step with every layer
      streamed cold from disk.
    """
    ctl = controller_of(model)
    lay = ctl.layout
    n = len(lay.layers)
    before = set(lay.resident)
    budget = model_budget(path)
    vocab = budget.vocab_size or 256
    prompt = [(7 * i + 3) % vocab for i in range(max(prefill_tokens, 8))]
    short = prompt[:8]
    try:
        ctl.admit(range(n))
        decode_steps(model, short, 2)  # warm-up
        _, steps, _ = decode_steps(model, short, tokens)
        t_res = statistics.median(steps)
        t_prefill = prefill_time(model, prompt[:prefill_tokens], repeats=2)

        ctl.shed(range(n))
        groups = [[t.name for t in lay.layers[i].sources.values()] for i in range(min(n, 4))]
        bw, drop = _measure_reads(ctl.checkpoint, groups, evict_files=False)
        if ctl.strategy != "mmap" or ctl.keep_page_cache:
            drop = 0.0  # only mmap streaming drops pages on the forward pass

        keep = ctl.keep_page_cache
        ctl.keep_page_cache = True
        try:
            warm(ctl.checkpoint.files)  # warm page cache: streaming without disk
            decode_steps(model, short, 1)
            _, steps, _ = decode_steps(model, short, tokens)
            t_warm = statistics.median(steps)
        finally:
            ctl.keep_page_cache = keep
            evict(ctl.checkpoint.files)
        units = len(lay.units)
        # Everything streamed from disk: how much of the reads hid behind compute.
        decode_steps(model, short[:4], 1)
        _, steps, _ = decode_steps(model, short, tokens)
        t_cold = statistics.median(steps)
    finally:
        ctl.admit(before)
        ctl.shed(set(range(n)) - before)
    k = t_res / budget.compute_bytes
    o = max(0.0, (t_warm - t_res) / max(units, 1))
    depth = ctl.depth
    kernels = installed_kernels(model)
    stream_bw = fit_stream_bandwidth(budget, k, o, drop, bw, t_cold, depth)
    return Calibration(
        disk_bytes_per_s=bw, decode_s_per_byte=k, stream_bytes_per_s=stream_bw,
        release_s_per_byte=drop,
        prefill_s_per_byte_token=t_prefill / (budget.compute_bytes * prefill_tokens),
        unit_overhead_s=o,
        prefill_tokens=prefill_tokens, source="model",
        key=key or _model_key(Path(path), ctl.strategy, kernels),
        detail={"path": str(path), "t_resident_s": t_res, "t_warm_streamed_s": t_warm,
                "t_cold_streamed_s": t_cold, "t_prefill_s": t_prefill, "units": units,
                "strategy": ctl.strategy, "prefetch": depth, "kernels": kernels})


def format_of(b: ModelBudget, path_or_config=None,
              kernels: Optional[str] = None) -> ComputeFormat:
    """The machine calibration's format for a model (:func:`.formats.compute_format`:
    dtypes from the checkpoint when ``path_or_config`` has weights, else the config;
    ``kernels`` as :func:`pyloader.load_model` takes it, None: what a load now would use)."""
    return compute_format(b, path_or_config, kernels)


def default_format(kernels: Optional[str] = None) -> ComputeFormat:
    """The machine calibration's format without a model: a bfloat16 4096×4096 matrix in
    32 MiB units, computed by ``kernels`` (None: what a load now would use)."""
    return ComputeFormat("bfloat16", "bfloat16", kernels=kernels)


#: Weight bytes the machine probe multiplies per step: copies of the format's shapes up
#: to this size, so the weights stream from memory as a model's do (not from the caches).
PROBE_BYTES = 32 << 20


class _Probe(nn.Module):
    """The machine probe's linear layers, where :func:`pyloader.kernels.install` finds
    them."""

    def __init__(self, layers: list):
        super().__init__()
        self.layers = layers


def _probe_matrices(fmt: ComputeFormat):
    """Copies of ``fmt.shapes`` (weights in ``fmt.weights``, quantized as ``fmt`` says)
    totalling at least :data:`PROBE_BYTES`, as the model's linear layers (``nn.Linear``,
    ``nn.QuantizedLinear``) computed by ``fmt.kernels``: (layers taking x, their inputs'
    widths, each one's weight bytes, the kernels' :class:`~pyloader.kernels.KernelReport`)."""
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
    report = install_kernels(_Probe(mats), fmt.kernels)
    return mats, widths, sizes, report


def _probe_budget(unit: int, units: int) -> ModelBudget:
    """A model of ``units`` equal layers of ``unit`` bytes and nothing else: the
    emulated stream of :func:`_emulate_stream`, for the cost model."""
    return ModelBudget(source="config", name="probe", model_type="probe",
                       weights_dtype="probe", quantization=None, kv_bits=None,
                       kv_dtype="float16", nonlayer_bytes=0, layer_bytes=[unit] * units,
                       caches=[], hidden_size=0, intermediate_size=0, vocab_size=0,
                       num_heads=0, max_position_embeddings=None,
                       compute_bytes=unit * units)


def _measure_direct(ckpt) -> Optional[float]:
    """Cold reads as pread streaming does them (one unit at a time into a reused buffer
    with direct I/O, on the reader's threads): the median bytes per second over the
    probe's tensors; None where the file system has no direct reads."""
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


def calibrate_machine(fmt: Optional[ComputeFormat] = None, *, force: bool = False,
                      prefill_tokens: int = 8) -> Calibration:
    """Measures the cost model without a checkpoint (cached on disk unless contended):
    a 512 MiB probe file in the cache directory read cold and released in units of the
    model's layer size (:func:`_measure_units`), and matrix-vector (decode) /
    matrix-matrix (prefill) products in ``fmt`` — the model's activation dtype,
    quantization and shapes, computed by the kernels the model's would be
    (``fmt.kernels``: pyloader's CPU kernels or MLX's ops) (:func:`format_of`; default:
    :func:`default_format`) — over :data:`PROBE_BYTES` of weights. The streaming read
    bandwidth is fitted to an emulated streamed pass (:func:`_emulate_stream`: units read on a
    reader thread while the products of the previous unit compute), as
    :func:`calibrate_loaded` fits it to the model's own."""
    fmt = fmt or default_format()
    root = cache_dir("calibration")
    key = _machine_key(fmt, root)
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

    # Streaming beside compute: each unit's compute is a group of the probe's products
    # of about a unit's bytes; the reads' bandwidth is fitted to the emulated pass as
    # calibrate_loaded fits it to the model's (reads slow down when compute competes).
    groups, group, gbytes, group_bytes = [], [], 0, []
    for mm, x, nb in zip(mats, x1, mat_bytes):
        group.append((mm, x))
        gbytes += nb
        if gbytes >= fmt.unit_bytes:
            groups.append(group)
            group_bytes.append(gbytes)
            group, gbytes = [], 0
    reps = 1
    if not groups:  # a unit larger than the probe's weights: all of them, repeated
        reps = max(1, round(fmt.unit_bytes / gbytes))
        groups, group_bytes = [group * reps], [gbytes * reps]
    computes = [lambda g=g: mx.eval([mm(x) for mm, x in g]) for g in groups]
    t_cold, t_warm, n_units = _emulate_stream(Checkpoint(probe), fmt.unit_bytes,
                                              fmt.unit_tensors, computes)
    # The products timed again after the disk work: a moment of contention only slows
    # them, so the faster of the two is the machine's.
    t1b, stable1b = _stable_time(step(x1), 5)
    if t1b < t1:
        t1, stable1 = t1b, stable1b
    # A streamed unit's fixed cost (``o``) is what the warm pass took beyond its
    # products' compute: its synchronizing evaluation and what the reader's and drop
    # thread's page-table work beside it costs (at least one evaluation's round trip).
    per_unit = statistics.mean(group_bytes[j % len(groups)] for j in range(n_units))
    o = max(sync, t_warm / n_units - per_unit * t1 / nbytes)
    # Only what the disk adds is the reads' share: the emulated compute is taken from
    # the warm pass, so the fit sees the same loop with and without the disk.
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
    return _save(_judge(cal, before, stable1 and stablep))


def calibrate(path_or_config=None, *, force: bool = False, strategy: str = "mmap",
              budget: Optional[ModelBudget] = None,
              kernels: Optional[str] = None) -> Calibration:
    """A checkpoint's own calibration when ``path_or_config`` has weights, else the
    machine calibration for the model's weight format; either with the products computed
    by ``kernels`` (as :func:`pyloader.load_model` takes it; None: what a load now would
    use). Cached; ``force`` re-measures."""
    if path_or_config is not None and not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            return calibrate_model(p, strategy=strategy, force=force, kernels=kernels)
    if budget is None:
        budget = model_budget(path_or_config) if path_or_config is not None else None
    fmt = (format_of(budget, path_or_config, kernels) if budget
           else default_format(kernels))
    return calibrate_machine(fmt, force=force)


def cached_calibration(path_or_config, budget: ModelBudget, strategy: str = "mmap",
                       kernels: Optional[str] = None) -> Optional[Calibration]:
    """The cached calibration :func:`calibrate` would return, without measuring."""
    if not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            cal = load_calibration(_model_key(p, strategy, effective_choice(kernels)))
            if cal is not None:
                return cal
    return load_calibration(_machine_key(format_of(budget, path_or_config, kernels),
                                         cache_dir("calibration")))
