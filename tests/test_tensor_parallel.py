"""Tensor-parallel loading: ``load_model(path, group=Distribution(g, shard="tensor"))``.

In-process tests trace mlx-lm's ``model.shard`` for each rank of a two-rank group (a
stand-in group object: sharding only asks it for its rank and size) and compare what the
readers serve with mlx-lm's own sharded parameters, bit for bit. The loopback tests run
two ranks (``mlx.launch --backend ring -n 2``, ``tp_rank.py``), each on its own copy of
the checkpoint: greedy tokens against single-process mlx-lm and mlx-lm's
``sharded_load(tensor_group=)``, and each rank's reader counters and page cache against
the bytes of its slices.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import moe_models  # noqa: F401 - registers qwen3_moe in models.ARCHS
import pytest
from helpers import launch_two, mlx_launcher
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model
from models import make_model_dir

import pyloader
from pyloader import _core
from pyloader.distributed import shard_model, trace_shard
from pyloader.io.repack import repack
from pyloader.streaming import source_map

SIZES = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2}
# moe_models' qwen3_moe with experts wide enough for mlx-lm to shard a 4-bit down_proj
# (two quantization groups per row); float32, as unquantized experts run on the CPU.
MOE = {"moe_intermediate_size": 64, "fill_zeros": True}
PROMPT = [(7 * i + 1) % 256 for i in range(16)]  # tp_rank.py's prompt
N_TOKENS = 8
PAGE = _core.page_size()  # the kernel's page, or PYLOADER_PAGE_SIZE
ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # mlx-lm: all-to-sharded
COLUMNS = ("o_proj", "down_proj")                                # sharded-to-all
CASES = [("llama", None), ("llama", 4), ("qwen3", None), ("qwen3", 4)]
TP_RANK = Path(__file__).with_name("tp_rank.py")


class Group:
    """What sharding asks of a group: its rank and size (no communication)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _kind(name: str) -> str | None:
    """"rows" / "columns" for a tensor mlx-lm's llama/qwen3 shard cuts, else None."""
    proj = name.split(".")[-2]
    return "rows" if proj in ROWS else "columns" if proj in COLUMNS else None


def _served(path, rank: int, size: int, strategy: str):
    """This rank's parameters as the readers serve them, and mlx-lm's own sharding of
    the fully loaded model."""
    ref, _ = mlx_lm_load_model(Path(path))
    ref.shard(Group(rank, size))
    model, _ = mlx_lm_load_model(Path(path), lazy=True)
    share = shard_model(model, Group(rank, size), mode="tensor")
    ckpt = pyloader.open(path)
    sources, ckpt = share.restrict(model, source_map(model, ckpt.tensors()), ckpt)
    reader = (pyloader.MmapReader(ckpt) if strategy == "mmap"
              else pyloader.PreadReader(ckpt))
    arrays = reader.load(sorted({t.name for t in sources.direct.values()}))
    return ({p: arrays[t.name] for p, t in sources.direct.items()},
            dict(tree_flatten(ref.parameters())), share, reader.stats())


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
@pytest.mark.parametrize("arch,bits", CASES + [("qwen3_moe", 4), ("qwen3_moe", None)])
def test_slices_are_mlx_lm_shards(tmp_path, arch, bits, strategy):
    """Both ranks' parameters, bit for bit, and no tensor sharded mlx-lm keeps whole."""
    path = (make_model_dir(tmp_path / "m", arch, bits=bits, **MOE,
                           dtype=mx.bfloat16 if bits else mx.float32) if arch == "qwen3_moe"
            else make_model_dir(tmp_path / "m", arch, bits=bits, **SIZES))
    total = 0
    for rank in (0, 1):
        served, ref, share, st = _served(path, rank, 2, strategy)
        assert served.keys() == ref.keys()
        for p, a in served.items():
            assert a.shape == ref[p].shape and a.dtype == ref[p].dtype, p
            assert mx.array_equal(a, ref[p]).item(), (arch, bits, rank, p)
        assert share.slices and all(_kind(p.replace(".switch_mlp", "")) for p in share.slices)
        total += st["bytes"]
    sizes = {t.name: t.nbytes for t in pyloader.open(path).tensors()}
    sharded = sum(n for k, n in sizes.items() if _kind(k))
    assert total == sharded + 2 * (sum(sizes.values()) - sharded)


