"""Expert streaming (``StreamOptions(experts=...)``) is bit-exact against plain mlx-lm.

For every MoE architecture of ``moe_models`` (qwen3_moe, qwen3_5_moe, mixtral,
gpt_oss, deepseek_v3, olmoe), float32 and 4-bit: the logits of a 72-token prompt
(long enough for mlx-lm's SwitchGLU / SwitchMLP to take their sorted
``gather_mm`` path) and 32 greedy tokens are identical to ``mlx_lm.utils.load_model``
at every cache size (1 slot, top-k slots, 25% / 50% / all experts), both
policies, with the layers resident or streamed. Also batch generation,
speculative decoding and prompt-cache files; the counters
(``stats(model)["experts"]``) and the routing-trace simulator, which must count
exactly what a live run counts; argument errors.

MLX on this CPU-only machine: ``mx.gather_mm`` (unquantized ``SwitchLinear``)
only supports float32, so plain mlx-lm cannot run a bf16 MoE model here. The
unquantized models are therefore float32; the quantized ones are 4-bit
(group size 32, quantized from bf16 by ``mlx_lm.utils.quantize_model``), whose
``gather_qmm`` works with bf16 scales.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import batch_generate, generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model as mlx_lm_load_model
from models import make_model_dir
from moe_models import MOE_ARCHS, make_moe_dir, variant_id

import pyloader
from pyloader.io.readers import views_cost_nothing
from pyloader.streaming import RoutingTrace, controller_of, simulate

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, size=72)]
N_TOKENS = 32
COUNTERS = ("calls", "rounds", "routed", "hits", "misses", "evictions")


# ----------------------------------------------------------------------------
# Checkpoints and references


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``ckpt(arch, bits=None, seed=0)``: the checkpoint's directory, built once per
    module (float32, or 4-bit from bf16)."""
    built: dict = {}

    def get(arch: str, bits=None, seed: int = 0) -> Path:
        key = (arch, bits, seed)
        if key not in built:
            root = tmp_path_factory.mktemp(f"{variant_id(arch, bits)}-s{seed}")
            path = make_moe_dir(root, arch, bits, seed)
            config = json.loads((path / "config.json").read_text())
            assert ("quantization" in config) == bool(bits)
            dtypes = {str(a.dtype) for f in path.glob("*.safetensors")
                      for a in mx.load(str(f)).values()}
            assert "mlx.core.float32" in dtypes if bits is None else "mlx.core.uint32" in dtypes
            built[key] = path
        return built[key]

    return get


def greedy(model, prompt=PROMPT, n=N_TOKENS) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@functools.cache
def reference(path: Path) -> tuple[mx.array, list[int]]:
    """Plain mlx-lm's first logits of PROMPT and its greedy continuation."""
    base, _ = mlx_lm_load_model(path)
    out = base(mx.array(PROMPT)[None])
    mx.eval(out)
    return out, greedy(base)


def text_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


def num_experts(path: Path) -> int:
    c = text_config(path)
    return c.get("num_experts") or c.get("num_local_experts") or c["n_routed_experts"]


def top_k(path: Path) -> int:
    return text_config(path)["num_experts_per_tok"]


@functools.cache
def checkpoint_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every checkpoint tensor → (shape, nbytes)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, a in mx.load(str(f)).items():
            out[name] = (tuple(a.shape), a.nbytes)
    return out


def expert_bytes(path: Path, module: str) -> int:
    """Bytes of one expert of the MoE module at `module`: every stacked tensor under
    it (weight, and scales / biases / bias where present), one expert's share."""
    tensors = {n: v for n, v in checkpoint_tensors(path).items() if n.startswith(module + ".")}
    assert tensors, module
    assert len({shape[0] for shape, _ in tensors.values()}) == 1, tensors
    return sum(nbytes // shape[0] for shape, nbytes in tensors.values())


def moe_module_paths(model) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))}


def expert_stats(model) -> dict:
    return pyloader.stats(model)["experts"]


