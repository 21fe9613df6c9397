"""``resident="auto"``: budgets from each process's headroom, gathered across the ranks.

In-process: the ``PYLOADER_HEADROOM`` clamp, the gathered check's rule and message, a
size-1 group and a plain load. On loopback (two ranks, ``auto_rank.py``), each rank
clamped to its own headroom: both ranks choose the same pipeline split (not the even
one), their resident sets follow their own budgets under both shard modes, the tokens
are those of the fixed run, and a rank that cannot fit makes both ranks raise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import launch_two, mlx_launcher
from models import make_model_dir

import pyloader
from pyloader._util import memory
from pyloader.distributed import (
    RankMemory,
    check_memory,
    checkpoint_layer_bytes,
    even_split,
    least_need,
    plan_split,
    propose_split,
    rank_stats,
)
from pyloader.streaming.preflight import RESERVE, auto_budget

N_LAYERS = 8
SIZES = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": N_LAYERS}
N_TOKENS = 6
AUTO_RANK = Path(__file__).with_name("auto_rank.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("auto") / "m", "llama", **SIZES)


def test_headroom_clamp(monkeypatch):
    monkeypatch.setenv(memory.HEADROOM_ENV, "300MB")
    snap = memory.read_memory()
    assert snap.clamp == 300_000_000
    assert memory.headroom_of(snap, page_cache="used") <= 300_000_000
    assert auto_budget(snap) == memory.headroom_of(snap, page_cache="used") - RESERVE
    clamped = memory.MemorySnapshot(time=0, mem_available=10**12, clamp=5000)
    assert memory.headroom_of(clamped, page_cache="reclaimable") == 5000
    assert memory.limiting_probe(clamped, page_cache="used") == "PYLOADER_HEADROOM=5000"
    monkeypatch.setenv(memory.HEADROOM_ENV, "lots")
    with pytest.raises(ValueError, match="PYLOADER_HEADROOM: cannot parse byte size 'lots'"):
        memory.read_memory()


def test_least_need_and_check():
    assert least_need([10, 30, 20], 5, prefetch=1) == 5 + 60        # two units in flight
    assert least_need([10, 30, 20], 5, prefetch=2) == 5 + 60        # every layer is less
    assert least_need([], 5, prefetch=1) == 5
    fits = [RankMemory(0, budget=100, need=100), RankMemory(1, budget=10**9, need=7)]
    check_memory(fits, "m")
    short = [fits[1], RankMemory(1, budget=99, need=100), RankMemory(2, budget=0, need=1)]
    with pytest.raises(MemoryError, match=r"^rank 1: m with resident='auto' needs at least "
                                          r"167\.77 MB .* headroom is 167\.77 MB; nothing was "
                                          r"loaded on any rank \(rank 1: .*rank 2: "):
        check_memory(short, "m")


def test_one_process(model_dir, monkeypatch):
    """A size-1 group and a plain load: the budget is this process's headroom."""
    layer_bytes, fixed = checkpoint_layer_bytes(model_dir)
    group = mx.distributed.init()
    model, _ = pyloader.load_model(model_dir, group=group, resident="auto", tokenizer=False)
    st = rank_stats(model)
    assert st["split"] == [N_LAYERS] and st["streamed_bytes_per_pass"] == 0
    assert st["auto"]["ranks"][0]["need"] == least_need(layer_bytes, fixed, 1)
    # Room for the non-layer tensors, two layers' buffers and three layers.
    monkeypatch.setenv(memory.HEADROOM_ENV,
                       str(RESERVE + fixed + 2 * max(layer_bytes) + 3 * layer_bytes[0] + 100))
    for kwargs in ({}, {"group": group}):
        model, _ = pyloader.load_model(model_dir, resident="auto", tokenizer=False, **kwargs)
        assert pyloader.stats(model)["resident_layers"] == [0, 1, 2], kwargs
    monkeypatch.setenv(memory.HEADROOM_ENV, str(RESERVE + fixed))
    with pytest.raises(MemoryError, match="rank 0: a pipeline split with resident='auto'"):
        pyloader.load_model(model_dir, group=group, resident="auto", tokenizer=False)
    with pytest.raises(MemoryError, match="rank 0: a tensor share with resident='auto'"):
        pyloader.load_model(model_dir, group=pyloader.Distribution(group, shard="tensor"),
                            resident="auto", tokenizer=False)
    with pytest.raises(ValueError, match="pass it alone"):
        pyloader.load_model(model_dir, group=group, resident=["auto"], tokenizer=False)
    with pytest.raises(ValueError, match=r"resident=\[1.0, 0.5\]: with shard='tensor' every "
                                         "rank must stream the same layers"):
        pyloader.load_model(model_dir, group=pyloader.Distribution(group, shard="tensor"),
                            resident=[1.0, 0.5])
    with pytest.raises(ValueError, match="pass group="):
        plan_split(model_dir, "auto")


