"""Calibration: the measured constants of the cost model, from a checkpoint or the machine."""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from .._util.fs import cache_dir
from ..io.checkpoint import Checkpoint
from ..io.pagecache import evict, warm
from ..io.readers import MmapReader
from ..kernels import effective_choice
from ..kernels import installed as installed_kernels
from ..loading import load_model
from ..streaming import StreamOptions, controller_of
from .budget import ModelBudget, model_budget
from .calibration_cache import CONTENDED_LIFETIME_S, load_calibration, save_calibration
from .cost import Calibration, fit_stream_bandwidth
from .formats import compute_format
from .machine import (
    calibrate_machine,
    conditions,
    contention,
    default_format,
    judge,
    machine_key,
    timed,
)

__all__ = ["CONTENDED_LIFETIME_S", "Calibration", "cached_calibration", "calibrate",
           "calibrate_loaded", "calibrate_machine", "calibrate_model", "conditions",
           "contention", "decode_steps", "format_of", "load_calibration", "prefill_time"]


def _model_key(path: Path, strategy: str, kernels: str) -> str:
    ckpt = Checkpoint(path)
    h = hashlib.sha256()
    for f in ckpt.files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(strategy.encode())
    h.update(f"kernels={kernels}".encode())
    return "model-" + h.hexdigest()[:16]


def _measure_reads(ckpt, groups: list[list[str]],
                   evict_files: bool = True) -> tuple[float, float]:
    """Cold exact-range reads: (bytes per second, seconds per byte of dropping them)."""
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
    """Greedy decode of ``n`` tokens: (prefill seconds, per-step seconds, tokens)."""
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
    """Median seconds of one forward pass over ``prompt`` with a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    def once():
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=cache), [c.state for c in cache])

    once()  # warm-up
    return statistics.median(timed(once) for _ in range(repeats))


def calibrate_model(path, *, strategy: str = "mmap", tokens: int = 5,
                    prefill_tokens: int = 16, force: bool = False,
                    kernels: str | None = None) -> Calibration:
    """Loads ``path`` all-resident and runs :func:`calibrate_loaded` (cached on disk)."""
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
    return save_calibration(judge(cal, before, stable=True))


def calibrate_loaded(model, path, *, tokens: int = 5, prefill_tokens: int = 16,
                     key: str | None = None) -> Calibration:
    """Measures the cost model on a loaded model (resident set restored); not cached."""
    ctl = controller_of(model)
    lay = ctl.layout
    n = len(lay.layers)
    before = set(lay.resident)
    budget = model_budget(path)
    prompt = [(7 * i + 3) % (budget.vocab_size or 256) for i in range(max(prefill_tokens, 8))]
    short = prompt[:8]

    def step_s(warm_up: list[int], warm_steps: int) -> float:
        """Median decode step over ``short`` after a warm-up."""
        decode_steps(model, warm_up, warm_steps)
        return statistics.median(decode_steps(model, short, tokens)[1])

    try:
        ctl.admit(range(n))
        t_res = step_s(short, 2)
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
            t_warm = step_s(short, 1)
        finally:
            ctl.keep_page_cache = keep
            evict(ctl.checkpoint.files)
        units = len(lay.units)
        # Everything streamed from disk: how much of the reads hid behind compute.
        t_cold = step_s(short[:4], 1)
    finally:
        ctl.admit(before)
        ctl.shed(set(range(n)) - before)
    k = t_res / budget.compute_bytes
    o = max(0.0, (t_warm - t_res) / max(units, 1))
    kernels = installed_kernels(model)
    stream_bw = fit_stream_bandwidth(budget, k, o, drop, bw, t_cold, ctl.depth)
    return Calibration(
        disk_bytes_per_s=bw, decode_s_per_byte=k, stream_bytes_per_s=stream_bw,
        release_s_per_byte=drop,
        prefill_s_per_byte_token=t_prefill / (budget.compute_bytes * prefill_tokens),
        unit_overhead_s=o,
        prefill_tokens=prefill_tokens, source="model",
        key=key or _model_key(Path(path), ctl.strategy, kernels),
        detail={"path": str(path), "t_resident_s": t_res, "t_warm_streamed_s": t_warm,
                "t_cold_streamed_s": t_cold, "t_prefill_s": t_prefill, "units": units,
                "strategy": ctl.strategy, "prefetch": ctl.depth, "kernels": kernels})


#: The machine calibration's :class:`.formats.ComputeFormat` for a model.
format_of = compute_format


def calibrate(path_or_config=None, *, force: bool = False, strategy: str = "mmap",
              budget: ModelBudget | None = None,
              kernels: str | None = None) -> Calibration:
    """The checkpoint's own calibration, else the machine's; cached unless ``force``."""
    if path_or_config is not None and not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            return calibrate_model(p, strategy=strategy, force=force, kernels=kernels)
    if budget is None:
        budget = model_budget(path_or_config) if path_or_config is not None else None
    return calibrate_machine(format_of(budget, path_or_config, kernels) if budget
                             else default_format(kernels), force=force)


def cached_calibration(path_or_config, budget: ModelBudget, strategy: str = "mmap",
                       kernels: str | None = None) -> Calibration | None:
    """The cached calibration :func:`calibrate` would return, without measuring."""
    if not isinstance(path_or_config, dict):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")) and (
                cal := load_calibration(_model_key(p, strategy, effective_choice(kernels)))):
            return cal
    return load_calibration(machine_key(format_of(budget, path_or_config, kernels),
                                         cache_dir("calibration")))
