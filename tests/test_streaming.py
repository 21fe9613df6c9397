"""Layer streaming gives the same logits and greedy tokens as plain mlx-lm,
for every architecture, residency, placement, granularity, prefetch depth
and source; streamed weights really leave memory."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import pyloader
from helpers import tensor_bytes
from models import logits, make_model_dir
from pyloader.residency import parse_bytes
from pyloader.streaming import choose_resident

MODELS = [(arch, bits) for arch in ("llama", "qwen2", "qwen3", "qwen3_5", "gemma3_text")
          for bits in (None, 4)]
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 5, 9, 11, 200]
N_TOKENS = 32


def greedy(model) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)]


@pytest.fixture(scope="module", params=MODELS, ids=lambda p: f"{p[0]}-{'q4' if p[1] else 'bf16'}")
def checkpoint(request, tmp_path_factory):
    arch, bits = request.param
    path = make_model_dir(tmp_path_factory.mktemp(arch), arch, bits=bits)
    base, _ = mlx_lm_load_model(path)
    return path, tensor_bytes(logits(base, PROMPT)), greedy(base)


CONFIGS = [c for c in itertools.product(("mmap", "pread"), (0.0, 0.5, 1.0), ("first_n", "last_n",
                                        "interleaved"), ("layer", "sublayer"), (0, 1))
           # Placement and granularity do not matter when nothing is streamed.
           if c[1] < 1.0 or (c[2], c[3]) == ("first_n", "layer")]


@pytest.mark.parametrize("strategy,resident,placement,granularity,prefetch", CONFIGS,
                         ids=lambda v: str(v))
def test_streaming_is_bit_exact(checkpoint, strategy, resident, placement, granularity,
                                prefetch, monkeypatch):
    path, ref_logits, ref_tokens = checkpoint
    model, tokenizer = pyloader.load_model(
        path, resident=resident,
        options=pyloader.StreamOptions(
            strategy=strategy, placement=placement, granularity=granularity, prefetch=prefetch))
    assert tokenizer is None  # these checkpoints carry no tokenizer files
    forwards = []
    model_call = type(model).__call__
    monkeypatch.setattr(type(model), "__call__",
                        lambda self, *a, **k: forwards.append(1) or model_call(self, *a, **k))
    assert tensor_bytes(logits(model, PROMPT)) == ref_logits
    assert greedy(model) == ref_tokens
    st = pyloader.stats(model)
    n_layers = len(model.layers)
    streamed_layers = n_layers - round(resident * n_layers)
    per_layer = 1 if granularity == "layer" else 2
    assert st["streamed_units"] == streamed_layers * per_layer
    if st["streamed_units"]:
        # One weight pass per forward call (prefill is one call per chunk, not per token).
        assert st["passes"] == len(forwards) < N_TOKENS + len(PROMPT)
        loads = {u: v["loads"] for u, v in st["units"].items()}
        assert set(loads.values()) == {st["passes"]}, loads
        if prefetch and st["streamed_units"] > 1:
            assert all(v["prefetched"] >= v["loads"] - 1 for v in st["units"].values())


def test_all_resident_is_plain_mlx_lm(checkpoint):
    path, ref_logits, _ = checkpoint
    model, _ = pyloader.load_model(path, resident=1.0)
    assert all(not type(layer).__name__.startswith("Streamed") for layer in model.layers)
    assert pyloader.stats(model)["streamed_units"] == 0


def test_streamed_layer_keeps_its_class_and_attributes(tmp_path):
    path = make_model_dir(tmp_path / "m", "gemma3_text")
    base, _ = mlx_lm_load_model(path)
    model, _ = pyloader.load_model(path, resident=0)
    for ours, theirs in zip(model.layers, base.layers):
        assert isinstance(ours, type(theirs))
        assert ours.is_sliding == theirs.is_sliding if hasattr(theirs, "is_sliding") else True


def test_pread_streamed_weights_are_dropped_after_use(tmp_path):
    path = make_model_dir(tmp_path / "m", "llama")
    model, _ = pyloader.load_model(path, resident=0,
                                   options=pyloader.StreamOptions(strategy="pread"))
    logits(model, PROMPT)
    for i, layer in enumerate(model.layers):
        for name, w in __import__("mlx.utils").utils.tree_flatten(layer.parameters()):
            # Released weights are stand-ins: the parameter's shape, no data, and
            # evaluating one raises (naming it) instead of giving a number.
            assert w.size > 1
            with pytest.raises(pyloader.StandInError, match=rf"model\.layers\.{i}\.{name} "):
                mx.eval(w)


def test_resident_selection():
    sizes = [10] * 8
    assert choose_resident(sizes, 3, "first_n") == {0, 1, 2}
    assert choose_resident(sizes, 3, "last_n") == {5, 6, 7}
    assert choose_resident(sizes, 0.5, "first_n") == {0, 1, 2, 3}
    assert choose_resident(sizes, 4, "interleaved") == {1, 3, 5, 7} or \
        len(choose_resident(sizes, 4, "interleaved")) == 4
    spread = sorted(choose_resident(sizes, 2, "interleaved"))
    assert spread[0] < 4 <= spread[1]
    assert choose_resident(sizes, "35B", "first_n", fixed_bytes=5) == {0, 1, 2}
    # A byte budget covers the streamed units in flight too, once anything streams.
    assert choose_resident(sizes, "55B", "first_n", fixed_bytes=5, stream_buffer=20) == {0, 1, 2}
    everything = sum(sizes) + 5
    assert choose_resident(sizes, f"{everything}B", "first_n", fixed_bytes=5,
                           stream_buffer=20) == set(range(len(sizes)))
    assert choose_resident(sizes, "0B", "first_n") == set()
    with pytest.raises(ValueError, match="resident=9"):
        choose_resident(sizes, 9, "first_n")
    with pytest.raises(ValueError, match="placement"):
        choose_resident(sizes, 1, "middle")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        choose_resident(sizes, 1.5, "first_n")
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("600MB") == 600_000_000
    assert parse_bytes("2G") == 2 * 10**9 and parse_bytes(".5 kib") == 512
    assert parse_bytes("4096") == parse_bytes("4096B") == 4096
    for bad in ("lots", "5 parsecs", "1.2.3GB", "-1GB", ""):
        with pytest.raises(ValueError, match="byte size"):
            parse_bytes(bad)


def test_budget_text_rounds_down_never_below_its_floor():
    """A suggested resident= budget is parseable, never above the budget (it must fit)
    and never below what it must cover (a tiny model's '0MB' warned that it could not
    be honoured)."""
    from pyloader._util.sizes import budget_text

    cases = [(1_234_567_890, 0, "1234MB"), (213_630, 0, "213kB"),
             (213_630, 213_500, "213630B"), (999, 0, "999B"), (0, 0, "0B")]
    for n, floor, text in cases:
        assert budget_text(n, floor) == text
        assert floor <= parse_bytes(text) <= n


def test_bad_arguments(tmp_path):
    path = make_model_dir(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="strategy"):
        pyloader.load_model(path, options=pyloader.StreamOptions(strategy="mlx"))
    with pytest.raises(ValueError, match="granularity"):
        pyloader.load_model(path, options=pyloader.StreamOptions(granularity="tensor"))
    with pytest.raises(ValueError, match="prefetch"):
        pyloader.load_model(path, options=pyloader.StreamOptions(prefetch=-1))
    with pytest.raises(ValueError, match="not loaded by pyloader"):
        pyloader.stats(mlx_lm_load_model(path)[0])


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_io_error_surfaces_at_the_layer(tmp_path, strategy):
    path = make_model_dir(tmp_path / "m", "llama")
    model, _ = pyloader.load_model(path, resident=0,
                                   options=pyloader.StreamOptions(strategy=strategy, prefetch=0))
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated under the running model
    with pytest.raises(OSError):
        logits(model, PROMPT)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """A llama checkpoint and a smaller draft model with the same vocabulary."""
    root = tmp_path_factory.mktemp("pair")
    main = make_model_dir(root / "main", "llama", seed=1)
    draft = make_model_dir(root / "draft", "llama", seed=2)
    return main, draft


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_batch_generation_unchanged(llama_pair, strategy):
    from mlx_lm.generate import BatchGenerator

    path, _ = llama_pair
    prompts = [PROMPT, PROMPT[3:], PROMPT[::-1]]

    def batch(model):
        gen = BatchGenerator(model, stop_tokens=[], max_tokens=12)
        uids = gen.insert(prompts, [12] * len(prompts))
        out = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append(r.token)
        gen.close()
        return [out[u] for u in uids]

    base, _ = mlx_lm_load_model(path)
    model, _ = pyloader.load_model(path, resident=0,
                                   options=pyloader.StreamOptions(strategy=strategy))
    assert batch(model) == batch(base)


def test_speculative_decoding_with_a_streamed_model(llama_pair):
    from mlx_lm.generate import speculative_generate_step

    path, draft_path = llama_pair

    def spec(model, draft):
        return [(int(t), bool(d)) for t, _, d in speculative_generate_step(
            mx.array(PROMPT), model, draft, num_draft_tokens=3, max_tokens=16)]

    base, _ = mlx_lm_load_model(path)
    base_draft, _ = mlx_lm_load_model(draft_path)
    model, _ = pyloader.load_model(path, resident=0.5,
                                   options=pyloader.StreamOptions(placement="last_n"))
    draft, _ = pyloader.load_model(draft_path, resident=0,
                                   options=pyloader.StreamOptions(strategy="pread"))
    assert spec(model, draft) == spec(base, base_draft)


def test_prompt_cache_round_trip(llama_pair, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    path, _ = llama_pair
    base, _ = mlx_lm_load_model(path)
    model, _ = pyloader.load_model(path, resident=0)

    def continue_from_cache(m):
        cache = make_prompt_cache(m)
        for _ in generate_step(mx.array(PROMPT), m, max_tokens=1, prompt_cache=cache):
            pass
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
        cache = load_prompt_cache(str(tmp_path / "c.safetensors"))
        return [int(t) for t, _ in generate_step(mx.array([5, 6]), m, max_tokens=8,
                                                 prompt_cache=cache)]

    assert continue_from_cache(model) == continue_from_cache(base)


def test_stream_measures_an_auto_resident_set(tmp_path):
    """``pyloader.stream(model, path, StreamOptions(resident="auto"))`` measures the memory
    and streams what does not fit, as load_model does (it compared a Residency with the
    string "auto" and raised instead)."""
    path = make_model_dir(tmp_path / "m", "llama")
    want = logits(mlx_lm_load_model(path)[0], [1, 2, 3])
    model, _ = mlx_lm_load_model(path, lazy=True)
    pyloader.stream(model, path, pyloader.StreamOptions(resident="auto"))
    assert mx.array_equal(logits(model, [1, 2, 3]), want)