def count_forwards(model, monkeypatch) -> list:
    calls = []
    model_call = type(model).__call__
    monkeypatch.setattr(type(model), "__call__",
                        lambda self, *a, **k: calls.append(1) or model_call(self, *a, **k))
    return calls


# ----------------------------------------------------------------------------
# Bit-exactness at every cache size

FULL_ARCHS = ("qwen3_moe", "deepseek_v3")   # every size
SIZES = ("1", "topk", "25%", "50%", "all")


def experts_value(size: str, path: Path):
    return {"1": 1, "topk": top_k(path), "25%": 0.25, "50%": 0.5, "all": 1.0}[size]


def _cases():
    cases = []
    for arch in MOE_ARCHS:
        for bits in (None, 4):
            if arch in FULL_ARCHS:
                combos = [(s, 1.0, "lru") for s in SIZES]
                combos += [("1", 0.0, "lru"), ("25%", 1.0, "lfu"), ("all", 0.0, "lru")]
            else:
                combos = [("1", 1.0, "lru"), ("50%", 1.0, "lru"), ("50%", 0.0, "lfu")]
            cases += [pytest.param(arch, bits, size, resident, policy,
                                   id=f"{variant_id(arch, bits)}-{size}-res{resident:g}-{policy}")
                      for size, resident, policy in combos]
    return cases


@pytest.mark.parametrize("arch,bits,size,resident,policy", _cases())
def test_bit_exact(ckpt, arch, bits, size, resident, policy, monkeypatch):
    path = ckpt(arch, bits)
    ref_logits, ref_tokens = reference(path)
    experts = experts_value(size, path)
    model, _ = pyloader.load_model(
        path, resident=resident,
        options=pyloader.StreamOptions(experts=experts, expert_policy=policy))
    forwards = count_forwards(model, monkeypatch)
    out = model(mx.array(PROMPT)[None])
    assert out.dtype == ref_logits.dtype and out.shape == ref_logits.shape
    assert mx.array_equal(out, ref_logits).item(), "first logits differ from plain mlx-lm"
    assert greedy(model) == ref_tokens
    st = pyloader.stats(model)
    ex = st["experts"]
    # Every MoE module of the model has a cache, and each was driven by its hook.
    assert set(ex["layers"]) == moe_module_paths(model)
    n_experts = num_experts(path)
    for name, layer in ex["layers"].items():
        assert layer["experts"] == n_experts
        assert layer["hits"] + layer["misses"] == layer["routed"], name
        if size == "all":
            assert layer["slots"] == n_experts and layer["misses"] == n_experts
            assert layer["calls"] == 1  # the load: no routing is needed afterwards
        else:
            assert layer["slots"] < n_experts
            assert layer["calls"] == len(forwards), (name, layer["calls"], len(forwards))
            if layer["slots"] < top_k(path):  # every call is served in several rounds
                assert layer["rounds"] >= 2 * layer["calls"], (name, layer)
    if resident == 0.0:
        assert st["streamed_units"] == len(model.layers)


# ----------------------------------------------------------------------------
# mlx-lm's other generation paths

BATCH_PROMPTS = [PROMPT, PROMPT[:9], PROMPT[30:][::-1], [3, 1, 4, 1, 5]]


def _batch(model) -> list[list[int]]:
    tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    out = batch_generate(model, tokenizer, BATCH_PROMPTS, max_tokens=12,
                         return_token_ids=True)
    return out.token_ids


@pytest.mark.parametrize("arch,bits,experts", [
    ("qwen3_moe", None, 2), ("gpt_oss", 4, 0.25), ("qwen3_5_moe", None, 1),
    ("olmoe", 4, 0.5)], ids=lambda v: str(v))
def test_batch_generate(ckpt, arch, bits, experts):
    path = ckpt(arch, bits)
    base, _ = mlx_lm_load_model(path)
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=experts))
    ref = _batch(base)
    assert [len(r) for r in ref] == [12] * len(BATCH_PROMPTS)
    assert _batch(model) == ref


@pytest.mark.parametrize("arch,bits", [("qwen3_moe", None), ("mixtral", 4)],
                         ids=lambda v: str(v))
