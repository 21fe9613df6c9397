"""Residency planning, throughput prediction and the memory-pressure monitor.

* :func:`plan` chooses which layers stay resident for a memory budget (bytes, or
  ``"auto"`` from :mod:`pyloader.memory`'s probes) and a priority, reports the
  memory table and expected peak (:mod:`pyloader.budget`) and predicts prefill and
  decode tokens/s from a :class:`Calibration` (disk bandwidth through the streaming
  reader, compute per weight byte, per-unit streaming overhead), measured once and
  cached on disk under the pyloader cache directory.
* :class:`PressureMonitor` watches the headroom while a model generates and moves
  layers between resident and streamed (:func:`shed_layers`, :func:`admit_layers`),
  with hysteresis, never acting on a single reading.

The cost model of one forward pass (decode: one token; prefill: one chunk of P
tokens) follows what the streaming controller does (:mod:`pyloader.streaming`),
step by step, on two clocks, compute and reads:

* a resident layer adds ``k·b_i`` of compute (run lazily, started asynchronously
  when the next streamed unit is reached);
* a streamed layer waits for its read (``b_i/bw``, one read at a time, requested
  ``prefetch`` streamed units earlier, or by itself at the end of its previous use
  when it is the only one), then computes ``k·b_i + o``, synchronizes and drops its
  pages from the page cache (``d·b_i``, mmap streaming);
* the output projection adds ``k·lm_head_bytes`` and synchronizes.

A few passes are simulated and the last one is the steady-state time per token (per
chunk). ``b_i``: layer bytes; ``k``: compute seconds per weight byte (per
token-byte for prefill); ``o``: the fixed cost of a streamed unit (its
synchronizing eval, mapping and unmapping); ``d``: seconds per byte of a page-cache
drop; ``bw``: the read bandwidth while streaming. Calibration measures ``k`` (all
resident), ``o`` (all streamed from a warm page cache), the cold read bandwidth and
``d`` alone, then fits ``bw`` so that the
simulated all-streamed cold pass equals the measured one (reads slow down when
compute competes for the cores); predictions at other residency levels are
extrapolations from those measurements.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ._hooks import call_hook_class
from .budget import RUNTIME_RESERVE, MemoryTable, ModelBudget, format_bytes, model_budget

__all__ = [
    "PRIORITIES",
    "Calibration",
    "Plan",
    "PressureMonitor",
    "admit_layers",
    "calibrate",
    "load_planned",
    "plan",
    "predict",
    "shed_layers",
]

#: Tokens of KV cache reserved by each priority (max_context: the whole context).
PRIORITIES = {"max_tps": 512, "balanced": 1024, "max_context": None}
#: Headroom kept free by "auto" plans and restored by the monitor after a shed.
DEFAULT_LOW_WATER = 96 << 20
DEFAULT_HIGH_WATER = 192 << 20


# ----------------------------------------------------------------------------
# Calibration


def _cache_root() -> Path:
    root = os.environ.get("PYLOADER_CACHE") or os.path.join(Path.home(), ".cache", "pyloader")
    d = Path(root).expanduser() / "calibration"
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass
class Calibration:
    """Measured constants of the cost model (see the module doc)."""

    disk_bytes_per_s: float
    decode_s_per_byte: float          # k for one decode token
    prefill_s_per_byte_token: float   # k per prompt token, for a chunk of prefill_tokens
    unit_overhead_s: float            # o
    prefill_tokens: int
    source: str                       # "model" (measured on this checkpoint) or "machine"
    key: str
    measured_at: float = field(default_factory=time.time)
    detail: dict = field(default_factory=dict)
    #: Read bandwidth while streaming beside compute (fitted to a measured all-streamed
    #: pass; the machine calibration has no model to run and uses disk_bytes_per_s).
    stream_bytes_per_s: Optional[float] = None
    #: Seconds per byte of dropping a released streamed unit's pages from the page
    #: cache (mmap streaming; on the forward pass's critical path).
    release_s_per_byte: float = 0.0

    @property
    def read_bytes_per_s(self) -> float:
        """The bandwidth the cost model uses for streamed reads."""
        return self.stream_bytes_per_s or self.disk_bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(**d)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at))
        return (f"{self.source} calibration {when}: disk {self.disk_bytes_per_s / 1e9:.2f} GB/s, "
                f"decode compute {1e-9 / self.decode_s_per_byte:.2f} GB/s of weights, "
                f"unit overhead {self.unit_overhead_s * 1e3:.1f} ms, page-cache drop "
                f"{self.release_s_per_byte * 1e11:.1f} ms/100 MB, "
                f"streaming reads {self.read_bytes_per_s / 1e9:.2f} GB/s")


def _calibration_file(key: str) -> Path:
    return _cache_root() / f"{key}.json"


def _model_key(path: Path, strategy: str) -> str:
    from .checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    h = hashlib.sha256()
    for f in ckpt.files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(strategy.encode())
    return "model-" + h.hexdigest()[:16]


def _machine_key(fmt: str, device_of: Path) -> str:
    import platform

    dev = os.stat(device_of).st_dev
    return f"machine-{platform.node()}-{dev}-{fmt}".replace("/", "_")


def load_calibration(key: str) -> Optional[Calibration]:
    """The calibration cached under ``key``, or None when there is none (or it is unreadable)."""
    f = _calibration_file(key)
    if not f.exists():
        return None
    try:
        return Calibration.from_dict(json.loads(f.read_text()))
    except (ValueError, TypeError, KeyError):
        return None


def _save(cal: Calibration) -> Calibration:
    f = _calibration_file(cal.key)
    tmp = f.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cal.to_dict(), indent=1))
    os.replace(tmp, f)
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
    from .loaders import MmapReader
    from .pagecache import evict_file

    reader = MmapReader(ckpt)
    rates, drops = [], []
    try:
        for names in groups:
            if evict_files:
                for f in ckpt.files:
                    evict_file(f)
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


def _decode_steps(model, prompt: list[int], n: int) -> tuple[float, list[float], list[int]]:
    """(prefill seconds incl. first token, per-step decode seconds, tokens)."""
    import mlx.core as mx
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


def _prefill_time(model, prompt: list[int], repeats: int = 3) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def once():
        cache = make_prompt_cache(model)
        out = model(mx.array([prompt]), cache=cache)
        mx.eval(out, [c.state for c in cache])

    once()  # warm-up
    return _median_time(once, repeats)


def calibrate_model(path, *, strategy: str = "mmap", tokens: int = 5,
                    prefill_tokens: int = 16, force: bool = False) -> Calibration:
    """Measures the cost model on a checkpoint, in this process (cached on disk):
    loads it with every layer resident and runs :func:`calibrate_loaded`."""
    import mlx.core as mx

    from .streaming import load_model

    path = Path(path)
    key = _model_key(path, strategy)
    if not force and (cached := load_calibration(key)) is not None:
        return cached
    model, _ = load_model(path, strategy=strategy, resident=1.0, tokenizer=False)
    cal = calibrate_loaded(model, path, tokens=tokens, prefill_tokens=prefill_tokens, key=key)
    del model
    mx.clear_cache()
    return _save(cal)


def calibrate_loaded(model, path, *, tokens: int = 5, prefill_tokens: int = 16,
                     key: Optional[str] = None) -> Calibration:
    """Measures the cost model on a model from :func:`pyloader.load_model` (its resident
    set is changed during the measurement and restored after; nothing is cached).

    * ``k``: median decode step with every layer resident, over the model's compute
      bytes (layers + output projection); prefill: a timed chunk of ``prefill_tokens``.
    * ``bw``: cold exact-range reads (the streaming reader's own populate path) of up
      to four layers, after they were streamed out and evicted.
    * ``o``: median decode step with every layer streamed from a warm page cache (no
      disk): ``(t_warm - t_resident) / units``.
    * ``φ``: from a median decode step with every layer streamed cold from disk: the
      share of the reads that did not add to the step time.
    """
    ctl = _controller(model)
    lay = ctl.layout
    n = len(lay["layer_bytes"])
    before = set(lay["resident"])
    budget = model_budget(path)
    vocab = budget.vocab_size or 256
    prompt = [(7 * i + 3) % vocab for i in range(max(prefill_tokens, 8))]
    short = prompt[:8]
    try:
        admit_layers(model, range(n))
        _decode_steps(model, short, 2)  # warm-up
        _, steps, _ = _decode_steps(model, short, tokens)
        t_res = statistics.median(steps)
        t_prefill = _prefill_time(model, prompt[:prefill_tokens], repeats=2)

        shed_layers(model, range(n))
        groups = []
        for i in range(min(n, 4)):
            groups.append([src for p, src in lay["direct"].items()
                           if p.startswith(lay["paths"][i] + ".")])
        bw, drop = _measure_reads(ctl.ckpt, groups, evict_files=False)
        if ctl.strategy != "mmap" or ctl.keep_page_cache:
            drop = 0.0  # only mmap streaming drops pages on the forward pass

        keep = ctl.keep_page_cache
        ctl.keep_page_cache = True
        try:
            for f in ctl.ckpt.files:  # warm page cache: streaming without disk
                with open(f, "rb") as fh:
                    while fh.read(64 << 20):
                        pass
            _decode_steps(model, short, 1)
            _, steps, _ = _decode_steps(model, short, tokens)
            t_warm = statistics.median(steps)
        finally:
            ctl.keep_page_cache = keep
            from .pagecache import evict_file

            for f in ctl.ckpt.files:
                evict_file(f)
        units = len(ctl.units)
        # Everything streamed from disk: how much of the reads hid behind compute.
        _decode_steps(model, short[:4], 1)
        _, steps, _ = _decode_steps(model, short, tokens)
        t_cold = statistics.median(steps)
    finally:
        admit_layers(model, before)
        shed_layers(model, set(range(n)) - before)
    k = t_res / budget.compute_bytes
    o = max(0.0, (t_warm - t_res) / max(units, 1))
    depth = ctl.depth
    stream_bw = _fit_stream_bandwidth(budget, k, o, drop, bw, t_cold, depth)
    return Calibration(
        disk_bytes_per_s=bw, decode_s_per_byte=k, stream_bytes_per_s=stream_bw,
        release_s_per_byte=drop,
        prefill_s_per_byte_token=t_prefill / (budget.compute_bytes * prefill_tokens),
        unit_overhead_s=o,
        prefill_tokens=prefill_tokens, source="model",
        key=key or _model_key(Path(path), ctl.strategy),
        detail={"path": str(path), "t_resident_s": t_res, "t_warm_streamed_s": t_warm,
                "t_cold_streamed_s": t_cold, "t_prefill_s": t_prefill, "units": units,
                "strategy": ctl.strategy, "prefetch": depth})


def _fit_stream_bandwidth(budget: ModelBudget, k: float, o: float, drop: float, bw: float,
                          t_cold: float, prefetch: int) -> float:
    """The read bandwidth for which the simulated all-streamed pass takes ``t_cold``
    (bisection over bw/1000 .. 1000·bw: the pass time falls as bandwidth rises).
    ``bw`` (reads alone) when no bandwidth would make the pass that fast (the pass
    is compute-bound: reads did not limit it)."""
    def t(rate: float) -> float:
        return _pass_time(budget, (), k, o, drop, rate, prefetch)

    lo, hi = bw * 1e-3, bw * 1e3
    if t(hi) >= t_cold:
        return bw
    if t(lo) <= t_cold:
        return lo
    for _ in range(60):  # invariant: t(lo) > t_cold >= t(hi)
        mid = (lo * hi) ** 0.5
        if t(mid) > t_cold:
            lo = mid
        else:
            hi = mid
    return hi


def _format_of(b: ModelBudget) -> str:
    if b.quantization:
        return f"q{b.quantization['bits']}g{b.quantization['group_size']}-{b.weights_dtype}"
    return b.weights_dtype


def calibrate_machine(fmt: str = "bfloat16", *, force: bool = False,
                      prefill_tokens: int = 8) -> Calibration:
    """Measures the cost model without a checkpoint (cached on disk): cold reads of a
    256 MiB probe file in the cache directory through the mmap reader, and matrix-vector
    (decode) / matrix-matrix (prefill) products over 16 MiB of weights in ``fmt``
    (``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"q4g64-bfloat16"`` style)."""
    import mlx.core as mx

    from .checkpoint import Checkpoint

    root = _cache_root()
    key = _machine_key(fmt, root)
    if not force and (cached := load_calibration(key)) is not None:
        return cached
    probe = root / "disk-probe.safetensors"
    size = 256 << 20
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
    ckpt = Checkpoint(probe)
    bw, drop = _measure_reads(ckpt, [[f"t{i}"] for i in range(8)])

    quant = None
    dtype = fmt
    if fmt.startswith("q"):
        qpart, dtype = fmt.split("-", 1)
        bits, gs = qpart[1:].split("g")
        quant = (int(bits), int(gs))
    dt = getattr(mx, dtype)
    rows, cols = 2048, (16 << 20) // (2048 * dt.size)
    w = (mx.random.normal((rows, cols)) * 0.02).astype(dt)
    x1 = mx.random.normal((1, cols)).astype(dt)
    xp = mx.random.normal((prefill_tokens, cols)).astype(dt)
    if quant:
        wq, s, b = mx.quantize(w, group_size=quant[1], bits=quant[0])
        mx.eval(wq, s, b)
        nbytes = wq.nbytes + s.nbytes + b.nbytes

        def mm(x):
            return mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=quant[1],
                                       bits=quant[0])
    else:
        mx.eval(w)
        nbytes = w.nbytes

        def mm(x):
            return x @ w.T
    mx.eval(mm(x1), mm(xp))
    t1 = _median_time(lambda: mx.eval(mm(x1)), 5)
    tp = _median_time(lambda: mx.eval(mm(xp)), 3)
    small = mx.ones((64,))
    o = _median_time(lambda: mx.eval(small + 1), 51)
    cal = Calibration(
        disk_bytes_per_s=bw, decode_s_per_byte=t1 / nbytes, release_s_per_byte=drop,
        prefill_s_per_byte_token=tp / (nbytes * prefill_tokens), unit_overhead_s=o,
        prefill_tokens=prefill_tokens, source="machine", key=key,
        detail={"format": fmt, "probe_file": str(probe)})
    return _save(cal)


def calibrate(path_or_config=None, *, force: bool = False, strategy: str = "mmap",
              budget: Optional[ModelBudget] = None) -> Calibration:
    """A checkpoint's own calibration when ``path_or_config`` has weights, else the
    machine calibration for the model's weight format. Cached; ``force`` re-measures."""
    if path_or_config is not None and not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            return calibrate_model(p, strategy=strategy, force=force)
    if budget is None:
        budget = model_budget(path_or_config) if path_or_config is not None else None
    return calibrate_machine(_format_of(budget) if budget else "bfloat16", force=force)


def cached_calibration(path_or_config, budget: ModelBudget,
                       strategy: str = "mmap") -> Optional[Calibration]:
    """The cached calibration :func:`calibrate` would return, without measuring."""
    if not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            cal = load_calibration(_model_key(p, strategy))
            if cal is not None:
                return cal
    return load_calibration(_machine_key(_format_of(budget), _cache_root()))


# ----------------------------------------------------------------------------
# Prediction


def _lm_head_bytes(b: ModelBudget) -> int:
    return max(0, b.compute_bytes - sum(b.layer_bytes))


def _pass_time(budget: ModelBudget, resident: Sequence[int], k: float, o: float,
               drop: float, bw: float, prefetch: int = 1, passes: int = 3) -> float:
    """Steady-state seconds of one forward pass under the streaming schedule (see
    the module doc): ``passes`` passes are simulated on a compute clock and a read
    clock, and the last one is timed."""
    res = set(resident)
    lb = budget.layer_bytes
    order = [i for i in range(len(lb)) if i not in res]
    pos = {i: j for j, i in enumerate(order)}
    m = len(order)
    head = k * _lm_head_bytes(budget)
    if not m:
        return head + k * sum(lb)
    py = comp = reads = 0.0  # Python's clock, the compute stream's, the reader's
    ready: dict[int, float] = {}

    def request(j: int) -> None:
        nonlocal reads
        reads = max(py, reads) + lb[order[j]] / bw
        ready[j] = reads

    start = 0.0
    for _ in range(passes):
        start, pending = py, 0.0
        for i, b in enumerate(lb):
            if i in res:
                pending += k * b
                continue
            j = pos[i]
            comp, pending = max(comp, py) + pending, 0.0  # inputs evaluated asynchronously
            if j not in ready:
                request(j)  # nothing in flight: read it now
            py = max(py, ready.pop(j))
            for step in range(1, min(prefetch, m - 1) + 1):
                if (j + step) % m not in ready:
                    request((j + step) % m)
            comp = max(comp, py) + k * b + o  # compute, then synchronize
            py = comp + drop * b  # release: the unit's pages leave the page cache
            if prefetch >= m:
                request(j)  # the only streamed unit(s): read again for the next pass
        comp = max(comp, py) + pending + head
        py = comp
    return py - start


def predict(budget: ModelBudget, resident: Sequence[int], cal: Calibration,
            prefill_tokens: Optional[int] = None, prefetch: int = 1) -> dict[str, float]:
    """Predicted seconds per decode token and per prefill chunk, and tokens/s."""
    p = prefill_tokens or cal.prefill_tokens
    bw, o, drop = cal.read_bytes_per_s, cal.unit_overhead_s, cal.release_s_per_byte
    t_dec = _pass_time(budget, resident, cal.decode_s_per_byte, o, drop, bw, prefetch)
    t_pre = _pass_time(budget, resident, cal.prefill_s_per_byte_token * p, o, drop, bw,
                       prefetch)
    return {"decode_s_per_token": t_dec, "decode_tps": 1.0 / t_dec,
            "prefill_s_per_chunk": t_pre, "prefill_tokens": p, "prefill_tps": p / t_pre}


# ----------------------------------------------------------------------------
# Planning


@dataclass
class Plan:
    """A resident set for a budget, with its memory table and predicted speed."""

    budget_bytes: int
    budget_source: str           # "explicit" or "auto" (probes: headroom - reserve)
    priority: str
    context: int                 # expected context (tokens)
    kv_reserve_tokens: int       # tokens of KV cache the plan reserves
    resident_layers: tuple[int, ...]
    table: MemoryTable
    table_all_resident: MemoryTable
    max_context: int             # longest context that fits with this resident set
    max_context_all_resident: int
    model: ModelBudget = field(repr=False)
    prediction: Optional[dict] = None
    calibration: Optional[Calibration] = None

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.model.n_layers) if i not in self.resident_layers)

    @property
    def expected_peak(self) -> int:
        return self.table.total

    @property
    def fits(self) -> bool:
        """The plan's peak (resident set, KV reserve, activations, runtime) fits the budget."""
        return self.table.total <= self.budget_bytes

    @property
    def fits_all_resident(self) -> bool:
        return self.table_all_resident.total <= self.budget_bytes

    def to_dict(self) -> dict:
        t = self.table
        d = {
            "model": self.model.to_dict(self.kv_reserve_tokens),
            "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
            "priority": self.priority, "context": self.context,
            "kv_reserve_tokens": self.kv_reserve_tokens,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "weights_bytes": self.model.weights_bytes,
            "table": {**asdict(t), "total": t.total},
            "table_all_resident": {**asdict(self.table_all_resident),
                                   "total": self.table_all_resident.total},
            "fits": self.fits, "fits_all_resident": self.fits_all_resident,
            "max_context": self.max_context,
            "max_context_all_resident": self.max_context_all_resident,
            "resident_layers": list(self.resident_layers),
            "streamed_layers": list(self.streamed_layers),
            "expected_peak": self.expected_peak,
            "prediction": self.prediction,
            "calibration": self.calibration.to_dict() if self.calibration else None,
        }
        return d

    def render(self) -> str:
        m, t, a = self.model, self.table, self.table_all_resident
        fb = format_bytes
        q = (f"{m.quantization['bits']}-bit g{m.quantization['group_size']}"
             if m.quantization else m.weights_dtype)
        lb = m.layer_bytes
        size = (fb(lb[0]) if len(set(lb)) == 1 else f"{fb(min(lb))}–{fb(max(lb))}")
        kinds = {}
        for c in m.caches:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        lines = [
            f"model      {m.name} ({m.model_type}, {m.n_layers} layers, {q}; weights from "
            f"{'the checkpoint index' if m.source == 'checkpoint' else 'config shapes'})",
            f"budget     {fb(self.budget_bytes)} ({self.budget_source}), priority "
            f"{self.priority}, context {self.context}, KV reserve {self.kv_reserve_tokens} "
            f"tokens, KV {m.kv_dtype}",
            f"KV cache   {m.kv_bytes_per_token:,} B/token over {m.kv_layers} layers "
            f"({', '.join(f'{n} {k}' for k, n in kinds.items())})",
            "",
            f"{'':22}{'all resident':>16}{'this plan':>16}",
            f"{'weights (resident)':22}{fb(a.resident_weights):>16}{fb(t.resident_weights):>16}",
            f"{'  non-layer':22}{fb(m.nonlayer_bytes):>16}{fb(m.nonlayer_bytes):>16}",
            f"{'  layers':22}{f'{m.n_layers} × {size}':>16}"
            f"{f'{len(self.resident_layers)} resident':>16}",
            f"{'KV cache':22}{fb(a.kv_cache):>16}{fb(t.kv_cache):>16}",
            f"{'activations':22}{fb(a.activations):>16}{fb(t.activations):>16}",
            f"{'streaming buffers':22}{fb(a.stream_buffer):>16}{fb(t.stream_buffer):>16}",
            f"{'runtime reserve':22}{fb(a.runtime):>16}{fb(t.runtime):>16}",
            f"{'total (peak)':22}{fb(a.total):>16}{fb(t.total):>16}",
            f"{'fits':22}{'yes' if self.fits_all_resident else 'no':>16}"
            f"{'yes' if self.fits else 'no':>16}",
            f"{'max context':22}{self.max_context_all_resident:>16,}{self.max_context:>16,}",
            "",
            f"resident   {len(self.resident_layers)}/{m.n_layers} layers "
            f"{_ranges(self.resident_layers)}; streamed {len(self.streamed_layers)} "
            f"({fb(sum(lb[i] for i in self.streamed_layers))} read per forward pass)",
        ]
        if self.prediction:
            p = self.prediction
            lines.append(f"predicted  decode {p['decode_tps']:.2f} tok/s, prefill "
                         f"{p['prefill_tps']:.1f} tok/s (chunks of {p['prefill_tokens']})")
        if self.calibration:
            lines.append(f"           {self.calibration.describe()}")
        return "\n".join(lines)