# ----------------------------------------------------------------------------
# Two ranks on loopback


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, model_dir):
    launcher = mlx_launcher()
    root = tmp_path_factory.mktemp("auto-ranks")
    for r in (0, 1):
        shutil.copytree(model_dir, root / f"rank{r}")
    layer_bytes, fixed = checkpoint_layer_bytes(model_dir)
    # Rank 0 unclamped; rank 1 with room for its non-layer tensors and 2.5 layers (two
    # taken by streaming buffers once anything streams); then rank 1 short of its
    # non-layer tensors.
    small = RESERVE + fixed + 5 * max(layer_bytes) // 2
    out = root / "out"
    out.mkdir()
    cmd = launch_two(launcher, [sys.executable, str(AUTO_RANK), str(root / "rank{rank}"),
                                str(out), str(N_TOKENS), "-", str(small),
                                str(RESERVE + fixed // 2)])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root,
                          check=False)
    # mlx.launch exits 0 when a rank fails: its result file is the evidence.
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert proc.returncode == 0 and all(f.exists() for f in files), proc.stdout + proc.stderr
    return [json.loads(f.read_text()) for f in files]


def test_pipeline_split_from_gathered_budgets(ranks, model_dir):
    auto = [r["pipeline"]["auto"]["stats"] for r in ranks]
    # Every rank computed the split from the same gathered numbers.
    assert auto[0]["split"] == auto[1]["split"] and auto[0]["auto"]["ranks"] == \
        auto[1]["auto"]["ranks"]
    split = auto[0]["split"]
    assert sum(split) == N_LAYERS and split != even_split(N_LAYERS, 2)
    assert split[1] < split[0]  # rank 1 has the smaller budget: fewer layers
    budgets = [m["budget"] for m in auto[0]["auto"]["ranks"]]
    assert [a["auto"]["budget"] for a in auto] == budgets and budgets[1] < budgets[0]
    # The split propose_split makes of the gathered budgets: rank 1 gets what its
    # budget holds resident (streaming costs more than the other rank's compute).
    layer_bytes, fixed = checkpoint_layer_bytes(model_dir)
    assert split == propose_split(layer_bytes, budgets, fixed_bytes=fixed).split
    assert [len(a["resident_layers"]) for a in auto] == split
    assert fixed + split[1] * max(layer_bytes) <= budgets[1]
    for r in ranks:  # the same computation, layer for layer: bit for bit
        assert r["pipeline"]["auto"]["logits"] == r["pipeline"]["fixed"]["logits"]
        assert r["pipeline"]["auto"]["tokens"] == r["pipeline"]["fixed"]["tokens"]
        assert r["pipeline"]["fixed"]["stats"]["split"] == even_split(N_LAYERS, 2)


def test_pipeline_ranks_stream_their_own_layers(ranks):
    """Per-rank resident sets: rank 1 streams its last layer, whose stage hook sends and
    gathers outside the streamed unit (the same collectives as rank 0 runs)."""
    mixed = [r["pipeline"]["mixed"] for r in ranks]
    assert mixed[0]["stats"]["streamed_bytes_per_pass"] == 0
    assert mixed[1]["stats"]["streamed_bytes_per_pass"] > 0
    for r, m in zip(ranks, mixed):
        assert m["logits"] == r["pipeline"]["fixed"]["logits"]
        assert m["tokens"] == r["pipeline"]["fixed"]["tokens"]


def test_tensor_ranks_stream_the_same_layers(ranks):
    """Tensor ranks run every layer in lockstep: the smallest rank's budget on both."""
    auto = [r["tensor"]["auto"]["stats"] for r in ranks]
    gathered = auto[0]["auto"]["ranks"]
    assert auto[1]["auto"]["ranks"] == gathered
    smallest = min(m["budget"] for m in gathered)
    assert [a["auto"]["budget"] for a in auto] == [smallest] * 2
    assert auto[0]["resident_layers"] == auto[1]["resident_layers"]
    assert 0 < len(auto[1]["resident_layers"]) < N_LAYERS
    # Its share is half of each layer: the streaming buffers of half a layer.
    piped = ranks[1]["pipeline"]["auto"]["stats"]
    assert gathered[1]["need"] < piped["auto"]["ranks"][1]["need"]
    assert smallest == piped["auto"]["budget"]
    for r in ranks:
        assert r["tensor"]["auto"]["logits"] == r["tensor"]["fixed"]["logits"]
        assert r["tensor"]["auto"]["tokens"] == r["tensor"]["fixed"]["tokens"]


def test_a_rank_that_cannot_fit_stops_every_rank(ranks):
    for r in ranks:
        for shard in ("pipeline", "tensor"):
            msg = r[shard]["short"]
            assert msg is not None and msg.startswith("rank 1: "), (r["rank"], shard, msg)
            assert "nothing was loaded on any rank" in msg
        # The same message on both ranks (from the gathered values).
        assert r["pipeline"]["short"] == ranks[0]["pipeline"]["short"]