def test_speculative_decoding(ckpt, arch, bits):
    path, draft_path = ckpt(arch, bits), ckpt(arch, bits, seed=1)

    def spec(model, draft):
        return [(int(t), bool(d)) for t, _, d in speculative_generate_step(
            mx.array(PROMPT), model, draft, num_draft_tokens=3, max_tokens=24)]

    base, _ = mlx_lm_load_model(path)
    # A draft of another seed (mostly rejected) and the model itself (accepted).
    ref_other = spec(base, mlx_lm_load_model(draft_path)[0])
    ref_same = spec(base, mlx_lm_load_model(path)[0])
    assert not all(d for _, d in ref_other) and any(d for _, d in ref_same)

    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=2))
    assert spec(model, mlx_lm_load_model(draft_path)[0]) == ref_other
    assert spec(model, mlx_lm_load_model(path)[0]) == ref_same
    # The target and the draft both with expert caches (the draft's layers streamed).
    model, _ = pyloader.load_model(path,
                                   options=pyloader.StreamOptions(experts=1, expert_policy="lfu"))
    draft, _ = pyloader.load_model(draft_path, resident=0,
                                   options=pyloader.StreamOptions(experts=0.5))
    assert spec(model, draft) == ref_other
    draft, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=3))
    assert spec(model, draft) == ref_same


@pytest.mark.parametrize("arch,bits,experts", [
    ("qwen3_5_moe", 4, 2), ("gpt_oss", None, 1), ("deepseek_v3", None, 0.25)],
    ids=lambda v: str(v))
def test_prompt_cache_file(ckpt, arch, bits, experts, tmp_path):
    path = ckpt(arch, bits)

    def continue_from_file(model, name):
        cache = make_prompt_cache(model)
        model(mx.array(PROMPT)[None], cache=cache)
        mx.eval([c.state for c in cache])
        file = str(tmp_path / f"{name}.safetensors")
        save_prompt_cache(file, cache)
        cache = load_prompt_cache(file)
        return greedy_with(model, [5, 6, 7], cache)

    def greedy_with(model, prompt, cache):
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16,
                                                 prompt_cache=cache)]

    base, _ = mlx_lm_load_model(path)
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=experts))
    assert continue_from_file(model, "ours") == continue_from_file(base, "plain")
    # A cache file written by plain mlx-lm continues identically in ours.
    plain_cache = load_prompt_cache(str(tmp_path / "plain.safetensors"))
    ours_cache = load_prompt_cache(str(tmp_path / "plain.safetensors"))
    assert greedy_with(model, [9, 8], ours_cache) == greedy_with(base, [9, 8], plain_cache)


# ----------------------------------------------------------------------------
# Counters


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("arch,bits", [("qwen3_moe", None), ("gpt_oss", 4), ("olmoe", 4),
                                       ("deepseek_v3", None)], ids=lambda v: str(v))
def test_counters(ckpt, arch, bits, policy):
    path = ckpt(arch, bits)
    model, _ = pyloader.load_model(path,
                                   options=pyloader.StreamOptions(experts=3, expert_policy=policy))
    ex = expert_stats(model)
    assert ex["policy"] == policy and ex["setting"] == 3
    for layer in ex["layers"].values():
        assert {k: layer[k] for k in COUNTERS + ("bytes_read", "reads")} == dict.fromkeys(
            COUNTERS + ("bytes_read", "reads"), 0)
    with controller_of(model).routing_trace() as trace:
        assert greedy(model) == reference(path)[1]
    ex = expert_stats(model)
    n_experts = num_experts(path)
    for name, layer in ex["layers"].items():
        one = expert_bytes(path, name)
        calls = trace.layers[name]
        assert layer["slots"] == 3 and layer["experts"] == n_experts
        assert layer["hits"] + layer["misses"] == layer["routed"]
        assert layer["bytes_read"] == layer["misses"] * one, (name, one)
        assert layer["misses"] > 0 and layer["reads"] >= 1
        # A miss evicts only once the free slots are used up.
        assert layer["evictions"] == max(0, layer["misses"] - layer["slots"])
        assert layer["calls"] == len(calls)
        assert layer["routed"] == sum(len(c) for c in calls)
        assert layer["rounds"] == sum(math.ceil(len(c) / 3) for c in calls)
        assert layer["hit_rate"] == pytest.approx(layer["hits"] / layer["routed"])
        # The bank holds its slots and a scratch slot.
        assert layer["bank_bytes"] >= 4 * one
    total = ex["total"]
    for k in COUNTERS + ("bytes_read", "reads", "bank_bytes"):
        assert total[k] == sum(layer[k] for layer in ex["layers"].values()), k


