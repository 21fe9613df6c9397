"""The preallocated KV cache (pyloader.kv): drop-in for mlx-lm's caches.

Tiny random models of the mlx-lm architectures (fixed seeds, built in memory)
must give bit-identical logits and greedy tokens with pyloader's cache and with
mlx-lm's own; the arena is written in place (no history copies, no MLX memory
growth); trim, speculative decoding, deepcopy and prompt-cache files behave as
with mlx-lm; the dtype comes from the working precision, never from packed
uint32 weights.
"""

from __future__ import annotations

import copy
import json
import ctypes
import math
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from models import build_model
from proc_files import require_proc

mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

import pyloader  # noqa: E402
from pyloader import _core, kv  # noqa: E402
from pyloader.kv import plan as kv_plan  # noqa: E402

PROMPT = mx.array([3, 17, 101, 5, 9, 200, 44, 7] * 5)  # 40 tokens


def build(arch: str, **kw):
    """A random mlx-lm model of `arch` (tests/models.py), in memory."""
    return build_model(arch, **kw)[0]


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = build(name, **kw)
        return built[key]

    return get


def run(model, cache, prompt=PROMPT, n=40, **kw):
    """Greedy tokens and their log-probabilities from mlx-lm's generate_step."""
    toks, lps = [], []
    for t, lp in generate_step(prompt, model, max_tokens=n, prompt_cache=cache, **kw):
        toks.append(t)
        lps.append(lp)
    return toks, mx.stack(lps)


def assert_same(a, b):
    assert a[0] == b[0]
    assert mx.array_equal(a[1], b[1]).item(), "log-probabilities differ"


# ----------------------------------------------------------------------------
# Drop-in equivalence


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "gemma3_text"])
def test_greedy_identical_to_mlx_lm(models, arch):
    model = models(arch)
    for step in (2048, 16):  # one prefill pass, and chunked prefill
        ref = run(model, mlx_cache.make_prompt_cache(model), prefill_step_size=step)
        got = run(model, pyloader.make_kv_cache(model, max_context=128), prefill_step_size=step)
        assert_same(got, ref)


def test_layer_kinds_follow_the_model(models):
    gemma = pyloader.make_kv_cache(models("gemma3_text"), max_context=64)
    assert [type(c).__name__ for c in gemma] == ["RotatingKVCache"] * 3 + ["KVCache"]
    assert isinstance(gemma[3], kv.KVCache) and gemma[0].max_size == 4  # the window
    qwen = pyloader.make_kv_cache(models("qwen3_5"), max_context=64)
    assert [type(c).__name__ for c in qwen] == ["ArraysCache", "KVCache"] * 2
    plan = pyloader.plan_kv_cache(models("qwen3_5"), max_context=64)
    assert [l.kind for l in plan.layers] == ["ArraysCache", "KVCache"] * 2
    assert plan.nbytes == sum(c.nbytes for c in qwen if isinstance(c, kv.KVCache))


def test_attributes_agree_with_a_forward_probe(models):
    """Streamed models are planned from attributes and working_dtype() (a probe
    would load every layer); both must say what the forward pass shows."""
    for arch, kw in [("llama", {}), ("qwen3", {}), ("qwen3_5", {}), ("gemma3_text", {}),
                     ("llama", {"bits": 4}), ("qwen3", {"bits": 8})]:
        model = models(arch, **kw)
        caches = kv_plan._base_caches(model)
        paths = kv_plan._kv_paths(caches)
        probed = kv_plan.probe_shapes(model, paths, batch_size=1)
        assert len(probed) == len(paths) > 0
        for p in paths:
            assert kv_plan._attention_shapes(model, p[0]) == probed[p][:3], (arch, p)
            assert kv.working_dtype(model) == probed[p][3], (arch, p)


