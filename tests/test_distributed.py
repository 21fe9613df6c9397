"""Pipeline-parallel loading across two ranks (mlx.launch, ring backend, loopback).

Each rank reads its own copy of the checkpoint (as on two machines), so the
page cache of each copy shows exactly what that rank read. The runs use the
pread source with ``keep_page_cache=True`` after evicting the copies: every
byte a rank read stays cached, and nothing else is (reads are exact-range,
without readahead).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import launch_two, mlx_launcher
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model
from benchlib.workloads import DISTRIBUTED
from models import make_model_dir

import pyloader
from pyloader import Residency, _core
from pyloader.distributed import (
    checkpoint_layer_bytes,
    even_split,
    layer_range,
    propose_split,
)

N_LAYERS = 8
# Big enough that weights, not activations, dominate MLX's peak memory.
SIZES = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": N_LAYERS}
PROMPT = [(7 * i + 1) % 256 for i in range(16)]  # the distributed workload's prompt
N_TOKENS = 16
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PAGE = _core.page_size()  # the kernel's page, or PYLOADER_PAGE_SIZE


@pytest.fixture(scope="module")
def sockets():
    return mlx_launcher()


def _measure(launcher, model: str, out: Path, distributed: bool, *extra: str) -> list[dict]:
    child = [sys.executable, "-m", "pyloader.compare.child", DISTRIBUTED, "--no-wait",
             "--result-file", str(out / "rank{rank}.json"), model, "--strategy", "pread", "--resident", "0.5", "--prefetch", "1",
             "--keep-page-cache", "--evict", "--tokens", str(N_TOKENS), *extra]
    if distributed:
        cmd = launch_two(launcher, [*child, "--distributed"])
    else:
        cmd = child
    # Not from the source tree: `pyloader` must be the installed package.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=out.parent,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(out.glob("rank*.json"))
    assert len(files) == (2 if distributed else 1), proc.stdout + proc.stderr
    return [json.loads(f.read_text()) for f in files]


def _layer(name: str) -> int | None:
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module", params=["qwen3_5", "llama"])
def runs(request, tmp_path_factory, sockets):
    arch = request.param
    root = tmp_path_factory.mktemp(f"dist-{arch}")
    src = make_model_dir(root / "model", arch, **SIZES)
    for r in (0, 1):
        shutil.copytree(src, root / f"rank{r}")
    base, _ = mlx_lm_load_model(src)
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT), base, max_tokens=N_TOKENS)]
    single = _measure(sockets, str(src), root / "single", False)[0]
    ranks = _measure(sockets, str(root / "rank{rank}"), root / "dist", True)
    return arch, src, ref, single, ranks


def test_tokens_identical_to_single_process_and_mlx_lm(runs):
    arch, _, ref, single, ranks = runs
    assert single["tokens"] == ref
    for r in ranks:
        assert r["tokens"] == ref, (arch, r["rank"])
    # mlx-lm's own pipeline for qwen3_5, pyloader's adapter of the same
    # protocol for llama (mlx-lm 0.32.2 has no llama pipeline).
    assert [r["stats"]["adapted_pipeline"] for r in ranks] == [arch == "llama"] * 2
    assert [r["stats"]["layers"] for r in ranks] == [[4, 8], [0, 4]]


def test_each_rank_reads_only_its_layers(runs):
    arch, src, _, single, ranks = runs
    ckpt = pyloader.open(src)
    sizes = {t.name: t.nbytes for t in ckpt.tensors()}
    layer_bytes, fixed = checkpoint_layer_bytes(ckpt)
    for r in ranks:
        start, end = r["stats"]["layers"]
        own = {n for n in sizes if _layer(n) is None or start <= _layer(n) < end}
        # The reader's counter: exactly the rank's tensors were read, once
        # for the resident ones, once per pass for the streamed ones.
        st = r["stats"]
        resident_layers = set(range(start, start + (end - start) // 2))
        resident_bytes = sum(sizes[n] for n in own if _layer(n) not in
                             set(range(start, end)) - resident_layers)
        streamed = sum(layer_bytes[i] for i in range(start, end) if i not in resident_layers)
        assert st["streamed_bytes_per_pass"] == streamed
        # prefetch=1 also reads the next pass's first streamed layer ahead
        # (done or not yet when the counters are taken).
        ahead = layer_bytes[start + len(resident_layers)]
        base = resident_bytes + streamed * st["passes"]
        assert st["reader"]["bytes_read"] in (base, base + ahead)
        assert st["owned_bytes"] == sum(sizes[n] for n in own)
        # The page cache of the rank's own copy: no page lying wholly inside
        # another rank's layer ever was read. That the measurement sees reads at
        # all: the rank's own pages are there (keep_page_cache) — in aggregate,
        # since the kernel may reclaim a clean page at any time (once, in CI,
        # 17 of a resident tensor's 31 pages were gone by the end).
        cached = r["page_cache"]
        own_interior = own_cached = 0
        for n, nbytes in sizes.items():
            interior = max(0, (nbytes // PAGE - 1) * PAGE)  # pages wholly inside, at least
            if n in own:
                own_interior += interior
                own_cached += min(cached[n], interior)
            else:
                assert cached[n] <= 2 * PAGE, (arch, r["rank"], n, cached[n])
        assert own_cached >= 0.9 * own_interior, (arch, r["rank"], own_cached, own_interior)
    # Together the ranks read the single process's layer bytes, each half.
    per_pass = [r["stats"]["streamed_bytes_per_pass"] for r in ranks]
    assert per_pass[0] == per_pass[1] == single["stats"]["streamed_bytes_per_pass"] // 2
    owned = [r["stats"]["owned_bytes"] for r in ranks]
    assert all(o <= 0.6 * single["stats"]["reader"]["bytes"] for o in owned), owned
    assert sum(layer_bytes) + fixed == sum(sizes.values())


def test_peak_memory_about_half(runs):
    arch, _, _, single, ranks = runs
    for r in ranks:
        ratio = r["memory"]["mx_peak"] / single["memory"]["mx_peak"]
        print(f"{arch} rank {r['rank']}: MLX peak {r['memory']['mx_peak']} B vs "
              f"{single['memory']['mx_peak']} B single ({ratio:.2f})")
        # Half the resident layers and streamed units of the same size:
        # (F + 2L + 2L) / (F + 4L + 2L) ~ 0.67 at resident=0.5, prefetch 1.
        assert ratio < 0.75, (arch, r["rank"], ratio)


def test_qwen3_adapter_tokens(tmp_path, sockets):
    """qwen3 (no mlx-lm pipeline either) through the same adapter, with an
    uneven split (rank 0: the last 3 layers): tokens only."""
    src = make_model_dir(tmp_path / "model", "qwen3", num_hidden_layers=4)
    base, _ = mlx_lm_load_model(src)
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT), base, max_tokens=N_TOKENS)]
    ranks = _measure(sockets, str(src), tmp_path / "dist", True, "--split", "3,1")
    assert [r["tokens"] for r in ranks] == [ref, ref]
    assert [r["stats"]["layers"] for r in ranks] == [[1, 4], [0, 1]]
    assert all(r["stats"]["adapted_pipeline"] for r in ranks)


def test_one_rank_group_is_the_plain_model(tmp_path):
    """A size-1 group (mx.distributed.init() outside a launch) changes nothing."""
    path = make_model_dir(tmp_path / "m", "qwen3_5")
    base, _ = mlx_lm_load_model(path)
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT), base, max_tokens=8)]
    group = mx.distributed.init()
    assert group.size() == 1
    model, _ = pyloader.load_model(path, resident=0.5, group=group)
    assert [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)] == ref
    st = pyloader.distributed.rank_stats(model)
    assert st["layers"] == [0, 4] and st["split"] == [4]


def test_bad_arguments(tmp_path):
    group = mx.distributed.init()
    path = make_model_dir(tmp_path / "g", "gemma3_text")
    with pytest.raises(ValueError, match="gemma3_text.*does not implement"):
        pyloader.load_model(path, group=group)
    path = make_model_dir(tmp_path / "l", "llama")
    with pytest.raises(ValueError, match="unknown shard mode 'both'"):
        pyloader.load_model(path, group=pyloader.Distribution(group, shard="both"))
    with pytest.raises(ValueError, match="sum to 2"):
        pyloader.load_model(path, group=pyloader.Distribution(group, split=[3]))
    with pytest.raises(ValueError, match="2 per-rank values"):
        pyloader.load_model(path, group=group, resident=[1, 1])
    with pytest.raises(ValueError, match="group=..."):
        pyloader.distributed.rank_stats(pyloader.load_model(path)[0])


def test_split_helpers():
    assert even_split(9, 2) == [5, 4]
    assert layer_range([5, 4], 0) == (4, 9) and layer_range([5, 4], 1) == (0, 4)
    per_rank = Residency.parse(["1GB", "2GB"])
    assert per_rank.for_rank(1, 2) == Residency.of_bytes(2 * 10**9)
    assert Residency.parse(0.5).for_rank(1, 2) == Residency.parse(0.5)


def test_propose_split_balances_compute_and_io():
    layers = [100] * 8
    # Equal ranks, everything fits: the even split, no I/O.
    plan = propose_split(layers, [10_000, 10_000], fixed_bytes=50, read_bps=100,
                         compute_bps=1000)
    assert plan.split == [4, 4] and all(r.streamed_bytes == 0 for r in plan.ranks)
    assert [r.layers for r in plan.ranks] == [(4, 8), (0, 4)]
    # Rank 1 holds only 2 layers and reads slowly: it gets fewer layers.
    plan = propose_split(layers, [10_000, 250], fixed_bytes=50, read_bps=[1000, 100],
                         compute_bps=1000)
    assert plan.split[1] < 4, plan.summary()
    slow = plan.ranks[1]
    assert slow.resident_bytes <= 250 and slow.streamed_bytes == 100 * plan.split[1] - 200
    # The chosen split's slowest stage is the minimum over every split.
    def bottleneck(k):
        return propose_split(layers[:k], [10_000], fixed_bytes=50, read_bps=1000,
                             compute_bps=1000).bottleneck_s
    best = min(max(bottleneck(8 - k),
                   propose_split(layers[:k], [250], fixed_bytes=50, read_bps=100,
                                 compute_bps=1000).bottleneck_s) for k in range(1, 8))
    assert plan.bottleneck_s == pytest.approx(best)
    # A twice-as-fast rank gets about twice the layers when compute dominates.
    plan = propose_split(layers, [10_000, 10_000], read_bps=1e9, compute_bps=[2000, 1000])
    assert plan.split == [5, 3] or plan.split == [6, 2], plan.summary()
    with pytest.raises(ValueError, match="rank 1: budget"):
        propose_split(layers, [1000, 10], fixed_bytes=50)
    with pytest.raises(ValueError, match="cannot split 8 layers over 9"):
        propose_split(layers, [1000] * 9)


def test_plan_split_from_a_checkpoint(tmp_path):
    path = make_model_dir(tmp_path / "m", "llama", **SIZES)
    layer_bytes, fixed = checkpoint_layer_bytes(path)
    assert len(layer_bytes) == N_LAYERS and len(set(layer_bytes)) == 1 and fixed > 0
    bps = pyloader.distributed.measure_read_bps(path)
    assert 1e6 < bps < 1e12
    # Rank 1 can hold only fixed + 1 layer and reads at a tenth of the speed.
    plan = pyloader.distributed.plan_split(
        path, [fixed + N_LAYERS * layer_bytes[0], fixed + layer_bytes[0]],
        read_bps=[bps, bps / 10], compute_bps=bps)
    assert sum(plan.split) == N_LAYERS and plan.split[1] < plan.split[0], plan.summary()
    assert plan.ranks[1].resident_bytes == fixed + layer_bytes[0]


# ----------------------------------------------------------------------------
# The built-in default model, a real checkpoint with uncommon traits: SmolLM2-135M 4-bit, tied embeddings,
# a float16 embedding ahead of float32 layers, 9 query / 3 KV heads.


def _run_workload(launcher, model, out: Path, distributed: bool, *extra: str):
    child = [sys.executable, "-m", "pyloader.compare.child", DISTRIBUTED, "--no-wait",
             "--result-file", str(out / "rank{rank}.json"), str(model),
             "--tokens", "8", *extra]
    cmd = launch_two(launcher, [*child, "--distributed"]) if distributed else child
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          cwd=out.parent, check=False)
    files = sorted(out.glob("rank*.json"))
    return proc, [{"rank": int(f.stem[4:]), **json.loads(f.read_text())} for f in files]


def _workload(launcher, model, out: Path, distributed: bool, *extra: str) -> list[dict]:
    """Each rank's result (an ``error`` entry when it raised) of the distributed
    workload with ``extra``: mlx.launch's exit status says nothing (0 when a rank
    failed), so every rank must have written its result."""
    proc, results = _run_workload(launcher, model, out, distributed, *extra)
    assert len(results) == (2 if distributed else 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    return results


@pytest.fixture(scope="module")
def default_model():
    return pyloader.default_model_path()


@pytest.mark.parametrize("strategy,resident", [("mmap", "1.0"), ("pread", "0.5")])
def test_default_model_pipeline_tokens_equal_single_process(default_model, sockets,
                                                            tmp_path, strategy, resident):
    """Both ranks of a pipeline over the default model give the single process's
    tokens bit for bit (before: token 0 at every step: the first stage's float32 hidden
    state was received as float16, the dtype of the embedding on the receiving rank)."""
    opts = ("--strategy", strategy, "--resident", resident)
    single = _workload(sockets, default_model, tmp_path / "single", False, *opts)[0]
    assert "error" not in single, single.get("traceback")
    base, _ = mlx_lm_load_model(default_model)
    prompt = [(7 * i + 1) % 256 for i in range(16)]  # the workload's prompt
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), base, max_tokens=8)]
    assert single["tokens"] == ref
    ranks = _workload(sockets, default_model, tmp_path / "dist", True, *opts)
    for r in ranks:
        assert "error" not in r, r.get("traceback")
        assert r["tokens"] == ref, r["rank"]
    assert [r["stats"]["layers"] for r in ranks] == [[15, 30], [0, 15]]


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_converted_4bit_tied_model_pipeline_tokens(tmp_path, sockets, strategy):
    """A 4-bit model quantized the way mlx_lm.convert does (mlx-lm's quantize_model,
    group size 32) with tied embeddings: both pipeline ranks give the single process's
    greedy tokens (the issue saw rank 0 die with "[ring] connection to a peer was lost"
    on such a model). The default model's test above covers a float16 embedding ahead of
    float32 layers."""
    path = make_model_dir(tmp_path / "q4", "llama", dtype=mx.float32, bits=4,
                          tie_word_embeddings=True, **SIZES)
    base, _ = mlx_lm_load_model(path)
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT), base, max_tokens=8)]
    ranks = _workload(sockets, path, tmp_path / "dist", True, "--strategy", strategy,
                      "--resident", "0.5")
    for r in ranks:
        assert "error" not in r, r.get("traceback")
        assert r["tokens"] == ref, (r["rank"], r["tokens"], ref)


def test_default_model_tensor_refused_at_load(default_model, sockets, tmp_path):
    """9 query and 3 KV heads do not split over 2 ranks: refused at load on every rank,
    with the reason, instead of a shape error in attention at the first token."""
    proc, ranks = _run_workload(sockets, default_model, tmp_path / "dist", True,
                                "--shard", "tensor")
    # mlx.launch terminates the other rank as soon as one exits with an error, so the
    # slower rank may be stopped (SIGTERM) before its own refusal: every rank either
    # wrote the refusal or was terminated by the launcher, and at least one wrote it.
    log = proc.stdout + proc.stderr
    written = {r["rank"] for r in ranks}
    assert written, log[-2000:]
    for rank in {0, 1} - written:
        assert f"rank {rank} exited with code -15" in log, log[-2000:]
    for r in ranks:
        assert "heads not divisible by the group size" in r.get("error", ""), r
        assert "ValueError" in r["error"] and "shard='pipeline'" in r["error"]
        assert "tokens" not in r


# ----------------------------------------------------------------------------
# A rank that dies makes the run fail (`pyloader launch`), instead of the others hanging.

RANK_SCRIPT = """
import os, signal, sys
import mlx.core as mx
from mlx_lm.generate import generate_step
import pyloader

