"""Overlapped loads (``load(..., overlap=True)``): arrays handed back while their bytes
are still arriving are bit-identical to mx.load's whatever order they are used in, a
failed read surfaces as OSError when its array is evaluated (never as wrong bytes), and
dropping everything mid-load neither crashes nor leaves threads behind."""

from __future__ import annotations

import gc
import errno
import os
import random
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

import pyloader
from pyloader._native import core as _core
from pyloader.io.readers import aligned_are_views
from helpers import pinned_in_page_cache, tensor_bytes
from models import logits, make_model_dir, model_with_weights

STRATEGIES = ["pread", "mmap"]
FIXTURES = ["all_dtypes_file", "aligned_file", "sharded_dir", "large_file"]
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]


def assert_same(got: dict, ref: dict, order=None) -> None:
    assert sorted(got) == sorted(ref)
    for name in order or ref:
        g, r = got[name], ref[name]
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert tensor_bytes(g) == tensor_bytes(r), name


def threads_of_this_process() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("fixture", FIXTURES)
def test_equal_to_mx_load(request, fixture, strategy):
    path = request.getfixturevalue(fixture)
    got, stats = pyloader.load_with_stats(path, strategy, overlap=True)
    assert stats.tensors == len(got)
    assert_same(got, pyloader.load(path, "mlx"))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("order", ["reverse", "random"])
def test_any_evaluation_order(large_file, strategy, order):
    ref = mx.load(str(large_file))
    names = sorted(ref)
    if order == "reverse":
        names.reverse()
    else:
        random.Random(7).shuffle(names)
    got = pyloader.load(large_file, strategy, overlap=True)
    assert_same(got, ref, order=names)


def test_used_while_reads_are_in_flight(large_file):
    # 4 KiB reads on one thread: 16k reads, so the first and last tensors are used
    # (and combined) long before the load is done on any machine; checked only
    # for correctness (whether a read was still in flight is timing).
    reader = pyloader.PreadReader(large_file, threads=1, chunk_bytes=4096)
    got = reader.load_overlapped()
    assert reader.stats()["tensors"] == len(got)  # handed out at once
    ref = mx.load(str(large_file))
    last, first = sorted(ref)[-1], sorted(ref)[0]
    combined = got[last] * 2 + got[first]
    assert mx.array_equal(combined, ref[last] * 2 + ref[first]).item()
    assert_same(got, ref)
    s = reader.stats()
    assert s["bytes_read"] == s["copied_bytes"] == s["bytes"] == sum(a.nbytes for a in ref.values())
    assert s["copied_tensors"] == s["tensors"] == len(ref)
    assert s["failed_tensors"] == 0


def test_arrays_outlive_the_reader(aligned_file):
    reader = pyloader.PreadReader(aligned_file, threads=2, chunk_bytes=64)
    got = reader.load_overlapped(["f32", "u8", "scalar"])
    del reader
    ref = mx.load(str(aligned_file))
    assert_same(got, {n: ref[n] for n in ("f32", "u8", "scalar")})


def test_read_error_raises_at_evaluation(tmp_path, aligned_file):
    path = tmp_path / "a.safetensors"
    path.write_bytes(aligned_file.read_bytes())
    meta = pyloader.open(path)["f32"]
    bad = meta.offset + 1000
    _core._set_read_fault(str(path), bad, errno.EIO)
    try:
        with pytest.raises(OSError) as eager:
            pyloader.load(path, "pread")
        reader = pyloader.PreadReader(path, threads=2, chunk_bytes=4096)
        got = reader.load_overlapped()
        ref = mx.load(str(aligned_file))
        # The other tensors are intact.
        assert_same({n: a for n, a in got.items() if n != "f32"},
                    {n: a for n, a in ref.items() if n != "f32"})
        for _ in range(2):  # and stays failed: never bytes that were not read
            with pytest.raises(OSError) as lazy:
                mx.eval(got["f32"])
            assert lazy.value.errno == errno.EIO and lazy.value.filename == str(path)
            assert lazy.value.offset == bad
            assert str(lazy.value) == str(eager.value)
        with pytest.raises(OSError):
            (got["f32"] + 1).sum().item()  # a computation on it fails too
        assert reader.stats()["failed_tensors"] == 1
    finally:
        _core._clear_read_faults()