def test_row_blocks_are_views_of_an_aligned_checkpoint(tmp_path):
    src = make_model_dir(tmp_path / "m", "llama", **SIZES)
    repack(src, tmp_path / "aligned")
    served, ref, _, st = _served(tmp_path / "aligned", 1, 2, "mmap")
    assert all(mx.array_equal(a, ref[p]).item() for p, a in served.items())
    ckpt = pyloader.open(tmp_path / "aligned")
    rows = sum(ckpt[t].nbytes // 2 for t in ckpt if _kind(t) == "rows")
    columns = sum(ckpt[t].nbytes // 2 for t in ckpt if _kind(t) == "columns")
    whole = sum(ckpt[t].nbytes for t in ckpt if _kind(t) is None)
    # Everything but the column blocks is zero-copy; the column blocks are read.
    assert st["zero_copy_bytes"] == rows + whole and st["copied_bytes"] == columns


def test_slices_of_a_checkpoint(tmp_path):
    """Checkpoint.with_slices: byte ranges of row and column blocks, and its rules."""
    w = mx.arange(6 * 10, dtype=mx.float32).reshape(6, 10).astype(mx.bfloat16)
    e = mx.arange(3 * 4 * 8, dtype=mx.uint32).reshape(3, 4, 8)
    mx.save_safetensors(str(tmp_path / "t.safetensors"),
                        {"w": w, "e": e, "z": mx.zeros((0, 4), dtype=mx.bfloat16)})
    ckpt = pyloader.open(tmp_path / "t.safetensors")
    sliced = ckpt.with_slices([("rows", "w", 0, [(2, 4)]), ("cols", "w", 1, [(5, 10)]),
                               ("segs", "e", 1, [(1, 2), (3, 4)]), ("all", "e", 2, [(0, 8)])])
    assert sliced.keys() == ckpt.keys() and "rows" in sliced and "rows" not in ckpt
    off = ckpt["w"].offset
    assert sliced.extents("rows") == [(off + 2 * 20, 40)]
    assert sliced.extents("cols") == [(off + i * 20 + 10, 10) for i in range(6)]
    assert sliced.extents("all") == [(ckpt["e"].offset, ckpt["e"].nbytes)]  # merged
    assert len(sliced.extents("segs")) == 6 and sliced["segs"].shape == (3, 2, 8)
    for reader in (pyloader.MmapReader(sliced), pyloader.PreadReader(sliced)):
        got = reader.load(["rows", "cols", "segs", "all"])
        assert mx.array_equal(got["rows"], w[2:4]).item()
        assert mx.array_equal(got["cols"], w[:, 5:]).item()
        assert mx.array_equal(got["segs"], mx.concatenate([e[:, 1:2], e[:, 3:4]], 1)).item()
        assert mx.array_equal(got["all"], e).item()
        assert reader.stats()["bytes_read"] == 40 + 60 + 2 * 96 + e.nbytes
    for bad, why in [(("x", "w", 2, [(0, 1)]), "axis 2 of a 2-d tensor"),
                     (("x", "w", 0, [(0, 7)]), r"range \[0, 7\) along axis 0 of length 6"),
                     (("x", "w", 0, [(3, 3)]), r"range \[3, 3\)"),
                     (("x", "w", 0, []), "no range"),
                     (("w", "w", 0, [(0, 1)]), "the name is already taken")]:
        with pytest.raises(ValueError, match=f"t.safetensors: slice '{bad[0]}' of tensor "
                                             f"'w': {why}"):
            ckpt.with_slices([bad])
    with pytest.raises(ValueError, match="slice 'x' of tensor 'z': the tensor is empty"):
        ckpt.with_slices([("x", "z", 1, [(0, 2)])])
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        ckpt.with_slices([("x", "nope", 0, [(0, 1)])])


def test_shard_that_is_not_a_selection_is_refused():
    class Toy(nn.Module):
        def __init__(self, cut):
            super().__init__()
            self.w = mx.zeros((4, 6))
            self.cut = cut

        def shard(self, group):
            self.w = self.cut(self.w)

    assert trace_shard(Toy(lambda w: w[:, 3:]), Group(1, 2))["w"].ranges == ((3, 6),)
    assert trace_shard(Toy(lambda w: w[::-1]), Group(0, 2))["w"].ranges == (
        (3, 4), (2, 3), (1, 2), (0, 1))
    assert trace_shard(Toy(lambda w: w), Group(0, 2)) == {}
    for cut, why in [(lambda w: w + 1, "out-of-range"), (lambda w: w * 0, "repeated"),
                     (lambda w: w.astype(mx.float32), "dtype"),
                     (lambda w: w[:2, :3], "more than one axis"),
                     (lambda w: mx.concatenate([w[:1], w[:1] + 1], 0), "differ")]:
        with pytest.raises(ValueError, match=why):
            trace_shard(Toy(cut), Group(0, 2))


def test_bad_arguments(tmp_path):
    group = mx.distributed.init()
    path = make_model_dir(tmp_path / "g", "gemma3_text")
    with pytest.raises(ValueError, match="'gemma3_text' does not implement mlx-lm's shard"):
        pyloader.load_model(path, group=pyloader.Distribution(group, shard="tensor"))
    path = make_model_dir(tmp_path / "l", "llama")
    with pytest.raises(ValueError, match="split= is a pipeline setting"):
        pyloader.load_model(path, group=pyloader.Distribution(group, shard="tensor", split=[2]))
    with pytest.raises(ValueError, match="expert caches"):
        pyloader.load_model(path, group=pyloader.Distribution(group, shard="tensor"),
                            options=pyloader.StreamOptions(experts=2))
    with pytest.raises(ValueError, match="unknown shard mode 'both'"):
        pyloader.load_model(path, group=pyloader.Distribution(group, shard="both"))


def test_one_rank_group_reads_everything_whole(tmp_path):
    path = make_model_dir(tmp_path / "m", "qwen3", bits=4)
    base, _ = mlx_lm_load_model(path)
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT), base, max_tokens=N_TOKENS)]
    model, _ = pyloader.load_model(
        path, group=pyloader.Distribution(mx.distributed.init(), shard="tensor"))
    assert [int(t) for t, _ in generate_step(mx.array(PROMPT), model,
                                             max_tokens=N_TOKENS)] == ref
    st = pyloader.distributed.rank_stats(model)
    assert st["mode"] == "tensor" and st["tensor_parallel"]["sliced_bytes"] == 0