@pytest.mark.parametrize("experts", [1.0, "max", "1GB"])
def test_all_experts_cached_reads_once(ckpt, experts):
    path = ckpt("olmoe", 4)
    n_experts = num_experts(path)
    setting = n_experts if experts == "max" else experts
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=setting))
    after_load = expert_stats(model)["layers"]
    for name, layer in after_load.items():
        assert layer["slots"] == n_experts
        assert layer["misses"] == n_experts and layer["hits"] == 0
        assert layer["bytes_read"] == n_experts * expert_bytes(path, name)
    assert greedy(model) == reference(path)[1]
    assert expert_stats(model)["layers"] == after_load  # nothing read after loading


def test_byte_budget(ckpt):
    """A byte budget gives the most slots whose banks (scratch slot and layout included)
    fit it: exactly the memory of N slots gives N slots, a byte less gives N - 1."""
    path = ckpt("qwen3_moe", None)
    sizes = {}
    for slots in (1, 2, 3):
        model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=slots))
        sizes[slots] = expert_stats(model)["total"]["bank_bytes"]
    assert sizes[1] < sizes[2] < sizes[3]
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=f"{sizes[3]}B"))
    ex = expert_stats(model)
    assert ex["setting"] == f"{sizes[3]}B"
    assert {layer["slots"] for layer in ex["layers"].values()} == {3}
    assert ex["total"]["bank_bytes"] == sizes[3]
    assert greedy(model) == reference(path)[1]
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=f"{sizes[3] - 1}B"))
    assert {layer["slots"] for layer in expert_stats(model)["layers"].values()} == {2}
    with pytest.raises(MemoryError):
        pyloader.load_model(path, options=pyloader.StreamOptions(experts=f"{sizes[1] - 1}B"))
    with pytest.raises(MemoryError):
        pyloader.load_model(path, options=pyloader.StreamOptions(experts="1KB"))


@pytest.mark.parametrize("arch,bits", [("qwen3_moe", None), ("gpt_oss", 4)],
                         ids=lambda v: str(v))
def test_byte_budget_bounds_bank_memory(ckpt, arch, bits):
    """The banks of every layer together never take more memory than the budget; a budget
    below one slot per layer is refused up front."""
    path = ckpt(arch, bits)
    base, _ = mlx_lm_load_model(path)
    per_slot = sum(expert_bytes(path, name) for name in moe_module_paths(base))
    one, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=1))
    smallest = expert_stats(one)["total"]["bank_bytes"]
    for slots in (1, 2, 3):
        for budget in ((slots + 1) * per_slot, (slots + 1) * per_slot + 512):
            if budget < smallest:
                with pytest.raises(MemoryError):
                    pyloader.load_model(path, options=pyloader.StreamOptions(experts=f"{budget}B"))
                continue
            model, _ = pyloader.load_model(path,
                                           options=pyloader.StreamOptions(experts=f"{budget}B"))
            total = expert_stats(model)["total"]["bank_bytes"]
            assert total <= budget, f"banks take {total} bytes, budget {budget}"


# ----------------------------------------------------------------------------
# The simulator counts exactly what a live run counts


def _counters(d: dict) -> dict:
    return {k: d[k] for k in COUNTERS}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("arch,bits,capacity,other", [
    ("qwen3_moe", None, 4, 1), ("deepseek_v3", 4, 6, 3), ("gpt_oss", None, 2, 5),
    ("qwen3_5_moe", 4, 3, 6)], ids=lambda v: str(v))