def test_mmap_populates_in_the_background(large_file):
    reader = pyloader.MmapReader(large_file)
    got = reader.load_overlapped()
    viewed = reader.stats()["zero_copy_bytes"]
    assert viewed > 0 or not aligned_are_views()  # the copy modes view nothing
    deadline = time.monotonic() + 60
    while reader.stats()["populate_bytes"] < viewed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.stats()["populate_bytes"] == viewed
    assert_same(got, mx.load(str(large_file)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_threads_end_with_the_arrays(large_file, strategy):
    # Readers that earlier tests left to the garbage collector would end their
    # threads mid-test (a collection can run at any allocation): collect them first.
    gc.collect()
    reader = (pyloader.PreadReader(large_file, threads=2, chunk_bytes=4096)
              if strategy == "pread" else pyloader.MmapReader(large_file))
    before = threads_of_this_process()
    active = mx.get_active_memory()
    got = reader.load_overlapped()
    if strategy == "pread" or aligned_are_views():  # (no views, nothing to populate)
        assert threads_of_this_process() > before  # the reads' own threads
    del got  # mid-load: the reads not yet started are dropped, the threads joined
    assert threads_of_this_process() == before
    assert mx.get_active_memory() <= active  # and the buffers freed


DROP_CHILD = textwrap.dedent("""
    import sys, mlx.core as mx, pyloader
    path, strategy = sys.argv[1], sys.argv[2]
    for i in range(20):
        got = pyloader.load(path, strategy, overlap=True)
        if i % 2:
            mx.eval(got[sorted(got)[0]])   # one used, the rest dropped unread
        del got
    reader = pyloader.PreadReader(path, threads=2, chunk_bytes=4096)
    got = reader.load_overlapped()
    del reader                              # the reader first, then the arrays
    del got
    print("ok")
""")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dropping_everything_mid_load(large_file, strategy):
    out = subprocess.run([sys.executable, "-c", DROP_CHILD, str(large_file), strategy],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def greedy(model, n=8) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mlx_lm_model_gives_the_same_tokens(tmp_path, strategy, bits):
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.bfloat16, bits=bits)
    baseline, _ = load_model(path)
    weights = pyloader.load(path, strategy, overlap=True)
    model = model_with_weights(path, weights)
    assert tensor_bytes(logits(model, PROMPT)) == tensor_bytes(logits(baseline, PROMPT))
    assert greedy(model) == greedy(baseline)


@pytest.mark.parametrize("resident", [1.0, 0.5])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_model_overlapped_gives_the_same_tokens(tmp_path, strategy, resident):
    """``StreamOptions(overlap=True)`` returns while the resident weights are being read;
    the first forward pass waits for each as it reaches it, streamed layers as usual."""
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.bfloat16, bits=4)
    baseline, _ = load_model(path)
    model, _ = pyloader.load_model(path, resident=resident, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy=strategy, overlap=True))
    assert tensor_bytes(logits(model, PROMPT)) == tensor_bytes(logits(baseline, PROMPT))
    assert greedy(model) == greedy(baseline)


def test_load_model_overlapped_read_error_raises_at_first_use(tmp_path):
    """A resident tensor whose read fails: ``StreamOptions(overlap=True)`` returns, and the
    forward pass that reaches it raises the read's OSError (naming the file), never
    computing with bytes that were not read; the eager load raises it at load."""
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.bfloat16)
    ckpt = pyloader.open(path)
    meta = ckpt["model.layers.1.mlp.down_proj.weight"]
    shard = str(meta.file)
    _core._set_read_fault(shard, meta.offset + 64, errno.EIO)
    try:
        with pytest.raises(OSError) as eager:
            pyloader.load_model(path, tokenizer=False,
                                options=pyloader.StreamOptions(strategy="pread"))
        assert eager.value.errno == errno.EIO
        model, _ = pyloader.load_model(
            path, tokenizer=False, options=pyloader.StreamOptions(strategy="pread", overlap=True))
        with pytest.raises(OSError) as lazy:
            logits(model, PROMPT)
        assert lazy.value.errno == errno.EIO and lazy.value.filename == shard
    finally:
        _core._clear_read_faults()