def test_mlx_lm_generate_unchanged(models):
    """mlx_lm.generate with a tokenizer, as a user calls it."""
    from tokenizers import Tokenizer, decoders, models as tmodels, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    byte_map = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_map))}
    tok = Tokenizer(tmodels.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok))
    model = models("llama")
    prompt = "The preallocated cache must not change a single token."
    ref = mlx_lm.generate(model, tokenizer, prompt, max_tokens=30)
    got = mlx_lm.generate(model, tokenizer, prompt, max_tokens=30,
                          prompt_cache=pyloader.make_kv_cache(model, max_context=256))
    assert got == ref and len(got) > 0


def test_crossing_mlx_lm_growth_steps(models):
    """Past 256 tokens mlx-lm reallocates; the arena does not; same results."""
    model = models("llama")
    ref = run(model, mlx_cache.make_prompt_cache(model), n=300, prefill_step_size=64)
    cache = pyloader.make_kv_cache(model, max_context=400)
    got = run(model, cache, n=300, prefill_step_size=64)
    assert_same(got, ref)
    assert cache[0].offset == 40 + 300 and cache[0].preallocated  # one step ahead


def test_batched_rows(models):
    model = models("qwen3")
    tokens = mx.array([[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]])
    outs = []
    for cache in (mlx_cache.make_prompt_cache(model),
                  pyloader.make_kv_cache(model, max_context=32, batch_size=2)):
        logits = [model(tokens, cache=cache)]
        for t in range(5):
            logits.append(model(mx.array([[t], [t + 1]]), cache=cache))
        outs.append(mx.concatenate(logits, axis=1))
    assert mx.array_equal(outs[0], outs[1]).item()


def test_quantized_models_identical(models):
    model = models("llama", bits=4)
    ref = run(model, mlx_cache.make_prompt_cache(model), prefill_step_size=16)
    got = run(model, pyloader.make_kv_cache(model, max_context=128), prefill_step_size=16)
    assert_same(got, ref)


# ----------------------------------------------------------------------------
# The dtype rule


def naive_dtype(model):
    """What a cache sized from a projection's weight picks."""
    return model.layers[0].self_attn.k_proj.weight.dtype


def keys_dtype(model):
    """The dtype the model's attention actually hands its cache."""
    caches = kv_plan._base_caches(model)
    paths = kv_plan._kv_paths(caches)
    return kv_plan.probe_shapes(model, paths, 1)[paths[0]][3]


def test_naive_rule_picks_packed_uint32(models):
    q4 = models("llama", bits=4)
    assert naive_dtype(q4) == mx.uint32
    assert naive_dtype(q4) != keys_dtype(q4) == mx.bfloat16
    with pytest.raises(ValueError, match="floating"):
        pyloader.make_kv_cache(q4, max_context=64, dtype=naive_dtype(q4))


@pytest.mark.parametrize("dtype,bits", [(mx.bfloat16, 4), (mx.float16, 4), (mx.float16, 8),
                                        (mx.float32, None), (mx.float16, None)])
def test_working_dtype_is_what_attention_produces(dtype, bits):
    model = build("llama", dtype=dtype, bits=bits)
    assert kv.working_dtype(model) == keys_dtype(model) == dtype
    cache = pyloader.make_kv_cache(model, max_context=64)
    assert pyloader.plan_kv_cache(model, 64).dtype == dtype
    model(PROMPT[None, :8], cache=cache)
    keys, values, offset = cache[0].state
    assert keys.dtype == values.dtype == dtype and offset == 8
    # Bytes: 2 layers × (K + V) × heads 2 × 256 tokens × head dim 16 × itemsize.
    assert sum(c.nbytes for c in cache) == 2 * 2 * 2 * 256 * 16 * dtype.size


# ----------------------------------------------------------------------------
# Quantized KV


