"""load_model's pre-flight: a load that cannot fit in the memory this process can still
commit is a MemoryError before anything is read, naming what is needed, what is
available and settings that fit (the real thing under a memory cgroup:
tests/test_memory_limit.py)."""

from __future__ import annotations

import shutil
import time

import mlx.core as mx
import pytest

import pyloader
from models import make_model_dir
from pyloader.io.repack import repack
from pyloader.streaming import controller as controller_mod
from pyloader.streaming import reads as reads_mod
from pyloader.streaming.preflight import RESERVE, MemoryNeed, copied_bytes, need_of
from pyloader._util.memory import MemorySnapshot


@pytest.fixture(scope="module")
def aligned_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    src = make_model_dir(root / "src", "llama", dtype=mx.bfloat16, num_hidden_layers=6)
    dst = root / "aligned"
    repack(src, dst)  # every tensor zero-copy: mmap needs no anonymous weights
    shutil.rmtree(src)
    return dst


def with_available(monkeypatch, nbytes: int) -> None:
    """Pretend MemAvailable is ``nbytes`` (no cgroup)."""
    monkeypatch.setattr(controller_mod, "read_memory",
                        lambda: MemorySnapshot(time=time.time(), mem_available=nbytes))


def refuse_reads(monkeypatch) -> None:
    """Fail the test if a load starts reading weights (the pre-flight must come first)."""
    def boom(*args, **kwargs):
        raise AssertionError("weights were read before the pre-flight refused the load")

    for cls in (reads_mod.MmapReads, reads_mod.PreadReads):
        monkeypatch.setattr(cls, "initial_weights", boom)


def test_need_counts_what_each_strategy_copies():
    class T:
        def __init__(self, nbytes, aligned):
            self.nbytes, self.aligned = nbytes, aligned

    resident = [T(100, True), T(10, False)]
    units = [[T(50, True), T(5, False)], [T(70, True)], [T(20, False)]]
    pread = need_of("pread", resident, units, depth=1, derived=3, experts=7)
    assert (pread.weights, pread.buffers, pread.experts) == (113, 125, 7)  # 70 + 55
    mmap = need_of("mmap", resident, units, depth=1)
    assert (mmap.weights, mmap.buffers) == (10, 25)  # only the misaligned: 20 + 5
    assert pread.total == 113 + 125 + 7 + RESERVE
    assert copied_bytes("mmap", [T(4, True)]) == 0
    assert need_of("pread", [], units, depth=0).buffers == 70  # one unit, the largest
    text = MemoryNeed("pread", 10**8, 2 * 10**7, 0).describe()
    assert "resident weights 100.00 MB" in text and "streaming buffers 20.00 MB" in text


def split_bytes(path) -> tuple[int, list[int]]:
    """(non-layer bytes, each layer's bytes)."""
    from pyloader._util.names import layer_of

    layers: dict[int, int] = {}
    fixed = 0
    for t in pyloader.open(path).tensors():
        i = layer_of(t.name)
        if i is None:
            fixed += t.nbytes
        else:
            layers[i] = layers.get(i, 0) + t.nbytes
    return fixed, [layers[i] for i in sorted(layers)]


def test_pread_that_cannot_fit_names_mmap_and_a_budget(aligned_model, monkeypatch):
    fixed, layers = split_bytes(aligned_model)
    assert len(layers) >= 4
    # Room for the non-layer weights, two units in flight and one resident layer (and
    # the reserve): not for every layer.
    available = RESERVE + fixed + 3 * max(layers)
    with_available(monkeypatch, available)
    refuse_reads(monkeypatch)
    with pytest.raises(MemoryError) as err:
        pyloader.load_model(aligned_model, tokenizer=False,
                            options=pyloader.StreamOptions(strategy="pread"))
    msg = str(err.value)
    assert str(aligned_model) in msg and "strategy='pread'" in msg
    assert "nothing was loaded" in msg and "MemAvailable" in msg
    assert "strategy='mmap'" in msg and "resident='" in msg
    budget = msg.split("resident='")[1].split("'")[0]
    monkeypatch.undo()
    # The suggested budget passes the same pre-flight and loads.
    with_available(monkeypatch, available)
    model, _ = pyloader.load_model(aligned_model, resident=budget, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="pread"))
    assert len(pyloader.stats(model)["resident_layers"]) < len(model.layers)


def test_nothing_fits_says_so(aligned_model, monkeypatch):
    with_available(monkeypatch, RESERVE // 2)
    refuse_reads(monkeypatch)
    for strategy in ("mmap", "pread"):
        with pytest.raises(MemoryError, match="No setting of this model fits"):
            pyloader.load_model(aligned_model, resident=0, tokenizer=False,
                                options=pyloader.StreamOptions(strategy=strategy))


def test_mmap_of_an_aligned_model_needs_only_the_reserve(aligned_model, monkeypatch):
    """Zero-copy views are page cache, which the kernel can reclaim: an aligned model
    loads resident with mmap where a fraction of its size is available."""
    with_available(monkeypatch, RESERVE + (1 << 20))
    model, _ = pyloader.load_model(aligned_model, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="mmap"))
    assert len(pyloader.stats(model)["resident_layers"]) == len(model.layers)