def _direct_fixture(tmp_path):
    """Tensors of 1 MiB and more at offsets inside a 4 KiB block, a small one before
    them, and a file whose end is inside a block (its last partial block is read
    through the page cache)."""
    import numpy as np

    rng = np.random.default_rng(3)
    arrays = {
        "a_small": mx.array(rng.standard_normal(3).astype(np.float32)),
        "b_f16": mx.array(rng.standard_normal((600, 1001)).astype(np.float16)),
        "c_bf16": mx.array(rng.standard_normal((701, 999)).astype(np.float32)).astype(mx.bfloat16),
        "d_i8": mx.array(rng.integers(-128, 127, (1_100_001,), dtype=np.int8)),
    }
    path = tmp_path / "direct.safetensors"
    mx.save_safetensors(str(path), arrays)
    meta = pyloader.open(path)
    assert meta["b_f16"].offset % 4096 and path.stat().st_size % 4096  # what this covers
    ref = mx.load(str(path))
    mx.eval(list(ref.values()))  # read now: later evaluations must not fill the page cache
    return path, ref


@pytest.mark.parametrize("overlap", [False, True], ids=["eager", "overlapped"])
def test_pread_reads_cold_tensors_direct_and_warm_ones_through_the_page_cache(tmp_path, overlap):
    from pyloader.io.pagecache import cached_fraction, evict_file

    path, ref = _direct_fixture(tmp_path)
    big = sum(ref[n].nbytes for n in ("b_f16", "c_bf16", "d_i8"))

    def load(**kw):
        reader = pyloader.PreadReader(path, **kw)
        got = reader.load_overlapped() if overlap else reader.load()
        mx.eval(list(got.values()))
        assert_same(got, ref)
        return reader.stats()["direct_bytes"]

    evict_file(path)
    if _core.platform()["portable_io"]:  # no O_DIRECT on that path: all through the cache
        assert load() == 0
        return
    # Cold: the three large tensors' whole blocks go around the page cache (the
    # last one's tail inside the file's last block excepted); the small one does not.
    direct = load()
    assert big - 4096 <= direct <= big + 3 * 4096
    assert cached_fraction([path]) < 0.5  # what was read direct left no pages behind
    evict_file(path)
    assert load(direct=False) == 0  # asked for: every read through the page cache
    with pinned_in_page_cache(path):  # warm, and kept so while the reader looks
        assert load() == 0  # warm: the page cache serves it


def test_pread_direct_read_error_raises_with_the_file_and_offset(tmp_path):
    path, ref = _direct_fixture(tmp_path)
    from pyloader.io.pagecache import evict_file

    bad = pyloader.open(path)["c_bf16"].offset + 100_000
    _core._set_read_fault(str(path), bad, errno.EIO)
    try:
        evict_file(path)
        with pytest.raises(OSError) as eager:
            pyloader.PreadReader(path).load()
        assert eager.value.errno == errno.EIO and eager.value.filename == str(path)
        evict_file(path)
        reader = pyloader.PreadReader(path)
        got = reader.load_overlapped()
        with pytest.raises(OSError) as lazy:
            mx.eval(got["c_bf16"])
        assert lazy.value.errno == errno.EIO and lazy.value.filename == str(path)
        # The failing read was a direct one (the portable path has none).
        assert (reader.stats()["direct_bytes"] > 0) != _core.platform()["portable_io"]
        assert_same({n: a for n, a in got.items() if n != "c_bf16"},
                    {n: a for n, a in ref.items() if n != "c_bf16"})
    finally:
        _core._clear_read_faults()