def test_simulator_matches_live(ckpt, arch, bits, capacity, other, policy, tmp_path):
    path = ckpt(arch, bits)
    model, _ = pyloader.load_model(
        path, options=pyloader.StreamOptions(experts=capacity, expert_policy=policy))
    with controller_of(model).routing_trace() as trace:
        tokens = greedy(model)
    assert tokens == reference(path)[1]
    live = expert_stats(model)
    assert set(trace.layers) == set(live["layers"])
    n_experts = num_experts(path)
    for name, calls in trace.layers.items():
        assert trace.num_experts[name] == n_experts
        assert all(c == sorted(set(c)) and 0 <= c[0] and c[-1] < n_experts for c in calls)
    sim = simulate(trace, capacity, policy)
    for name, layer in live["layers"].items():
        assert _counters(sim[name]) == _counters(layer), name
    assert _counters(sim["total"]) == _counters(live["total"])
    assert sim["total"]["hit_rate"] == pytest.approx(live["total"]["hit_rate"])

    # Recording stops with the block.
    recorded = {n: len(c) for n, c in trace.layers.items()}
    model(mx.array([[1, 2, 3]]))
    assert {n: len(c) for n, c in trace.layers.items()} == recorded

    # A saved trace replays the same.
    trace.save(tmp_path / "trace.json")
    loaded = RoutingTrace.load(tmp_path / "trace.json")
    assert loaded.layers == trace.layers and loaded.num_experts == trace.num_experts
    assert simulate(loaded, capacity, policy) == sim

    # Another size: what the simulation predicts is what a live run counts.
    predicted = simulate(trace, other, policy)
    assert _counters(predicted["total"]) != _counters(sim["total"])
    model, _ = pyloader.load_model(
        path, options=pyloader.StreamOptions(experts=other, expert_policy=policy))
    assert greedy(model) == tokens
    live = expert_stats(model)
    for name, layer in live["layers"].items():
        assert _counters(predicted[name]) == _counters(layer), name


@pytest.mark.parametrize("calls,capacity,policy,expected", [
    # LRU evicts the least recently used; LFU the least often used.
    ([[0], [0], [1], [2], [0]], 2, "lru", {"hits": 1, "misses": 4, "evictions": 2}),
    ([[0], [0], [1], [2], [0]], 2, "lfu", {"hits": 2, "misses": 3, "evictions": 1}),
    # A call needing more experts than slots is served in rounds; the experts of a
    # round are never evicted for each other (LFU would otherwise evict 0, count 2 < 3).
    ([[0, 1, 2]], 2, "lru", {"calls": 1, "rounds": 2, "routed": 3, "misses": 3, "evictions": 1}),
    ([[1], [1], [1], [0], [0, 2], [0]], 2, "lfu",
     {"calls": 6, "rounds": 6, "routed": 7, "hits": 4, "misses": 3, "evictions": 1}),
    # One slot: every expert of every call is a round.
    ([[3, 4], [4]], 1, "lru",
     {"calls": 2, "rounds": 3, "routed": 3, "hits": 1, "misses": 2, "evictions": 1}),
], ids=lambda v: str(v))
def test_policy_semantics(calls, capacity, policy, expected):
    trace = RoutingTrace(layers={"m": calls}, num_experts={"m": 8})
    got = simulate(trace, capacity, policy)["m"]
    assert {k: got[k] for k in expected} == expected


def test_policies_differ_in_simulation(ckpt):
    """The trace of one run, replayed: LRU and LFU are different policies (so the
    LFU cases above test something), and more slots never miss more."""
    path = ckpt("qwen3_moe", None)
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=2))
    with controller_of(model).routing_trace() as trace:
        greedy(model, n=64)
    runs = {(p, c): simulate(trace, c, p)["total"] for p in ("lru", "lfu") for c in (2, 4, 8)}
    assert any(_counters(runs["lru", c]) != _counters(runs["lfu", c]) for c in (2, 4, 8))
    for p in ("lru",):  # LRU is a stack algorithm: misses are monotone in the size
        assert runs[p, 2]["misses"] >= runs[p, 4]["misses"] >= runs[p, 8]["misses"]