group = mx.distributed.init()
model, _ = pyloader.load_model(sys.argv[1], group=group, tokenizer=False)
if group.rank() == int(sys.argv[2]):
    os.kill(os.getpid(), signal.SIGKILL)  # dies between the load and the first token
tokens = [int(t) for t, _ in generate_step(mx.array([1, 2, 3]), model, max_tokens=2)]
print("tokens", group.rank(), tokens, flush=True)
"""


def _pyloader_launch(tmp_path: Path, model, dies: int) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, "-m", "pyloader", "launch",
           *launch_two(Path("mlx.launch"), [sys.executable, str(script), str(model),
                                            str(dies)])[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          check=False)


def test_pyloader_launch_fails_when_a_rank_dies(default_model, sockets, tmp_path):
    """mlx.launch exits 0 when a rank is killed; pyloader launch exits 1 naming it."""
    proc = _pyloader_launch(tmp_path, default_model, dies=1)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pyloader launch: rank 1 was killed by signal 9" in proc.stderr, proc.stderr
    assert "PYLOADER-RANK-EXIT" not in proc.stdout  # the status lines are the launcher's


def test_pyloader_launch_succeeds_when_every_rank_does(default_model, sockets, tmp_path):
    proc = _pyloader_launch(tmp_path, default_model, dies=-1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    outs = sorted(line for line in proc.stdout.splitlines() if line.startswith("tokens"))
    assert len(outs) == 2 and outs[0][len("tokens 0"):] == outs[1][len("tokens 1"):], outs
    assert "pyloader launch:" not in proc.stderr
