"""Fixtures of the load benchmark: the synthetic checkpoints, built once.

Page-cache control and measuring children come from pyloader's pytest plugin
(``page_cache``, ``isolated``: :mod:`pyloader.testing`, loaded here).
``--page-cache=cold`` or ``warm`` keeps only the cases of that state: the plugin's marked
tests, and here also every case with a ``cache`` parameter.

Settings (environment):
    PYLOADER_BENCH_SIZE    size of the synthetic checkpoints (default 1GiB)
    PYLOADER_BENCH_ROUNDS  rounds per benchmark, each in a fresh process (default 3)
    PYLOADER_CACHE         where the checkpoints are cached (default ~/.cache/pyloader)
"""

from __future__ import annotations

import os

import pytest

from pyloader.cli.common import parse_size
from benchlib.synthetic import synthetic_pair

pytest_plugins = ["pyloader.testing"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """The default model's GGUF, fetched once when it is missing (as ``pyloader compare``
    does; the library itself never downloads): many tests run the default model."""
    from pyloader.cli.fetch_model import ensure_default_model_for_tests

    ensure_default_model_for_tests()


@pytest.hookimpl(optionalhook=True)  # a pytest-benchmark hook: absent without it
def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    """The load average beside pytest-benchmark's machine description: the results page
    prints it with every table."""
    if hasattr(os, "getloadavg"):
        machine_info["loadavg"] = list(os.getloadavg())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--page-cache=cold|warm`` deselects the cases whose ``cache`` parameter differs."""
    choice = config.getoption("--page-cache")
    if choice == "both":
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if params.get("cache", choice) != choice else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