# ----------------------------------------------------------------------------
# Arguments


def test_experts_layer_is_the_default(ckpt):
    path = ckpt("mixtral", None)
    model, _ = pyloader.load_model(path)
    assert "experts" not in pyloader.stats(model)
    model, _ = pyloader.load_model(path, resident=0,
                                   options=pyloader.StreamOptions(experts="layer"))
    assert "experts" not in pyloader.stats(model)
    assert greedy(model) == reference(path)[1]


@pytest.mark.parametrize("experts,error", [
    (0, ValueError), (-3, ValueError), (1.5, ValueError), (0.0, ValueError),
    (-0.5, ValueError), (True, TypeError), (False, TypeError), (None, TypeError),
    ([2], TypeError), ("lots", ValueError)], ids=repr)
def test_bad_experts(ckpt, experts, error):
    with pytest.raises(error):
        pyloader.load_model(ckpt("qwen3_moe", None),
                            options=pyloader.StreamOptions(experts=experts))


def test_bad_policy(ckpt):
    with pytest.raises(ValueError, match="expert_policy"):
        pyloader.load_model(ckpt("qwen3_moe", None),
                            options=pyloader.StreamOptions(experts=2, expert_policy="fifo"))


def test_dense_model_has_no_experts(tmp_path):
    path = make_model_dir(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match=r"no mixture-of-experts modules"):
        pyloader.load_model(path, options=pyloader.StreamOptions(experts=2))
    model, _ = pyloader.load_model(path)  # experts="layer" is fine on a dense model
    assert "experts" not in pyloader.stats(model)


# ----------------------------------------------------------------------------
# The page-cache source (expert_source="mmap") and the process lifetime


@pytest.mark.parametrize("arch,bits,size", [("qwen3_moe", None, "1"), ("deepseek_v3", 4, "25%"),
                                            ("gpt_oss", 4, "50%")], ids=lambda v: str(v))
def test_page_cache_source_is_bit_exact(ckpt, arch, bits, size, tmp_path):
    """Views of the stacked tensors, each expert's pages populated when it enters the
    cache and dropped when it leaves: the same tokens, the same counters as the bank."""
    from pyloader.io.repack import repack

    path = ckpt(arch, bits)
    aligned = tmp_path / "aligned"
    repack(path, aligned)
    experts = experts_value(size, path)
    if not views_cost_nothing():  # PYLOADER_ZERO_COPY=copy or make_buffer
        with pytest.raises(pyloader.UnsupportedError, match="use expert_source='bank'"):
            pyloader.load_model(
                aligned, options=pyloader.StreamOptions(experts=experts, expert_source="mmap"))
        return
    ref_logits, ref_tokens = reference(path)
    model, _ = pyloader.load_model(
        aligned, resident=0.0,
        options=pyloader.StreamOptions(experts=experts, expert_source="mmap"))
    assert mx.array_equal(model(mx.array(PROMPT)[None]), ref_logits)
    assert greedy(model) == ref_tokens
    mapped = expert_stats(model)
    bank, _ = pyloader.load_model(aligned, options=pyloader.StreamOptions(experts=experts))
    bank(mx.array(PROMPT)[None])
    greedy(bank)
    assert mapped["source"] == "mmap" and expert_stats(bank)["source"] == "bank"
    assert ({k: mapped["total"][k] for k in COUNTERS}
            == {k: expert_stats(bank)["total"][k] for k in COUNTERS})
    assert mapped["total"]["bytes_read"] == expert_stats(bank)["total"]["bytes_read"]


