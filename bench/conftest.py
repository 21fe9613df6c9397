"""Fixtures of the load benchmark: the synthetic checkpoints, built once.

Settings (environment):
    PYLOADER_BENCH_SIZE    size of the synthetic checkpoints (default 1GiB)
    PYLOADER_BENCH_ROUNDS  rounds per benchmark, each in a fresh process (default 3)
    PYLOADER_CACHE         where the checkpoints are cached (default ~/.cache/pyloader)
"""

from __future__ import annotations

import os

import pytest

from pyloader.bench.synthetic import synthetic_pair
from pyloader.cli.common import parse_size


@pytest.fixture(scope="session")
def bench_rounds() -> int:
    """Rounds per benchmark (``PYLOADER_BENCH_ROUNDS``, default 3)."""
    rounds = int(os.environ.get("PYLOADER_BENCH_ROUNDS", "3"))
    if rounds < 1:
        raise pytest.UsageError("PYLOADER_BENCH_ROUNDS must be at least 1")
    return rounds


@pytest.fixture(scope="session")
def synthetic_checkpoints() -> dict[str, str]:
    """``{"aligned": path, "mlx-written": path}``: one model written by
    safetensors (aligned) and by mx.save_safetensors (misaligned)."""
    pair = synthetic_pair(parse_size(os.environ.get("PYLOADER_BENCH_SIZE", "1GiB")))
    return {"aligned": pair["safetensors"], "mlx-written": pair["mlx"]}
