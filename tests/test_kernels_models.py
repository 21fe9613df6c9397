"""Models computed with pyloader's CPU kernels (load_model(kernels="auto")).

The reference is the same weights in float64 (quantized ones dequantized exactly) run
with MLX's ops. The measure (docs/kernels.md):

* logits: the largest deviation of pyloader's logits from the reference's, over a
  teacher-forced sequence, is at most twice MLX's own (``kernels="mlx"``), plus 1e-5 of
  the logits' scale;
* greedy tokens: each token pyloader's model picks is the reference's pick on the same
  prefix, except at a near-tie: a step where the reference's margin between its pick and
  pyloader's is smaller than twice MLX's own largest logit deviation on that model (each
  of the two logits may move by that much, so MLX's kernels could have flipped it too).

Streaming composes with the kernels: a streamed model (resident=0, or expert caches)
gives exactly the tokens of the resident one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.generate import generate_step
from models import make_model_dir
from moe_models import make_moe_dir
from reference64 import float64_reference

import pyloader
from pyloader import _core

PROMPT = [1, 5, 9, 33, 7, 100, 2, 45]
N_TOKENS = 12


def greedy(model) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)]


def all_logits(model, tokens: list[int]) -> np.ndarray:
    out = model(mx.array([tokens]))
    return np.array(out[0].astype(mx.float64) if out.dtype == mx.float64
                    else out[0].astype(mx.float32)).astype(np.float64)


def check_against_reference(path, ref_dtype=mx.float64, **load_kw) -> list[int]:
    ours, _ = pyloader.load_model(path, kernels="auto", tokenizer=False, **load_kw)
    theirs, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    ref = float64_reference(path, ref_dtype)
    tokens = greedy(ours)
    seq = PROMPT + tokens
    l_ref, l_ours, l_mlx = all_logits(ref, seq), all_logits(ours, seq), all_logits(theirs, seq)
    scale = np.abs(l_ref).max()
    dev_ours, dev_mlx = np.abs(l_ours - l_ref).max(), np.abs(l_mlx - l_ref).max()
    assert dev_ours <= 2 * dev_mlx + 1e-5 * scale, (
        f"{path.name}: logits deviate {dev_ours:.3g} from float64, MLX's {dev_mlx:.3g}")
    for i, t in enumerate(tokens):
        row = l_ref[len(PROMPT) - 1 + i]
        pick = int(np.argmax(row))
        if pick != t:
            margin = row[pick] - row[t]
            assert margin < 2 * dev_mlx, (
                f"{path.name}: step {i} picked {t}, the reference {pick} by a margin "
                f"{margin:.3g}, more than twice MLX's own deviation {dev_mlx:.3g}")
    return tokens


VARIANTS = [("bf16", mx.bfloat16, None), ("f16-q4", mx.float16, 4), ("bf16-q8", mx.bfloat16, 8),
            ("f32-q4", mx.float32, 4), ("f32", mx.float32, None)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("name,dtype,bits", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_kernels_match_the_float64_reference(tmp_path, arch, name, dtype, bits):
    path = make_model_dir(tmp_path / f"{arch}-{name}", arch, dtype=dtype, bits=bits)
    check_against_reference(path)


@pytest.mark.parametrize("arch,bits,mode", [("qwen3_moe", None, "affine"),
                                            ("qwen3_moe", 4, "affine"), ("mixtral", 4, "affine"),
                                            ("gpt_oss", 4, "mxfp4")])
def test_moe_kernels_match_the_float32_reference(tmp_path, arch, bits, mode):
    """Mixture-of-experts models (pyloader's gather kernels for the experts; gpt-oss in
    its own mxfp4 format). The reference is float32: MLX's CPU gather_mm takes no other
    dtype."""
    path = make_moe_dir(tmp_path / f"{arch}-{bits}-{mode}", arch, bits=bits, mode=mode)
    if mode == "mxfp4":
        model, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
        report = pyloader.kernels.install(model, "auto")
        assert not report.kept and any("experts" in r for r in report.replaced), report
    check_against_reference(path, mx.float32)


@pytest.mark.parametrize("load_kw", [
    {"resident": 0},
    {"resident": 0, "options": pyloader.StreamOptions(strategy="pread")},
    {"resident": 0.5, "options": pyloader.StreamOptions(granularity="sublayer")}],
                         ids=["streamed-mmap", "streamed-pread", "sublayer"])
def test_streamed_model_gives_the_resident_tokens(tmp_path, load_kw):
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.bfloat16, bits=4)
    resident, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
    streamed, _ = pyloader.load_model(path, kernels="auto", tokenizer=False, **load_kw)
    assert pyloader.stats(streamed)["streamed_units"] > 0
    # A streamed layer's modules carry hooks while it is out: the kernels are under them.
    for name, m in streamed.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.RMSNorm)):
            assert isinstance(m, (pyloader.kernels.CpuQuantizedLinear,
                                  pyloader.kernels.CpuRMSNorm)), (name, type(m))
    assert greedy(streamed) == greedy(resident)


def test_expert_streamed_moe_gives_the_resident_tokens(tmp_path):
    path = make_moe_dir(tmp_path / "moe", "qwen3_moe", bits=4)
    resident, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
    cached, _ = pyloader.load_model(path, kernels="auto", tokenizer=False,
                                    options=pyloader.StreamOptions(strategy="pread", experts=0.5))
    check = greedy(resident)
    assert greedy(cached) == check
    report = pyloader.kernels.install(resident, "auto")
    switch = [n for n in report.replaced if "switch_mlp" in n or "experts" in n]
    assert switch, report.replaced


def test_kernels_choice_comes_from_the_environment(tmp_path, monkeypatch):
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.bfloat16, bits=4)
    monkeypatch.setenv("PYLOADER_KERNELS", "auto")
    model, _ = pyloader.load_model(path, tokenizer=False)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "CpuQuantizedLinear"
    monkeypatch.setenv("PYLOADER_KERNELS", "mlx")
    model, _ = pyloader.load_model(path, tokenizer=False)
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear
    monkeypatch.setenv("PYLOADER_KERNELS", "fast")
    with pytest.raises(ValueError, match="PYLOADER_KERNELS='fast'"):
        pyloader.load_model(path, tokenizer=False)


def test_serve_and_generate_pass_the_kernels_choice_on():
    from pyloader.cli import main
    from pyloader.serving.settings import ServeOptions

    assert ServeOptions(kernels="mlx").load_kwargs()["kernels"] == "mlx"
    assert ServeOptions().load_kwargs()["kernels"] is None  # load_model's default
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--kernels", "fast"])


def test_attention_kernel_runs_only_for_models_with_kernels(tmp_path, monkeypatch):
    """The model code module's attention and swiglu functions are shared by every model
    of that architecture: they run pyloader's kernels only while a model with
    kernels="auto" computes, so a kernels="mlx" model in the same process still gives mlx-lm's logits
    bit for bit."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.float16)
    calls, swiglu_calls = [], []
    real = pyloader.kernels.core

    class Counting:
        def __getattr__(self, name):
            if name == "cpu_attention":
                return lambda *a, **k: calls.append(a[0].shape) or real.cpu_attention(*a, **k)
            if name == "cpu_swiglu":
                return lambda *a: swiglu_calls.append(a[0].shape) or real.cpu_swiglu(*a)
            return getattr(real, name)

    monkeypatch.setattr(pyloader.kernels, "core", Counting())
    fast, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
    report = pyloader.kernels.install(fast, "auto")
    assert report.attention == ["mlx_lm.models.llama"] and "attention" in report.summary()
    assert report.swiglu == ["mlx_lm.models.llama"] and "SwiGLU" in report.summary()
    plain, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    ref, _ = mlx_lm_load_model(path)
    x = mx.array([PROMPT])
    mx.eval(fast(x))
    n_layers = len(fast.model.layers)
    assert len(calls) == n_layers  # one per layer, causal prefill
    assert len(swiglu_calls) == n_layers
    assert np.array_equal(np.array(plain(x)), np.array(ref(x)))
    assert len(calls) == n_layers  # the mlx model never reached the kernel
    assert len(swiglu_calls) == n_layers
    pyloader.kernels.install(fast, "mlx")
    assert np.array_equal(np.array(fast(x)), np.array(ref(x)))
    assert len(calls) == n_layers


