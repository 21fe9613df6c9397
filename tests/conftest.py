"""Shared fixtures: small real checkpoints built once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import MLX_DTYPES, random_array

pytest_plugins = ["pyloader.testing"]

# The suite checks pyloader's loading and streaming against mlx-lm bit for bit, so
# load_model runs MLX's own kernels here (and in every subprocess a test starts);
# tests/test_kernels.py asks for pyloader's CPU kernels by name.
os.environ.setdefault("PYLOADER_KERNELS", "mlx")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The default model's GGUF, fetched once when it is missing (as ``pyloader compare``
    does; the library itself never downloads): many tests run the default model."""
    from pyloader.cli.fetch_model import ensure_default_model_for_tests

    ensure_default_model_for_tests()


@pytest.fixture(autouse=True)
def _mlx_task_count(request):
    """Every test leaves MLX's count of active tasks at zero: a failed task can leave it too
    high (csrc/mlxio/task_count.h), and tests that make tasks fail on purpose would add
    up over the session until an eval waits forever. ``$PYLOADER_TASK_LEAK_LOG`` names
    the tests that left it high."""
    import sys

    from pyloader._native import core

    yield
    if "mlx_lm.generate" in sys.modules:  # its own stream: what runs there counts too
        mx.synchronize(sys.modules["mlx_lm.generate"].generation_stream)
    released = core.release_leaked_tasks()
    if released and (log := os.environ.get("PYLOADER_TASK_LEAK_LOG")):
        with open(log, "a") as f:
            f.write(f"{request.node.nodeid} {released}\n")


@pytest.fixture(scope="session")
def all_dtypes_file(tmp_path_factory) -> Path:
    """Every MLX dtype at several shapes (scalar, empty, 1-D, 3-D), plus
    metadata, written by mx.save_safetensors (so offsets are often misaligned)."""
    rng = np.random.default_rng(0)
    arrays = {}
    for st_name, dt in MLX_DTYPES:
        for shape in [(), (0,), (3, 0, 2), (7,), (4, 5, 3)]:
            arrays[f"{st_name}.{'x'.join(map(str, shape)) or 'scalar'}"] = random_array(rng, dt, shape)
    path = tmp_path_factory.mktemp("dtypes") / "all.safetensors"
    mx.save_safetensors(str(path), arrays, metadata={"format": "test", "note": "ünïcode"})
    return path


@pytest.fixture(scope="session")
def aligned_file(tmp_path_factory) -> Path:
    """Tensors written by the safetensors library (8-byte padded header, so
    every tensor is aligned for dtypes up to 8 bytes)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    tensors = {
        "f32": rng.standard_normal((256, 512)).astype(np.float32),
        "f16": rng.standard_normal((3, 1000)).astype(np.float16),
        "i64": rng.integers(-(1 << 60), 1 << 60, size=(17,), dtype=np.int64),
        "u8": rng.integers(0, 255, size=(1001,), dtype=np.uint8),
        "bool": rng.integers(0, 2, size=(9,)).astype(np.bool_),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    path = tmp_path_factory.mktemp("aligned") / "model.safetensors"
    save_file(tensors, str(path), metadata={"who": "safetensors"})
    return path


@pytest.fixture(scope="session")
def large_file(tmp_path_factory) -> Path:
    """A 64 MiB checkpoint of aligned float32 tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(2)
    tensors = {f"layers.{i}.w": rng.standard_normal((1024, 2048)).astype(np.float32)
               for i in range(8)}
    path = tmp_path_factory.mktemp("large") / "large.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="session")
def sharded_dir(tmp_path_factory, all_dtypes_file) -> Path:
    """The all-dtypes tensors split over three shards with an index."""
    src = mx.load(str(all_dtypes_file))
    names = sorted(src)
    d = tmp_path_factory.mktemp("sharded")
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: src[n] for n in names[i::3]}
        mx.save_safetensors(str(d / shard), part)
        weight_map.update({n: shard for n in part})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return d