def _ranges(idx: Sequence[int]) -> str:
    idx = sorted(idx)
    if not idx:
        return "[]"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "[" + ",".join(out) + "]"


def _choose(budget: ModelBudget, free: int, cal: Optional[Calibration],
            stream_buffer: int, prefetch: int = 1) -> tuple[int, ...]:
    """The resident set that saves the most predicted time within ``free`` bytes of
    layer weights (``stream_buffer`` of them held back once anything streams).

    Layer sizes may differ, so this is a knapsack: sizes are rounded up to 1/4096 of
    the room and solved exactly by dynamic programming; the value of keeping a layer
    is the time its streaming would add on the critical path (an additive
    approximation of the pipelined pass). Models of up to 32 layers then get a local
    search on the simulated pass itself (:func:`_improve`). Without a calibration
    every byte is worth the same and lower layers win ties.
    """
    n = budget.n_layers
    lb = budget.layer_bytes
    if sum(lb) <= free:
        return tuple(range(n))
    room = free - stream_buffer
    if room <= 0:
        return ()

    def saving(i: int) -> float:
        # What streaming layer i adds to a pass when it is on the critical path: its
        # read when reads are the bottleneck, its fixed cost when compute is. The
        # pipeline is not additive (a read hides behind its neighbours' compute);
        # this value is the knapsack's approximation of it.
        if cal is None:
            return float(lb[i])
        c = cal.decode_s_per_byte * lb[i]
        work = c + cal.unit_overhead_s + cal.release_s_per_byte * lb[i]
        return max(work, lb[i] / cal.read_bytes_per_s) - c

    slots = 4096
    q = max(1, -(-room // slots))
    cap = room // q
    size = [-(-b // q) for b in lb]
    # best[c] = (value, -count, chosen) with capacity c; ties prefer fewer, lower layers.
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())] * (cap + 1)
    for i in range(n):
        if size[i] > cap:
            continue
        v = saving(i) * (1 + 1e-9 * (n - i))  # ties: lower index first
        for c in range(cap, size[i] - 1, -1):
            cand = best[c - size[i]][0] + v
            if cand > best[c][0]:
                best[c] = (cand, best[c - size[i]][1] + (i,))
    chosen = tuple(sorted(best[cap][1]))
    if cal is not None and n <= _LOCAL_SEARCH_LAYERS:
        # Two starts, the knapsack's set and the empty one, each improved by local
        # search; the faster result wins (ties: the knapsack's).
        found = [_improve(budget, start, room, cal, prefetch) for start in (chosen, ())]
        chosen = min(found, key=lambda r: r[0])[1]
    return chosen


#: Up to this many layers the knapsack's choice is refined by local search on the
#: simulated pass (each step simulates O(n²) candidate sets).
_LOCAL_SEARCH_LAYERS = 32


def _improve(budget: ModelBudget, chosen: tuple[int, ...], room: int, cal: Calibration,
             prefetch: int) -> tuple[float, tuple[int, ...]]:
    """Local search from ``chosen``: add a layer, or swap one in for one out, while
    the set fits in ``room`` and the simulated decode pass gets faster; each step takes
    the move that saves the most time per byte added (the fastest move when it adds
    no bytes). Returns (simulated decode pass seconds, the set)."""
    lb = budget.layer_bytes
    k, o, d, bw = (cal.decode_s_per_byte, cal.unit_overhead_s, cal.release_s_per_byte,
                   cal.read_bytes_per_s)

    def t(s) -> float:
        return _pass_time(budget, s, k, o, d, bw, prefetch)

    cur, now = set(chosen), t(chosen)
    used = sum(lb[i] for i in cur)
    while True:
        best = None
        outside = [j for j in range(len(lb)) if j not in cur]
        moves = [None] + sorted(cur)  # add j, or swap it for i
        for j in outside:
            for i in moves:
                size = used + lb[j] - (lb[i] if i is not None else 0)
                if size > room:
                    continue
                cand = (cur - {i}) | {j}
                tc = t(cand)
                if tc >= now * (1 - 1e-9):
                    continue
                score = (now - tc) / max(size - used, 1)
                if best is None or score > best[0]:
                    best = (score, tc, cand, size)
        if best is None:
            return now, tuple(sorted(cur))
        _, now, cur, used = best


def plan(path_or_config, budget: int | str = "auto", *, priority: str = "balanced",
         context: Optional[int] = None, kv_bits: Optional[int] = None,
         kv_dtype: Optional[str] = None, quantization: Optional[dict] = None,
         calibration: Calibration | str | None = "cached", prefetch: int = 1,
         reserve: int = DEFAULT_HIGH_WATER, model: Optional[ModelBudget] = None) -> Plan:
    """Plans the resident set of a model for a memory budget.

    Args:
        path_or_config: model directory, ``config.json`` path or config dict.
        budget: bytes (int, or a string like ``"6GB"``) for the whole process, or
            ``"auto"``: this process's headroom now (:func:`pyloader.memory.read_memory`,
            the smallest of MemAvailable and the cgroup's limit - usage) minus
            ``reserve``; what the process already holds is outside the headroom, so
            an auto plan counts no runtime reserve.
        priority: ``"max_tps"`` (KV reserve 512 tokens), ``"balanced"`` (1024) or
            ``"max_context"`` (the whole ``context``).
        context: expected context in tokens (default: min(model max, 4096)).
        kv_bits: ``None`` (float KV), 8 or 4.
        calibration: a :class:`Calibration`, ``"cached"`` (use one if measured before),
            ``"measure"`` (measure now if none is cached) or None (no prediction).
        prefetch: streaming prefetch depth (streamed units in flight beside the running one).
    """
    from .budget import parse_bytes

    if priority not in PRIORITIES:
        raise ValueError(f"unknown priority {priority!r}; expected one of {tuple(PRIORITIES)}")
    m = model or model_budget(path_or_config, kv_bits=kv_bits, kv_dtype=kv_dtype,
                              quantization=quantization)
    if context is None:
        context = min(m.max_position_embeddings or 4096, 4096)
    if context < 1:
        raise ValueError(f"context must be positive, got {context}")
    reserve_tokens = PRIORITIES[priority]
    kv_tokens = context if reserve_tokens is None else min(context, reserve_tokens)
    if budget == "auto":
        from .memory import read_memory

        head = read_memory().headroom
        if head is None:
            raise RuntimeError("budget='auto' needs a memory probe; none is readable here "
                               "(pass a byte budget)")
        total, source, runtime = max(0, head - reserve), "auto", 0
    else:
        total = parse_bytes(budget) if isinstance(budget, str) else int(budget)
        source, runtime = "explicit", RUNTIME_RESERVE
    if calibration == "cached":
        cal = cached_calibration(path_or_config, m)
    elif calibration == "measure":
        cal = calibrate(path_or_config, budget=m)
    else:
        cal = calibration
    every = m.table(kv_tokens, None, runtime, prefetch)
    fixed = every.total - sum(m.layer_bytes)
    buffer = (prefetch + 1) * max(m.layer_bytes) if m.layer_bytes else 0
    resident = _choose(m, total - fixed, cal, buffer, prefetch)
    table = m.table(kv_tokens, resident, runtime, prefetch)
    # The resident set stays; the KV cache may grow into whatever is left.
    return Plan(
        budget_bytes=total, budget_source=source, priority=priority, context=context,
        kv_reserve_tokens=kv_tokens, resident_layers=resident, table=table,
        table_all_resident=every,
        max_context=m.max_context(total, resident, runtime),
        max_context_all_resident=m.max_context(total, None, runtime),
        model=m, prediction=predict(m, resident, cal, prefetch=prefetch) if cal else None,
        calibration=cal)


# ----------------------------------------------------------------------------
# Moving layers between resident and streamed (a loaded streaming model)


def _controller(model):
    ctl = getattr(model, "_pyloader", None)
    if ctl is None or not hasattr(ctl, "layout"):
        raise ValueError("this model was not loaded by pyloader.load_model")
    return ctl


def resident_layers(model) -> set[int]:
    """Indices of the layers a streaming model currently keeps resident."""
    return set(_controller(model).layout["resident"])


def _renumber(ctl, new_units: list) -> None:
    """Installs ``new_units`` (execution order) and moves outstanding prefetch
    tickets to the units' new positions; tickets of units no longer streamed are
    cancelled (their buffers freed)."""
    reader = ctl.pread if ctl.pread is not None else ctl.mmap
    by_unit = {id(ctl.units[o]): t for o, t in ctl._tickets.items()}
    keep = {id(u) for u in new_units}
    for u in ctl.units:
        if id(u) not in keep and id(u) in by_unit:
            reader.cancel(by_unit.pop(id(u)))
    ctl.units[:] = new_units
    ctl._tickets = {}
    for order, u in enumerate(new_units):
        u.order = order
        if id(u) in by_unit:
            ctl._tickets[order] = by_unit[id(u)]


def _layer_of_unit(ctl, unit) -> int:
    for i, p in enumerate(ctl.layout["paths"]):
        if unit.name == p or unit.name.startswith(p + "."):
            return i
    raise AssertionError(unit.name)


def shed_layers(model, layers: Sequence[int]) -> int:
    """Turns resident layers into streamed ones; returns the weight bytes released.

    Safe between forward passes (a pending computation keeps the arrays it already
    references). mmap: the layer's pages leave the process and the page cache;
    pread and misaligned copies: the arrays are dropped and MLX's buffer cache cleared.
    """
    import mlx.core as mx

    from .streaming import _streamed_class, _Unit, _units_of_layer

    ctl = _controller(model)
    lay = ctl.layout
    todo = [i for i in sorted(set(layers)) if i in lay["resident"]]
    if not todo:
        return 0
    meta = {t.name: t for t in ctl.ckpt.tensors()}
    added = []
    for i in todo:
        for upath, module in _units_of_layer(lay["layers"][i], lay["paths"][i],
                                             lay["granularity"]):
            unit = _Unit(name=upath, module=module, order=-1, params={}, nbytes=0)
            for param, src in lay["direct"].items():
                if param.startswith(upath + "."):
                    unit.params[param[len(upath) + 1:]] = src
                    unit.nbytes += meta[src].nbytes
            if ctl.mmap is not None:
                unit.copied = [p for p, src in unit.params.items()
                               if not meta[src].aligned and meta[src].nbytes]
            unit.controller = ctl
            object.__setattr__(module, "_pyloader_unit", unit)
            module.__class__ = _streamed_class(type(module))
            added.append((i, unit))
    units = [(_layer_of_unit(ctl, u), k, u) for k, u in enumerate(ctl.units)]
    units += [(i, len(units) + k, u) for k, (i, u) in enumerate(added)]
    _renumber(ctl, [u for _, _, u in sorted(units, key=lambda x: (x[0], x[1]))])
    for _, unit in added:
        if ctl.mmap is not None:
            for src in unit.params.values():
                ctl.mmap.advise(src, "random")
        ctl.release(unit)
    freed = sum(lay["layer_bytes"][i] for i in todo)
    lay["resident"] -= set(todo)
    ctl.resident_bytes -= freed
    mx.clear_cache()
    return freed


def admit_layers(model, layers: Sequence[int]) -> int:
    """Turns streamed layers back into resident ones (loaded now); returns the bytes."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    ctl = _controller(model)
    lay = ctl.layout
    todo = [i for i in sorted(set(layers)) if i not in lay["resident"]]
    if not todo:
        return 0
    leaving = [u for u in ctl.units if _layer_of_unit(ctl, u) in todo]
    _renumber(ctl, [u for u in ctl.units if u not in leaving])
    for unit in leaving:
        names = list(unit.params.values())
        if ctl.pread is not None:
            arrays = ctl.pread.load(names)
            pairs = [(p, arrays[src]) for p, src in unit.params.items()]
            unit.module.update(tree_unflatten(pairs))
            mx.eval([a for _, a in pairs])
        else:
            ctl.mmap.wait(ctl.mmap.prefetch(names, "populate"))
            for src in names:
                ctl.mmap.advise(src, "normal")
            if unit.copied:
                arrays = ctl.mmap.load([unit.params[p] for p in unit.copied])
                pairs = [(p, arrays[unit.params[p]]) for p in unit.copied]
                unit.module.update(tree_unflatten(pairs))
                mx.eval([a for _, a in pairs])
        unit.module.__class__ = unit.module._pyloader_base
        object.__delattr__(unit.module, "_pyloader_unit")
    added = sum(lay["layer_bytes"][i] for i in todo)
    lay["resident"] |= set(todo)
    ctl.resident_bytes += added
    return added


# ----------------------------------------------------------------------------
# The pressure monitor


@dataclass
class PressureEvent:
    """One decision of the pressure monitor: layers shed or re-admitted."""

    call: int           # forward calls seen when it happened
    action: str         # "shed" or "admit"
    layers: tuple[int, ...]
    headroom: int       # the window's reading that decided it
    nbytes: int
    time: float


def _headroom_of(sample) -> Optional[int]:
    if sample is None or isinstance(sample, int):
        return sample
    return sample.headroom


class PressureMonitor:
    """Watches headroom while a model runs and sheds / re-admits resident layers.

    Every ``every`` forward calls (one per decode token, one per prefill chunk) the
    probe is read. Decisions use the last ``window`` readings, never one:

    * **shed** when every reading of the window is below ``low_water``: the highest
      resident layers go first, as many as it takes to bring the window's best reading
      back above ``high_water`` plus the streaming memory a reading does not see (the
      unit computed while the next is prefetched; all buffers on the first shed);
    * **re-admit** one layer (the lowest streamed one) when every reading of the window
      is above ``high_water`` plus that layer's bytes plus that unseen streaming memory,
      at least ``cooldown`` calls have passed since the last change, and — after a shed
      — the headroom has grown by more than ``high_water - low_water`` since the first
      full window after that shed (a shed may free up to one layer more than it needed,
      which alone can put the headroom at the admit threshold: only memory given back
      from outside re-admits). After an admit the headroom is still above
      ``high_water`` > ``low_water``, so it cannot trigger a shed by itself: no
      oscillation.

    After every change the window restarts (readings from before it describe another
    state). ``psi_threshold`` (percent, PSI ``some avg10``) optionally counts a reading
    as under pressure whatever its headroom.
    """

    def __init__(self, model, *, probe: Optional[Callable[[], Any]] = None,
                 low_water: int = DEFAULT_LOW_WATER, high_water: int = DEFAULT_HIGH_WATER,
                 every: int = 1, window: int = 3, cooldown: int = 8,
                 psi_threshold: Optional[float] = None, readmit: bool = True,
                 min_resident: int = 0):
        if high_water <= low_water:
            raise ValueError(f"high_water ({high_water}) must be above low_water ({low_water})")
        if window < 2:
            raise ValueError("window must be at least 2: a single reading never decides")
        if every < 1:
            raise ValueError("every must be >= 1")
        self.model = model
        self.ctl = _controller(model)
        if probe is None:
            from .memory import read_memory

            probe = read_memory
        self.probe = probe
        self.low_water, self.high_water = low_water, high_water
        self.every, self.window, self.cooldown = every, window, cooldown
        self.psi_threshold = psi_threshold
        self.readmit = readmit
        self.min_resident = min_resident
        self.samples: deque = deque(maxlen=window)
        self.calls = 0
        self.last_change = -(10**9)
        self._shed_floor: Optional[int] = None  # best reading of the first window after a shed
        self.events: list[PressureEvent] = []
        self._attached = False

    # -- hooking the model ------------------------------------------------------

    def attach(self) -> "PressureMonitor":
        """Makes every forward call of the model tick the monitor first."""
        if self._attached:
            return self
        model = self.model
        cls = type(model)
        monitor = self

        def __call__(self, *args, **kwargs):
            monitor.tick()
            return cls.__call__(self, *args, **kwargs)

        model.__class__ = call_hook_class(cls, "", __call__, "_pyloader_monitor_base")
        object.__setattr__(model, "_pyloader_monitor", self)
        self._attached = True
        return self

    def detach(self) -> None:
        if self._attached:
            self.model.__class__ = type(self.model)._pyloader_monitor_base
            object.__delattr__(self.model, "_pyloader_monitor")
            self._attached = False

    # -- decisions --------------------------------------------------------------

    def _reading(self) -> Optional[int]:
        sample = self.probe()
        h = _headroom_of(sample)
        if (h is not None and self.psi_threshold is not None and not isinstance(sample, int)
                and (sample.psi_some_avg10 or 0.0) >= self.psi_threshold):
            h = min(h, self.low_water - 1)
        return h

    def _unit_bytes(self) -> int:
        lb = self.ctl.layout["layer_bytes"]
        return max(lb) if lb else 0

    def _transient(self, streaming: bool) -> int:
        """Streaming memory a reading taken at the start of a forward call does not see:
        all ``prefetch + 1`` units when nothing streams yet, else the one unit that is
        computed while the next is prefetched."""
        u = self._unit_bytes()
        return u if streaming else (self.ctl.depth + 1) * u

    def tick(self) -> Optional[PressureEvent]:
        """One forward call; reads the probe every ``every`` calls and acts if the window says so."""
        self.calls += 1
        if self.calls % self.every:
            return None
        h = self._reading()
        if h is None:
            return None
        self.samples.append(h)
        if len(self.samples) < self.window:
            return None
        if self._shed_floor is None and self.events and self.events[-1].action == "shed":
            self._shed_floor = max(self.samples)
        lay = self.ctl.layout
        n = len(lay["layer_bytes"])
        best, worst = max(self.samples), min(self.samples)
        resident = sorted(lay["resident"])
        streaming = len(resident) < n
        if best < self.low_water and len(resident) > self.min_resident:
            need = self.high_water + self._transient(streaming) - best
            shed, freed = [], 0
            for i in reversed(resident[self.min_resident:]):
                if freed >= need:
                    break
                shed.append(i)
                freed += lay["layer_bytes"][i]
            return self._apply("shed", shed, best)
        if self.readmit and streaming and self.calls - self.last_change >= self.cooldown:
            streamed = [i for i in range(n) if i not in lay["resident"]]
            j = streamed[0]
            if len(streamed) == 1:  # streaming stops: its buffers are given back
                need = lay["layer_bytes"][j] - self.ctl.depth * self._unit_bytes()
            else:
                need = lay["layer_bytes"][j] + self._transient(True)
            grown = (self._shed_floor is None
                     or worst > self._shed_floor + self.high_water - self.low_water)
            if worst >= self.high_water + max(need, 0) and grown:
                return self._apply("admit", [j], worst)
        return None

    def _apply(self, action: str, layers: list[int], headroom: int) -> PressureEvent:
        fn = shed_layers if action == "shed" else admit_layers
        nbytes = fn(self.model, layers)
        ev = PressureEvent(self.calls, action, tuple(sorted(layers)), headroom, nbytes,
                           time.monotonic())
        self.events.append(ev)
        self.samples.clear()
        self.last_change = self.calls
        self._shed_floor = None
        return ev

    def stats(self) -> dict:
        return {"calls": self.calls, "resident_layers": sorted(self.ctl.layout["resident"]),
                "events": [asdict(e) for e in self.events]}


# ----------------------------------------------------------------------------
# Convenience


def load_planned(path, budget: int | str = "auto", *, priority: str = "balanced",
                 context: Optional[int] = None, kv_bits: Optional[int] = None,
                 monitor: bool | dict = True, **load_kwargs):
    """Plans, loads the model with the plan's resident set, and attaches a
    :class:`PressureMonitor` (``monitor`` may be a dict of its options).

    Returns ``(model, tokenizer, plan, monitor_or_None)``.
    """
    from .streaming import load_model

    opts = monitor if isinstance(monitor, dict) else {}
    p = plan(path, budget, priority=priority, context=context, kv_bits=kv_bits,
             prefetch=load_kwargs.get("prefetch", 1),
             reserve=opts.get("high_water", DEFAULT_HIGH_WATER))
    model, tok = load_model(path, resident=set(p.resident_layers), **load_kwargs)
    mon = None
    if monitor:
        mon = PressureMonitor(model, **opts).attach()
    return model, tok, p, mon