def batch_greedy(model, rows: list[list[int]], steps: int):
    """Greedy decoding of left-padded ``rows`` as one batch through mlx-lm's
    ``BatchKVCache(left_padding=...)`` (as its docstring shows): every position's logits
    of the prompt and of each step (float32), and each row's tokens."""
    from mlx_lm.models.cache import BatchKVCache

    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    x = mx.array([[0] * p + r for p, r in zip(pads, rows)])
    cache = [BatchKVCache(left_padding=pads) for _ in model.layers]
    logits, tokens = [], []
    for _ in range(steps):
        out = model(x, cache=cache).astype(mx.float32)
        logits.append(np.array(out))
        x = mx.argmax(out[:, -1], axis=-1)[:, None]
        tokens.append(np.array(x)[:, 0].tolist())
    return logits, [list(t) for t in zip(*tokens)], pads


@pytest.fixture(params=list(_core.kernel_isas()))
def level(request):
    """Runs the test at one SIMD level, then restores the default."""
    before = _core.kernel_isa()
    _core.set_kernel_isa(request.param)
    yield request.param
    _core.set_kernel_isa(before)


def test_left_padded_batch_gives_mlx_tokens_and_finite_padded_rows(level):
    """A hand-made batch of prompts of different lengths, left-padded: a padded
    position's query keeps no key (MLX computes it as the mean of the values, finite).
    With pyloader's kernels, at every SIMD level, every position of every row is finite
    and each row's greedy tokens are those of kernels="mlx"."""
    path = pyloader.default_model_path()
    ours, tokenizer = pyloader.load_model(path, kernels="auto")
    theirs, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    assert pyloader.kernels.install(ours, "auto").attention
    rows = [tokenizer.encode("The capital of France is"), tokenizer.encode("Hello"),
            tokenizer.encode("One, two, three, four,")]
    l_ours, t_ours, pads = batch_greedy(ours, rows, steps=8)
    l_mlx, t_mlx, _ = batch_greedy(theirs, rows, steps=8)
    assert max(pads) > 0 and min(pads) == 0
    for step, (a, b) in enumerate(zip(l_ours, l_mlx)):
        assert np.isfinite(b).all(), f"step {step}: MLX's own logits are not finite"
        assert np.isfinite(a).all(), (
            f"step {step}: rows {sorted(set(np.argwhere(~np.isfinite(a))[:, 0]))} not finite")
    assert t_ours == t_mlx