def test_page_cache_source_needs_aligned_tensors(ckpt):
    path = ckpt("qwen3_moe", None)  # written by mx.save_safetensors: misaligned
    with pytest.raises(ValueError if views_cost_nothing() else pyloader.UnsupportedError,
                       match="pyloader repack" if views_cost_nothing() else "bank"):
        pyloader.load_model(path, options=pyloader.StreamOptions(experts=2, expert_source="mmap"))
    with pytest.raises(ValueError, match="expert_source"):
        pyloader.load_model(path, options=pyloader.StreamOptions(experts=2, expert_source="disk"))


def test_banks_hold_no_python_object(ckpt):
    """A bank's arrays are freed on MLX's threads, possibly while Python shuts down, so
    the bank may hold nothing that needs the interpreter to be released (an earlier build
    kept the checkpoint's index, a Python object, and aborted at exit about half the time
    after a generation with every expert cached)."""
    import sys

    from pyloader._native import core

    path = ckpt("qwen3_moe", 4)
    ck = pyloader.open(path)
    index = ck.index
    names = [t.name for t in ck.tensors() if ".0.mlp.switch_mlp." in t.name]
    before = sys.getrefcount(index)
    bank = core.ExpertBank.create(index, names, 2)
    arrays = bank.arrays()
    after = sys.getrefcount(index)
    assert after == before
    reader = core.ExpertReader(index)  # the reader may: it is freed by Python
    reader.load(bank, [(3, 0), (4, 1)])
    del ck, index, reader, bank
    stacked = mx.load(str(next(path.glob("*.safetensors"))))[names[0]]
    assert mx.array_equal(arrays[0][0], stacked[3]) and mx.array_equal(arrays[0][1], stacked[4])


def test_bank_reads_merge_runs_and_refuse_bad_moves(ckpt):
    """A read of moves is one range per tensor per run of consecutive experts going to
    consecutive slots (in any order given); a slot or expert outside the bank, or a slot
    given twice, is refused before any byte is written."""
    from pyloader._native import core

    path = ckpt("qwen3_moe", 4)
    ck = pyloader.open(path)
    names = [t.name for t in ck.tensors() if ".0.mlp.switch_mlp." in t.name]
    bank = core.ExpertBank.create(ck.index, names, 4)
    n = len(names)
    assert bank.span_count([(3, 0), (4, 1), (5, 2)]) == n
    assert bank.span_count([(5, 2), (3, 0), (4, 1)]) == n
    assert bank.span_count([(3, 0), (5, 1)]) == 2 * n
    assert bank.span_count([(3, 1), (4, 0)]) == 2 * n
    assert bank.span_count([]) == 0
    with pytest.raises(IndexError, match="outside the bank"):
        bank.span_count([(0, 4)])  # slot 4 is the scratch slot
    with pytest.raises(IndexError, match="outside the bank"):
        bank.span_count([(num_experts(path), 0)])
    with pytest.raises(ValueError, match="two experts"):
        bank.span_count([(1, 2), (3, 2)])


# ----------------------------------------------------------------------------
# Planning counts the caches exactly


@pytest.mark.parametrize("arch,bits,experts", [("qwen3_moe", None, 0.25), ("gpt_oss", 4, 3),
                                               ("deepseek_v3", 4, "200KB")],
                         ids=lambda v: str(v))
def test_plan_counts_the_expert_caches(ckpt, arch, bits, experts):
    """The plan's expert-cache row is exactly what loading allocates, the experts leave
    the layers' bytes, and a plan for expert caches makes no speed claim."""
    from pyloader.residency import model_budget, plan

    path = ckpt(arch, bits)
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=experts))
    live = expert_stats(model)
    layered = model_budget(path)
    cached = model_budget(path, experts=experts)
    assert cached.expert_cache_bytes == live["total"]["bank_bytes"] > 0
    assert cached.expert_slots == next(iter(live["layers"].values()))["slots"]
    moe_bytes = sum(e.expert_bytes * e.num_experts for e in cached.expert_layers)
    assert sum(layered.layer_bytes) - sum(cached.layer_bytes) == moe_bytes > 0
    assert layered.expert_cache_bytes == 0
    p = plan(path, "4GB", options=pyloader.StreamOptions(experts=experts), calibration=None)
    assert p.table.expert_cache == cached.expert_cache_bytes
    assert p.table.total == (p.table.resident_weights + p.table.kv_cache + p.table.activations
                             + p.table.stream_buffer + p.table.runtime + p.table.expert_cache)
    assert p.prediction is None and "expert caches" in p.render()
    mapped = model_budget(path, experts=experts, expert_source="mmap")
    assert mapped.expert_cache_bytes == mapped.expert_slots * sum(
        e.expert_bytes for e in mapped.expert_layers)