@pytest.fixture(scope="module")
def wide():
    """head_dim 32: room for 32-element quantization groups."""
    return build("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_bits_identical_to_mlx_lm_quantized_cache(wide, bits):
    ref_cache = [mlx_cache.QuantizedKVCache(group_size=32, bits=bits) for _ in wide.layers]
    ref = run(wide, ref_cache, prefill_step_size=16)
    cache = pyloader.make_kv_cache(wide, max_context=128, kv_bits=bits, kv_group_size=32)
    assert all(isinstance(c, kv.QuantizedKVCache) and c.bits == bits for c in cache)
    assert_same(run(wide, cache, prefill_step_size=16), ref)
    fp = pyloader.plan_kv_cache(wide, 128).nbytes
    q = pyloader.plan_kv_cache(wide, 128, kv_bits=bits, kv_group_size=32).nbytes
    assert q == sum(c.nbytes for c in cache)
    # Per 32 values: 32 * bits / 8 bytes, plus a bf16 scale and bias, vs 64 bytes.
    assert q / fp == pytest.approx((32 * bits / 8 + 4) / 64)


def test_generate_kv_bits_converts_to_preallocated_quantized(wide):
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=20, prefill_step_size=16)
    ref = run(wide, mlx_cache.make_prompt_cache(wide), **kw)
    cache = pyloader.make_kv_cache(wide, max_context=128)
    assert_same(run(wide, cache, **kw), ref)
    assert all(isinstance(c, kv.QuantizedKVCache) and c.preallocated for c in cache)
    assert cache[0]._group is cache[1]._group  # one arena for the converted layers


def test_kv_bits_needs_divisible_head_dim(models):
    with pytest.raises(ValueError, match="kv_group_size"):
        pyloader.make_kv_cache(models("llama"), max_context=64, kv_bits=8)  # head dim 16


# ----------------------------------------------------------------------------
# Trim, speculative decoding, copies


def steps(model, cache, tokens):
    return mx.concatenate([model(mx.array([[t]]), cache=cache) for t in tokens], axis=1)


def test_trim_and_rewrite_like_mlx_lm(models):
    model = models("qwen3")
    outs = []
    for cache in (mlx_cache.make_prompt_cache(model),
                  pyloader.make_kv_cache(model, max_context=64)):
        out = [model(PROMPT[None], cache=cache), steps(model, cache, [1, 2, 3, 4, 5])]
        mx.eval(out)
        assert mlx_cache.can_trim_prompt_cache(cache)
        assert mlx_cache.trim_prompt_cache(cache, 3) == 3
        out.append(steps(model, cache, [9, 8, 7, 6]))
        assert cache[0].offset == 40 + 5 - 3 + 4
        outs.append(mx.concatenate(out, axis=1))
        if isinstance(cache[0], kv.KVCache):
            assert cache[0].copy_on_write_count == 0  # nothing held the trimmed views
    assert mx.array_equal(outs[0], outs[1]).item()


