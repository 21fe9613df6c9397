"""No leaked descriptors, mappings, threads or MLX memory after many
load/drop cycles and streamed generations; concurrent loads from several
Python threads give the right bytes."""

from __future__ import annotations

import gc
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import pyloader
from helpers import tensor_bytes
from models import make_model_dir
from proc_files import require_proc

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]


def resources(root: Path) -> dict:
    """Descriptors and mappings of files under `root`; this process's threads."""
    require_proc("/proc/self/fd", "/proc/self/maps", "/proc/self/task")
    root_s = str(root)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(root_s)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(root_s in line for line in f)
    return {"fds": fds, "maps": maps, "threads": len(os.listdir("/proc/self/task")),
            "total_fds": len(os.listdir("/proc/self/fd")),
            "mlx_active": mx.get_active_memory()}


def settle() -> None:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def test_load_drop_cycles(aligned_file):
    root = aligned_file.parent

    def cycle():
        for strategy in ("mmap", "pread"):
            arrays = pyloader.load(aligned_file, strategy=strategy)
            mx.eval(list(arrays.values()))
            del arrays
        r = pyloader.MmapReader(aligned_file)
        r.wait(r.prefetch(["f32", "u8"]))
        a = r.get("f32")
        r.close()
        mx.eval(a + 1)
        del a, r

    for _ in range(10):  # MLX's own threads and caches exist before the baseline
        cycle()
    settle()
    base = resources(root)
    during = None
    for i in range(1000):
        cycle()
        if i == 500:
            r = pyloader.MmapReader(aligned_file)
            keep = r.load()
            during = resources(root)
            del keep, r
    settle()
    after = resources(root)
    print(f"1000 load/drop cycles: before {base}, mid-cycle {during}, after {after}")
    assert during["maps"] > base["maps"] and during["fds"] > base["fds"]  # the probe sees them
    assert after == base


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_streamed_generations(tmp_path, strategy):
    path = make_model_dir(tmp_path / "m", "llama")
    base_model, _ = mlx_lm_load_model(path)
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT), base_model, max_tokens=8)]
    del base_model
    settle()
    base = resources(path)
    model, _ = pyloader.load_model(path, resident=0.5,
                                   options=pyloader.StreamOptions(strategy=strategy, prefetch=1))
    with_model = None
    for i in range(100):
        got = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]
        assert got == ref, f"generation {i}"
        if i == 0:
            settle()
            with_model = resources(path)
        if i == 99:
            settle()
            assert resources(path) == with_model, "resources grew over 100 generations"
    assert pyloader.stats(model)["passes"] >= 100 * 8
    del model
    # Load/drop cycles of the streamed model itself.
    for _ in range(20):
        model, _ = pyloader.load_model(
            path, resident=0, options=pyloader.StreamOptions(strategy=strategy, prefetch=2))
        next(generate_step(mx.array(PROMPT), model, max_tokens=1))
        del model
    settle()
    after = resources(path)
    print(f"{strategy}: before {base}, with model {with_model}, after {after}")
    assert with_model["threads"] > base["threads"]  # the model's prefetch threads were seen
    assert after == base


def test_concurrent_loads_from_python_threads(tmp_path, aligned_file, large_file):
    files = [aligned_file, large_file]
    ref = {f: {k: tensor_bytes(v) for k, v in mx.load(str(f)).items()} for f in files}

    def job(i: int) -> int:
        f = files[i % 2]
        strategy = ("mmap", "pread")[(i // 2) % 2]
        if i % 3 == 0:
            names = sorted(ref[f])[: 1 + i % len(ref[f])]
            arrays = pyloader.load(f, strategy=strategy, names=names)
        else:
            arrays = pyloader.load(f, strategy=strategy)
        for k, a in arrays.items():
            assert tensor_bytes(a) == ref[f][k], (f, strategy, k)
        return len(arrays)

    with ThreadPoolExecutor(6) as pool:
        counts = list(pool.map(job, range(60)))
    assert sum(counts) > 60