# ----------------------------------------------------------------------------
# Two ranks on loopback


@pytest.fixture(scope="module")
def sockets():
    return mlx_launcher()


def _launch(launcher, root: Path, arch: str, bits, resident: float, **over):
    src = make_model_dir(root / "model", arch, bits=bits, **(over or SIZES))
    for r in (0, 1):
        shutil.copytree(src, root / f"rank{r}")
    base, _ = mlx_lm_load_model(src)
    ref = {"tokens": [int(t) for t, _ in generate_step(mx.array(PROMPT), base,
                                                       max_tokens=N_TOKENS)],
           "logits": base(mx.array([PROMPT]))[0, -1].astype(mx.float32).tolist()}
    out = root / "out"
    out.mkdir()
    cmd = launch_two(launcher, [sys.executable, str(TP_RANK), str(root / "rank{rank}"),
                                str(out), str(N_TOKENS), str(resident)])
    # Not from the source tree: `pyloader` must be the installed package.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return src, ref, ranks


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1] or 'bf16'}")
def runs(request, tmp_path_factory, sockets):
    arch, bits = request.param
    root = tmp_path_factory.mktemp(f"tp-{arch}-{bits}")
    return _launch(sockets, root, arch, bits, 1.0)


def test_tokens_identical_to_sharded_load(runs):
    """Bit for bit what mlx-lm's own tensor-parallel load computes. Single-process
    mlx-lm sums each sharded-to-all product in one matmul instead of two halves and an
    all_sum, so its logits differ in the last bits (and a near tie can flip a token:
    llama 4-bit, here): close, not identical."""
    _, single, ranks = runs
    for r in ranks:
        ref = r["sharded_load"]
        for source in ("pread", "mmap"):
            assert r[source]["tokens"] == ref["tokens"], (r["rank"], source)
            assert r[source]["logits"] == ref["logits"], (r["rank"], source)
        assert ref["tokens"][0] == single["tokens"][0]
        scale = mx.abs(mx.array(single["logits"])).max().item()
        diff = mx.abs(mx.array(ref["logits"]) - mx.array(single["logits"])).max().item()
        assert diff <= 0.1 * scale, (diff, scale)  # measured: 0.6-4.6% (4-bit the most)