def test_rewrite_keeps_live_views_unchanged(models):
    """A view held across trim + rewrite keeps its values (mlx-lm's value
    semantics): the write goes to a fresh arena instead of under the view."""
    model = models("llama")
    cache = pyloader.make_kv_cache(model, max_context=64)
    model(PROMPT[None], cache=cache)
    mx.eval([c.state for c in cache])
    held = cache[0].state[0]
    before = np.array(held.astype(mx.float32))
    cache[0].trim(10)
    cache[1].trim(10)
    model(mx.array([[1, 2, 3]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert np.array_equal(np.array(held.astype(mx.float32)), before)
    assert cache[0].copy_on_write_count == 1 and cache[1].copy_on_write_count == 0


def test_speculative_decoding(models):
    model, draft = models("llama"), models("llama", seed=1)
    kw = dict(num_draft_tokens=3, max_tokens=30)
    ref = [t for t, *_ in speculative_generate_step(PROMPT, model, draft, **kw)]
    cache = pyloader.make_kv_cache(model, 128) + pyloader.make_kv_cache(draft, 128)
    got = [t for t, *_ in speculative_generate_step(PROMPT, model, draft, prompt_cache=cache, **kw)]
    assert got == ref


def test_deepcopy_is_independent(models):
    model = models("llama")
    cache = pyloader.make_kv_cache(model, max_context=64)
    model(PROMPT[None], cache=cache)
    twin = copy.deepcopy(cache)
    assert twin[0]._group is twin[1]._group is not cache[0]._group
    a = steps(model, cache, [5, 6, 7])
    b = steps(model, twin, [5, 6, 7])
    assert mx.array_equal(a, b).item()
    steps(model, twin, [1, 1])
    assert cache[0].offset == 43 and twin[0].offset == 45


# ----------------------------------------------------------------------------
# Prompt-cache files


@pytest.mark.parametrize("bits", [None, 8])
def test_prompt_cache_file_round_trip(wide, tmp_path, bits):
    path = str(tmp_path / "prompt.safetensors")
    qkw = dict(kv_bits=bits, kv_group_size=32) if bits else {}
    cache = pyloader.make_kv_cache(wide, max_context=128, **qkw)
    wide(PROMPT[None], cache=cache)
    mlx_cache.save_prompt_cache(path, cache, {"who": "pyloader"})
    # Continue three ways: the original, mlx-lm's loader, pyloader's loader.
    plain = mlx_cache.load_prompt_cache(path)
    assert type(plain[0]) in (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)
    ours, meta = pyloader.load_prompt_cache(path, max_context=100, return_metadata=True)
    assert meta == {"who": "pyloader"} and ours[0].capacity == 256
    assert isinstance(ours[0], kv.QuantizedKVCache if bits else kv.KVCache)
    outs = [steps(wide, c, [4, 3, 2, 1]) for c in (cache, plain, ours)]
    assert mx.array_equal(outs[0], outs[1]).item() and mx.array_equal(outs[0], outs[2]).item()
    # A file written from mlx-lm's caches loads preallocated too.
    mlx_cache.save_prompt_cache(path, plain)
    assert pyloader.load_prompt_cache(path)[0].offset == 44


def test_from_state(models):
    model = models("llama")
    ref = mlx_cache.make_prompt_cache(model)
    model(PROMPT[None], cache=ref)
    ours = [kv.KVCache.from_state(c.state, max_context=64) for c in ref]
    assert [c.capacity for c in ours] == [256, 256]
    assert mx.array_equal(steps(model, ref, [1, 2]), steps(model, ours, [1, 2])).item()


# ----------------------------------------------------------------------------
# Growth past max_context


def test_outgrowing_the_arena_warns_once_and_keeps_going(models):
    model = models("llama")
    ref = run(model, mlx_cache.make_prompt_cache(model), n=300, prefill_step_size=64)
    cache = pyloader.make_kv_cache(model, max_context=200)  # 256 tokens
    with pytest.warns(pyloader.KVCacheWarning, match="outgrew") as record:
        got = run(model, cache, n=300, prefill_step_size=64)
    assert len(record) == 1
    assert_same(got, ref)
    assert not cache[0].preallocated and cache[0].offset == 340


# ----------------------------------------------------------------------------
# In place: no copies, no growth


def test_decode_allocates_nothing_for_the_cache():
    """Each decode step's MLX allocations stay far below one layer's cache: the
    history is neither copied nor reallocated (mlx-lm's cache, for contrast,
    reallocates everything every 256 tokens)."""
    model = build("llama", num_key_value_heads=4)
    cache = pyloader.make_kv_cache(model, max_context=4096)
    layer_k = cache[0].nbytes // 2  # 4 heads × 4096 × 16 × bf16 = 512 KiB
    model(mx.zeros((1, 2900), dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[1]])
    mx.eval(steps(model, cache, [1]))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for t in range(250):  # crosses mlx-lm's growth point at 3072
        y = model(y, cache=cache).argmax(-1)
        mx.eval(y)
    assert mx.get_active_memory() - base < layer_k // 8
    assert mx.get_peak_memory() - base < layer_k // 2
    assert all(c.copy_on_write_count == 0 for c in cache)


def rss_anon() -> int:
    """Anonymous RSS of this process, after glibc has handed its free heap back to the
    kernel (malloc_trim): what the process holds, not what the C library keeps cached
    from freed activations (that varied by 15 MiB between passes of the same model)."""
    require_proc("/proc/self/status")
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def test_arena_is_committed_up_front_and_stays_flat():
    model = build("llama", num_key_value_heads=4)
    mx.clear_cache()
    active = mx.get_active_memory()
    cache = pyloader.make_kv_cache(model, max_context=65536)  # 32 MiB
    plan = pyloader.plan_kv_cache(model, 65536).nbytes
    assert plan == 32 << 20
    # Counted by MLX's allocator like mlx-lm's buffers (plan + at most 63 bytes of
    # alignment after each of the 8 slots).
    assert plan <= mx.get_active_memory() - active <= plan + 8 * 63
    # Every page is resident before the first token (whether the allocator took
    # fresh pages or recycled ones).
    arena = cache[0]._group.arena
    assert arena.resident_bytes >= plan - 2 * _core.page_size()
    model(mx.zeros((1, 512), dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    mx.clear_cache()  # MLX keeps freed activations cached; they are not the KV cache
    at_512, active_512 = rss_anon(), mx.get_active_memory()
    for _ in range(3):
        model(mx.zeros((1, 512), dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()
    assert mx.get_active_memory() == active_512  # the cache itself does not grow
    assert rss_anon() - at_512 < plan // 4


def test_refuses_what_cannot_fit(models):
    with pytest.raises(MemoryError, match="max_context"):
        pyloader.make_kv_cache(models("llama"), max_context=1 << 24, batch_size=4096)


def test_lock():
    model = build("llama")
    cache = pyloader.make_kv_cache(model, max_context=256, lock=True)
    if os.geteuid() == 0:
        assert cache[0]._group.arena.locked


@pytest.mark.skipif(shutil.which("capsh") is None or os.geteuid() != 0,
                    reason="needs root and capsh to drop CAP_IPC_LOCK")
def test_lock_refused_warns_with_the_limit():
    code = textwrap.dedent("""
        import resource, warnings
        import mlx.core as mx
        from pyloader import _core, kv
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            g = kv.caches.ArenaGroup([((1, 2, 4096, 64), mx.float16)] * 2, [[0, 1]], True, True)
        assert not g.arena.locked
        print(w[0].category.__name__, w[0].message)
    """)
    out = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c",
                          f"{sys.executable} -c '{code}'"],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "KVCacheWarning" in out.stdout and "RLIMIT_MEMLOCK is 64.0 KiB: raise it" in out.stdout


# ----------------------------------------------------------------------------
# The real default model (SmolLM2-135M-Instruct, 4-bit, float32 norms)

# A neutral paragraph written for this test; its first 48 tokens are scored.
TEXT = (
    "A library is a collection of books and other materials that people can borrow or read "
    "on site. Public libraries are usually run by towns and cities, and anyone who lives "
    "nearby can get a card for free. Besides books, many libraries lend music, films and "
    "tools, offer computers with internet access, and hold classes for children and adults."
)
SCORED = 48


@pytest.fixture(scope="module")
def default_model():
    dm = pytest.importorskip("pyloader.default_model")
    return mlx_lm.load(str(dm.default_model_path()))


def perplexity(model, ids, cache, chunk=16):
    """Perplexity of `ids`, fed through the cache in chunks (so attention reads
    stored keys and values, quantized ones when the cache is)."""
    import mlx.nn as nn

    losses = []
    for s in range(0, ids.size - 1, chunk):
        x = ids[s:min(s + chunk, ids.size - 1)]
        logits = model(x[None], cache=cache).astype(mx.float32)[0]
        losses.append(nn.losses.cross_entropy(logits, ids[s + 1:s + 1 + x.size]))
    return float(mx.exp(mx.concatenate(losses).mean()))


def test_default_model_dtype_and_generate(default_model):
    model, tokenizer = default_model
    # 4-bit projections with float16 scales, float32 norms: it computes in float32.
    assert naive_dtype(model) == mx.uint32
    assert kv.working_dtype(model) == keys_dtype(model) == mx.float32
    prompt = "The capital of France is"
    ref = mlx_lm.generate(model, tokenizer, prompt, max_tokens=6)
    got = mlx_lm.generate(model, tokenizer, prompt, max_tokens=6,
                          prompt_cache=pyloader.make_kv_cache(model, max_context=64))
    assert got == ref and "Paris" in got


def test_default_model_int8_perplexity_within_half_a_percent_of_fp16(default_model):
    """Stated delta: int8 KV (group size 64) is within 0.5% of a float16 KV
    cache's perplexity (measured here: +0.1%)."""
    model, tokenizer = default_model
    ids = mx.array(tokenizer.encode(TEXT)[:SCORED + 1])
    fp16 = perplexity(model, ids, pyloader.make_kv_cache(model, 128, dtype=mx.float16))
    int8 = perplexity(model, ids, pyloader.make_kv_cache(model, 128, kv_bits=8))
    assert 1 < fp16 < 100  # a language model on plain English (a random one: ~49152)
    assert abs(int8 / fp16 - 1) < 0.005, (int8, fp16)


# ----------------------------------------------------------------------------
# The C++ sequence directly


def make_seq(capacity=16, heads=2, dims=(4, 4), dtype=mx.float32):
    specs = [((1, heads, capacity, d), dtype) for d in dims]
    return _core.KvSequence(_core.KvArena.create(specs), list(range(len(dims))))


def test_writes_any_layout_and_casts():
    seq = make_seq()
    k = mx.arange(24, dtype=mx.float32).reshape(1, 3, 2, 4).transpose(0, 2, 1, 3)  # strided
    v = mx.broadcast_to(mx.array([1.5, 2.5, 3.5, 4.5], dtype=mx.float16), (1, 2, 3, 4))
    kv_views = seq.write([k, v], 0)
    assert mx.array_equal(kv_views[0], k).item() and mx.array_equal(kv_views[1], v).item()
    assert kv_views[1].dtype == mx.float32


def test_lazy_writes_run_in_order():
    seq = make_seq()
    parts = [mx.full((1, 2, n, 4), float(i)) for i, n in enumerate([3, 1, 4])]
    start = 0
    for p in parts[:-1]:
        seq.write([p, p], start)  # never evaluated directly
        start += p.shape[2]
    views = seq.write([parts[2], parts[2]], start)
    assert mx.array_equal(views[0], mx.concatenate(parts, axis=2)).item()


def test_writes_cross_streams_in_order():
    """The write runs on the CPU's default stream whatever stream the caller computes on
    (on a Mac: the model's GPU stream): the keys it copies are computed on the caller's
    stream before it, and what reads its views there runs after it."""
    seq = make_seq()
    caller = mx.new_stream(mx.cpu)
    assert caller != mx.default_stream(mx.cpu)
    sums, start = [], 0
    with mx.stream(caller):
        for i in range(4):
            x = mx.exp(mx.full((1, 2, 2, 4), float(i))) - 1.0  # lazy, on `caller`
            views = seq.write([x, 2 * x], start)
            start += 2
            sums.append(views[1].sum(axis=(0, 1, 3)))  # reads every position so far
    mx.eval(sums)
    # Per position: 2 heads x 4 dims of the value 2 * (e^i - 1), i the write it came from.
    rows = [2 * 4 * 2 * (math.exp(i) - 1.0) for i in range(4)]
    for i, got in enumerate(sums):
        want = [r for r in rows[:i + 1] for _ in range(2)]
        assert got.tolist() == pytest.approx(want, rel=1e-6), i


def test_overlapping_write_while_a_view_is_pending():
    seq = make_seq()
    a, b = mx.ones((1, 2, 4, 4)), mx.full((1, 2, 2, 4), 7.0)
    first = seq.write([a, a], 0)       # not evaluated yet
    second = seq.write([b, b], 2)      # rewrites positions 2..3 that `first` shows
    assert seq.copy_on_write_count == 1
    assert mx.array_equal(first[0], a).item()
    assert mx.array_equal(second[0], mx.concatenate([a[:, :, :2], b], axis=2)).item()


def test_write_validation():
    seq = make_seq(capacity=8)
    with pytest.raises(ValueError, match="shape"):
        seq.write([mx.zeros((1, 3, 1, 4)), mx.zeros((1, 3, 1, 4))], 0)
    with pytest.raises(IndexError, match="capacity"):
        seq.write([mx.zeros((1, 2, 9, 4))] * 2, 0)
    with pytest.raises(ValueError, match="positive"):
        _core.KvArena.create([((1, 0, 8, 4), mx.float32)])


# ----------------------------------------------------------------------------
# Arenas under the largest buffer the allocator makes (Metal's maxBufferLength),
# stood in for by PYLOADER_MAX_BUFFER_LENGTH in a child process.

SPLIT_CHILD = r"""
import json, sys
import mlx.core as mx
import numpy as np
import pyloader
from pyloader import _core
limit, capacity = int(sys.argv[1]), int(sys.argv[2])
out = {}
try:
    # Four layers' keys and values, float32 (1, 2, capacity, 8): capacity * 64 bytes each.
    arena = _core.KvArena.create([((1, 2, capacity, 8), mx.float32)] * 8)
except pyloader.UnsupportedError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
out["buffers"] = arena.buffer_bytes
out["payload"] = arena.payload_bytes
rng = np.random.default_rng(0)
same = True
for layer in range(4):
    seq = _core.KvSequence(arena, [2 * layer, 2 * layer + 1])
    k = mx.array(rng.standard_normal((1, 2, 5, 8)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 5, 8)).astype(np.float32))
    views = seq.write([k, v], 0)
    k2 = mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32))
    v2 = mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32))
    del views
    views = seq.write([k2, v2], 5)
    mx.eval(views)
    same = same and mx.array_equal(views[0], mx.concatenate([k, k2], axis=2)).item()
    same = same and mx.array_equal(views[1], mx.concatenate([v, v2], axis=2)).item()
out["same"] = same
print(json.dumps(out))
"""


def split_child(limit: int | None, capacity: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYLOADER_MAX_BUFFER_LENGTH", "PYLOADER_BUFFER_OWNER")}
    if limit:
        env["PYLOADER_MAX_BUFFER_LENGTH"] = str(limit)
    r = subprocess.run([sys.executable, "-c", SPLIT_CHILD, str(limit or 0), str(capacity)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_an_arena_over_the_largest_buffer_is_split_between_slots():
    slot = 64 * 1024  # capacity 1024
    got = split_child(3 * slot, 1024)
    # Three slots a buffer, never one across two; every buffer under the limit.
    assert got["buffers"] == [3 * slot, 3 * slot, 2 * slot]
    assert sum(got["buffers"]) == got["payload"] == 8 * slot
    assert got["same"]
    assert split_child(None, 1024)["buffers"] == [8 * slot]


def test_a_slot_over_the_largest_buffer_is_refused_with_its_size():
    got = split_child(64 * 1024 - 1, 1024)
    assert "error" in got
    assert "slot 0 of shape (1, 2, 1024, 8) needs 65536 bytes" in got["error"]
    assert "maxBufferLength) is 65535 bytes" in got["error"]


def test_the_cache_writes_take_data_pointers_in_their_task():
    """Every data pointer a write uses is taken on its task, as MLX's own CPU ops do. On
    the CPU allocator a pointer taken while the graph is built is the same, so only the
    count can tell; on CUDA such a pointer's migration would read before the kernel
    writing the keys ran."""
    arena = _core.KvArena.create([((1, 2, 16, 8), mx.float32)] * 2)
    seq = _core.KvSequence(arena, [0, 1])
    in_task, outside = _core._kv_pointers_taken()
    k = mx.arange(2 * 4 * 8, dtype=mx.float32).reshape(1, 2, 4, 8)
    views = seq.write([k * 2, k + 1], 0)  # inputs not yet computed when the write is built
    mx.async_eval(views)
    mx.eval(views)
    assert mx.array_equal(views[0], k * 2).item() and mx.array_equal(views[1], k + 1).item()
    views = seq.write([k[:, :, :1], k[:, :, 1:2]], 2)  # an overwrite: copy on write
    mx.eval(views)
    assert seq.copy_on_write_count == 1
    assert mx.array_equal(views[0][:, :, 2:3], k[:, :, :1]).item()
    now_in, now_outside = _core._kv_pointers_taken()
    assert now_outside == outside
    # Two slots a write (destination, new tokens), plus the old slots of the redirect.
    assert now_in - in_task == 2 * 2 + 2 * 3
