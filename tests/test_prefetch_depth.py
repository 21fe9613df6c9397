"""``prefetch="auto"`` (the default): the depth the streamed units' sizes want, lowered to
what fits the memory headroom (pyloader.streaming.depth); tokens never change with it."""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import pyloader
from models import make_model_dir
from pyloader._util.memory import MemorySnapshot
from pyloader.streaming import controller as controller_mod
from pyloader.streaming import controller_of
from pyloader.streaming.depth import (
    MAX_DEPTH, check_prefetch, fit_depth, planning_depth, prefetch_arg, wanted_depth)
from pyloader.streaming.preflight import need_of

PROMPT = [1, 7, 42, 3, 99]


def greedy(model) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("depth") / "llama", "llama",
                          num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(llama):
    model, _ = mlx_lm_load_model(llama)
    return greedy(model)


def with_available(monkeypatch, nbytes: int) -> None:
    """Pretend MemAvailable is ``nbytes`` (no cgroup) for the controller."""
    monkeypatch.setattr(controller_mod, "read_memory",
                        lambda: MemorySnapshot(time=time.time(), mem_available=nbytes))


def test_wanted_depth():
    assert wanted_depth([5, 5, 5, 5]) == 1           # equal units: one ahead hides them
    assert wanted_depth([1, 2, 1, 2, 1, 2]) == 2     # attention, MLP, ...: two ahead
    assert wanted_depth([2, 1, 2, 1]) == 2
    assert wanted_depth([3, 1, 1, 3, 1, 1]) == 3     # the 3 needs the next three units
    assert wanted_depth([1, 1, 1, 1, 1, 10]) == MAX_DEPTH  # capped
    assert wanted_depth([1, 10]) == 2                # at most the number of units
    assert wanted_depth([7]) == 1
    assert wanted_depth([]) == 1


def test_fit_depth():
    assert fit_depth(3, lambda d: True) == 3
    assert fit_depth(3, lambda d: d <= 1) == 1
    assert fit_depth(2, lambda d: d == 0) == 0
    assert fit_depth(2, lambda d: False) == 1        # the pre-flight then refuses
    assert fit_depth(0, lambda d: False) == 0


def test_prefetch_settings_are_checked():
    for ok in ("auto", 0, 1, 3):
        check_prefetch(ok)
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="prefetch must be 'auto' or an int >= 0"):
            check_prefetch(bad)
    assert prefetch_arg("auto") == "auto" and prefetch_arg("2") == 2
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            prefetch_arg(bad)
    assert planning_depth("auto") == 1 and planning_depth(3) == 3


def test_load_model_rejects_a_bad_prefetch(llama):
    with pytest.raises(ValueError, match="prefetch must be"):
        pyloader.load_model(llama, resident=0, tokenizer=False,
                            options=pyloader.StreamOptions(prefetch=-1))


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
@pytest.mark.parametrize("granularity,depth", [("layer", 1), ("sublayer", 2)])
def test_auto_depth_follows_the_units(llama, reference, strategy, granularity, depth):
    """Equal layers want one unit ahead; attention/MLP blocks (the MLP twice the
    attention's bytes here) want two. The tokens are mlx-lm's either way."""
    model, _ = pyloader.load_model(
        llama, resident=0, tokenizer=False,
        options=pyloader.StreamOptions(strategy=strategy, granularity=granularity))
    st = pyloader.stats(model)
    assert (st["prefetch"], st["prefetch_setting"]) == (depth, "auto")
    assert greedy(model) == reference
    assert pyloader.stats(model)["units"]  # it streamed
    explicit, _ = pyloader.load_model(
        llama, resident=0, tokenizer=False,
        options=pyloader.StreamOptions(strategy=strategy, granularity=granularity, prefetch=3))
    assert pyloader.stats(explicit)["prefetch"] == 3  # an explicit depth is kept


def pread_need(path, units, depth: int) -> int:
    """The pre-flight's total for pread at 0% resident, with every tensor outside the
    units counted resident (a few bytes more than the controller counts: norms)."""
    inside = {t.name for u in units for t in u.sources.values()}
    resident = [t for t in pyloader.open(path).tensors() if t.name not in inside]
    return need_of("pread", resident, [list(u.sources.values()) for u in units],
                   depth).total


def test_auto_depth_shrinks_to_the_headroom(llama, reference, monkeypatch):
    model, _ = pyloader.load_model(
        llama, resident=0, tokenizer=False,
        options=pyloader.StreamOptions(strategy="pread", granularity="sublayer"))
    units = controller_of(model).layout.units
    assert pyloader.stats(model)["prefetch"] == 2
    for room, depth in ((pread_need(llama, units, 1), 1), (pread_need(llama, units, 0), 0)):
        with_available(monkeypatch, room)
        tight, _ = pyloader.load_model(
            llama, resident=0, tokenizer=False,
            options=pyloader.StreamOptions(strategy="pread", granularity="sublayer"))
        assert pyloader.stats(tight)["prefetch"] == depth
        assert greedy(tight) == reference
    # An explicit depth is not lowered: the pre-flight refuses it and names one that fits.
    with_available(monkeypatch, pread_need(llama, units, 1))
    with pytest.raises(MemoryError, match="prefetch=1"):
        pyloader.load_model(
            llama, resident=0, tokenizer=False,
            options=pyloader.StreamOptions(strategy="pread", granularity="sublayer", prefetch=2))
