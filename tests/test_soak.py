"""Soak: streamed generation for a long time with stable memory and speed.

Behind the ``soak`` marker (excluded by default):

    PYLOADER_SOAK_SECONDS=1800 pytest -m soak -s tests/test_soak.py

A ~400 MB bf16 llama (benchlib.synthetic) streams half its layers from
the mapping with one unit of prefetch, and generates 32-token continuations
of a fixed prompt back to back. Each window (a tenth of the run) records
RSS, anonymous RSS, MLX active memory and tokens/s. After the first window
(warm-up), RSS and anonymous RSS must stay within 64 MiB of their first
value, the later half's median tokens/s must stay above 70% of the earlier
half's, and every continuation must be the same tokens.
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import pyloader
from proc_files import require_proc
from benchlib.synthetic import make_model

MIB = 1 << 20


def _status() -> dict[str, int]:
    require_proc("/proc/self/status")
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon"):
                out[k] = int(v.split()[0]) * 1024
    return out


@pytest.mark.soak
@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_streamed_generation_soak(tmp_path_factory, strategy):
    seconds = float(os.environ.get("PYLOADER_SOAK_SECONDS", "1800"))
    path = make_model(tmp_path_factory.mktemp("soak"), 400_000_000)
    model, _ = pyloader.load_model(path, resident=0.5,
                                   options=pyloader.StreamOptions(strategy=strategy, prefetch=1))
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8])
    first = None
    windows = []
    t_end = time.perf_counter() + seconds
    window = seconds / 10
    while time.perf_counter() < t_end:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < window:
            toks = [int(t) for t, _ in generate_step(prompt, model, max_tokens=32)]
            first = first or toks
            assert toks == first
            n += len(toks)
        st = _status()
        windows.append({"tok_s": n / (time.perf_counter() - t0), "rss": st["VmRSS"],
                        "anon": st["RssAnon"], "mlx_active": mx.get_active_memory()})
        print(f"window {len(windows)}: {windows[-1]['tok_s']:.1f} tok/s, "
              f"RSS {windows[-1]['rss'] / MIB:.0f} MiB, anon {windows[-1]['anon'] / MIB:.0f} MiB, "
              f"MLX active {windows[-1]['mlx_active'] / MIB:.0f} MiB", flush=True)
    steady = windows[1:]
    assert len(steady) >= 4
    ref = steady[0]
    for w in steady:
        assert abs(w["rss"] - ref["rss"]) < 64 * MIB, windows
        assert abs(w["anon"] - ref["anon"]) < 64 * MIB, windows
    # Speed as a trend: the later half's median against the earlier half's
    # (one window can dip when other jobs share the CPU).
    half = len(steady) // 2
    early = statistics.median(w["tok_s"] for w in steady[:half])
    late = statistics.median(w["tok_s"] for w in steady[half:])
    assert late > 0.7 * early, windows
    print(f"{strategy}: {len(windows)} windows of {window:.0f}s, median "
          f"{statistics.median(w['tok_s'] for w in steady):.1f} tok/s, RSS range "
          f"{(max(w['rss'] for w in steady) - min(w['rss'] for w in steady)) / MIB:.1f} MiB")
