"""Calibration: the measured constants of the cost model (:mod:`.cost`), cached on disk.

* :func:`calibrate_model` / :func:`calibrate_loaded`: on a checkpoint (every layer
  resident, then streamed from a warm and a cold page cache);
* :func:`calibrate_machine`: without a checkpoint, from a probe file and matrix products
  in the model's weight format;
* :func:`calibrate` / :func:`cached_calibration`: the checkpoint's own when it has
  weights, else the machine's. Cached under the pyloader cache directory
  (``calibration/``).
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

from .._util.fs import cache_dir, write_atomic
from ..io.checkpoint import Checkpoint
from ..io.pagecache import evict, warm
from ..io.readers import MmapReader
from ..loading import load_model
from ..streaming import controller_of
from .budget import ModelBudget, model_budget
from .cost import Calibration, fit_stream_bandwidth


def _calibration_file(key: str) -> Path:
    return cache_dir("calibration") / f"{key}.json"


def _model_key(path: Path, strategy: str) -> str:
    ckpt = Checkpoint(path)
    h = hashlib.sha256()
    for f in ckpt.files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(strategy.encode())
    return "model-" + h.hexdigest()[:16]


def _machine_key(fmt: str, device_of: Path) -> str:
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
                    prefill_tokens: int = 16, force: bool = False) -> Calibration:
    """Measures the cost model on a checkpoint, in this process (cached on disk):
    loads it with every layer resident and runs :func:`calibrate_loaded`."""
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
    stream_bw = fit_stream_bandwidth(budget, k, o, drop, bw, t_cold, depth)
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


def format_of(b: ModelBudget) -> str:
    """The machine calibration's key for a model's weight format (``"bfloat16"``,
    ``"q4g64-bfloat16"``, ...)."""
    if b.quantization:
        return f"q{b.quantization['bits']}g{b.quantization['group_size']}-{b.weights_dtype}"
    return b.weights_dtype


def calibrate_machine(fmt: str = "bfloat16", *, force: bool = False,
                      prefill_tokens: int = 8) -> Calibration:
    """Measures the cost model without a checkpoint (cached on disk): cold reads of a
    256 MiB probe file in the cache directory through the mmap reader, and matrix-vector
    (decode) / matrix-matrix (prefill) products over 16 MiB of weights in ``fmt``
    (``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"q4g64-bfloat16"`` style)."""
    root = cache_dir("calibration")
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
    return calibrate_machine(format_of(budget) if budget else "bfloat16", force=force)


def cached_calibration(path_or_config, budget: ModelBudget,
                       strategy: str = "mmap") -> Optional[Calibration]:
    """The cached calibration :func:`calibrate` would return, without measuring."""
    if not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            cal = load_calibration(_model_key(p, strategy))
            if cal is not None:
                return cal
    return load_calibration(_machine_key(format_of(budget), cache_dir("calibration")))