def test_cli_plan_with_experts(ckpt, capsys):
    from pyloader.cli import main

    path = ckpt("qwen3_moe", 4)
    capsys.readouterr()  # mlx-lm's quantization prints when the fixture builds it here
    assert main(["plan", str(path), "--ram", "2GB", "--experts", "0.25", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(experts=0.25))
    assert d["table"]["expert_cache"] == expert_stats(model)["total"]["bank_bytes"]
    assert d["model"]["expert_slots"] == 4 and d["prediction"] is None
    assert main(["plan", str(path), "--ram", "2GB", "--experts", "2"]) == 0
    assert "expert caches" in capsys.readouterr().out
    assert main(["plan", str(path), "--experts", "1B"]) == 2
    assert "more than the budget" in capsys.readouterr().err


def test_cli_compare_with_expert_caches(ckpt, tmp_path, capsys):
    """``pyloader compare --strategies mlx-lm,stream-experts`` runs each cache size in its
    own child, with mlx-lm's tokens and the caches' hit rate in the table; the default
    strategies leave ``stream-experts`` out."""
    from pyloader.compare import genbench
    from pyloader.cli import main

    assert "stream-experts" not in genbench.DEFAULT_STRATEGIES
    path = ckpt("qwen3_moe", 4)
    out = tmp_path / "cmp"
    code = main(["compare", str(path), "--strategies", "mlx-lm,stream-experts",
                 "--resident", "0.25,2", "--kv", "default", "--kernels", "mlx", "--runs", "1",
                 "--max-tokens", "6", "--no-plots", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    report = json.loads((out / "results.json").read_text())
    runs = {r["strategy"]: r for r in report["runs"]}
    assert set(runs) == {"mlx-lm", "stream-experts@0.25", "stream-experts@2"}
    assert all(r["identical"] for r in runs.values())
    for label in ("stream-experts@0.25", "stream-experts@2"):
        r = runs[label]
        assert 0 <= r["expert_hit_rate"] < 1 and r["expert_bytes_read"] > 0
        assert r["expert_bank_bytes"] > 0
    assert "expert_hit_rate" not in runs["mlx-lm"]
    assert (runs["stream-experts@0.25"]["expert_bank_bytes"]
            > runs["stream-experts@2"]["expert_bank_bytes"])  # 16 experts: 4 vs 2 slots
    assert "hit" in printed.out and "stream-experts@2" in printed.out
    with pytest.raises(ValueError, match="only stream and stream-experts take"):
        genbench.Config.parse("mmap@0.5")


# ----------------------------------------------------------------------------
# Two threads on one model (a server may call it from several)


@pytest.mark.parametrize("resident", [1.0, 0])
@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_two_threads_generate_on_one_model(ckpt, strategy, resident):
    """Two threads generating at once on one model with an expert cache (4 of 16
    experts per layer) each get the tokens a single-threaded run gives: a call's
    output is evaluated before another can refill the slots it reads (before: both
    threads got other tokens, no error)."""
    import threading

    path = ckpt("qwen3_moe")
    prompts = [PROMPT[:24], PROMPT[24:48]]
    model, _ = pyloader.load_model(path, resident=resident, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy=strategy, experts=4))
    single = [greedy(model, p, 12) for p in prompts]
    for _ in range(3):
        out: list = [None, None]
        barrier = threading.Barrier(2)

        def run(i):
            barrier.wait()
            out[i] = greedy(model, prompts[i], 12)

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == single
    assert expert_stats(model)["total"]["evictions"] > 0  # the slots did turn over