def test_each_rank_reads_only_its_slices(runs):
    src, _, ranks = runs
    ckpt = pyloader.open(src)
    sizes = {t.name: t.nbytes for t in ckpt.tensors()}
    sharded = sum(n for k, n in sizes.items() if _kind(k))
    replicated = sum(sizes.values()) - sharded
    columns = {k: n for k, n in sizes.items() if _kind(k) == "columns"}
    for r in ranks:
        tp = r["pread"]["stats"]["tensor_parallel"]
        assert tp["whole_bytes"] == replicated and 2 * tp["sliced_bytes"] == sharded
        # Blocks of columns: one read per row, exactly their bytes.
        assert 2 * tp["strided_bytes"] == sum(columns.values())
        assert tp["strided_reads"] == sum(ckpt[k].shape[0] for k in columns)
        # The readers' counters: 1/2 of the sharded bytes + the replicated ones, once.
        pread = r["pread"]["stats"]["reader"]
        mmap = r["mmap"]["stats"]["reader"]
        assert pread["bytes_read"] == sharded // 2 + replicated
        assert mmap["bytes_read"] + mmap["populate_bytes"] == sharded // 2 + replicated
        # The page cache of the rank's own copy (pread, exact ranges, kept): of a
        # block of rows, at most the rank's half and the two pages at its edges.
        cached = r["page_cache"]
        rows = [k for k in sizes if _kind(k) == "rows"]
        for k in rows:
            assert cached[k] <= sizes[k] // 2 + 2 * PAGE, (r["rank"], k, cached[k])
        interior = sum(max(0, sizes[k] // 2 - 2 * PAGE) for k in rows)
        assert sum(min(cached[k], sizes[k]) for k in rows) >= 0.9 * interior


def test_load_peak_memory_below_sharded_load(runs):
    """MLX's peak during the load: pyloader's pread holds the rank's slices and the
    replicated tensors; sharded_load evaluates every tensor whole before slicing it.
    (mmap: the views are not MLX allocations; only copies count.) The issue's 0.6 is
    for real models (bench/distributed_bench.py: 0.50 on an 889 MB llama); on these tiny
    ones the replicated embeddings are a large share and sharded_load's own peak varies
    with MLX's evaluation order (0.37-0.62 measured), so the test holds the invariant:
    never more than what the rank read, and below sharded_load's."""
    _, _, ranks = runs
    for r in ranks:
        ratio = r["pread"]["load_peak"] / r["sharded_load"]["load_peak"]
        print(f"rank {r['rank']}: pread {r['pread']['load_peak']} B, mmap "
              f"{r['mmap']['load_peak']} B, sharded_load {r['sharded_load']['load_peak']} B "
              f"({ratio:.2f})")
        assert ratio < 0.8, ratio
        # Never more than what it read: no whole sharded tensor was ever held.
        assert r["pread"]["load_peak"] <= r["pread"]["stats"]["reader"]["bytes_read"] + PAGE
        assert r["mmap"]["load_peak"] <= r["pread"]["load_peak"]


def test_streamed_layers_read_their_slices_per_pass(tmp_path, sockets):
    src, _, ranks = _launch(sockets, tmp_path, "llama", 4, 0.5)
    sizes = {t.name: t.nbytes for t in pyloader.open(src).tensors()}

    def layer(i, cut):
        return sum(n // 2 if _kind(k) and cut else n for k, n in sizes.items()
                   if f"layers.{i}." in k)
    whole = sum(n for k, n in sizes.items() if "layers." not in k)
    for r in ranks:
        for strategy in ("pread", "mmap"):
            assert r[strategy]["tokens"] == r["sharded_load"]["tokens"], (r["rank"], strategy)
            assert r[strategy]["logits"] == r["sharded_load"]["logits"], (r["rank"], strategy)
        st = r["pread"]["stats"]
        assert st["streamed_bytes_per_pass"] == layer(1, True)
        base = whole + layer(0, True) + st["passes"] * layer(1, True)
        # prefetch=1 may also have read the next pass's streamed layer ahead.
        assert st["reader"]["bytes_read"] in (base, base + layer(1, True))


@pytest.mark.parametrize("bits", [4, None], ids=["q4", "f32"])
def test_moe_experts_follow_mlx_lm_sharding(tmp_path, sockets, bits):
    """qwen3_moe: mlx-lm shards each stacked expert tensor [E, out, in] in place (rows
    of every expert: one range per expert; columns: one per expert row)."""
    src, _, ranks = _launch(sockets, tmp_path, "qwen3_moe", bits, 1.0, **MOE,
                            dtype=mx.bfloat16 if bits else mx.float32)
    sizes = {t.name: t.nbytes for t in pyloader.open(src).tensors()}
    sharded = sum(n for k, n in sizes.items() if _kind(k))
    assert any("switch_mlp" in k for k in sizes if _kind(k))
    for r in ranks:
        for strategy in ("pread", "mmap"):
            assert r[strategy]["tokens"] == r["sharded_load"]["tokens"], (r["rank"], strategy)
            assert r[strategy]["logits"] == r["sharded_load"]["logits"], (r["rank"], strategy)
        assert (r["pread"]["stats"]["reader"]["bytes_read"]
                == sharded // 2 + sum(sizes.values()) - sharded)
