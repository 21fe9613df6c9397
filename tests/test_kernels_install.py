"""pyloader.kernels.install puts a kernel only where it computes: a layer the kernels would
refuse at its calls keeps MLX's op from the start (the report says why), and an input a
replaced layer's kernel does not take goes to MLX's op. So for any layer and input MLX
computes, ``kernels="auto"`` computes too: what MLX gives, in MLX's dtype and shape.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mlx import nn
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: F401 - Attends calls it
from mlx_lm.models.switch_layers import SwitchLinear

from pyloader import kernels

FLOATS = [mx.float32, mx.float16, mx.bfloat16]
ANY_FLOAT = [*FLOATS, mx.float64]
#: Quantization modes with the group sizes and bits MLX takes for each.
FORMATS = ([("affine", g, b) for g in (32, 64, 128) for b in (1, 2, 3, 4, 5, 6, 8)]
           + [("mxfp4", 32, 4), ("nvfp4", 16, 4), ("mxfp8", 32, 8)])


class Holder(nn.Module):
    """One layer under test, called as its model would call it."""

    def __init__(self, layer, call):
        super().__init__()
        self.layer = layer
        self.call = call

    def __call__(self, *args):
        return self.call(self.layer, *args)


def mlx_result(holder, args):
    """MLX's own result for ``args``, or None when MLX refuses them."""
    try:
        out = holder(*args)
        mx.eval(out)
        return out
    except (ValueError, RuntimeError, TypeError):
        return None


def check_auto(holder, args, name="layer"):
    """``kernels="auto"`` on a layer MLX computes: it runs, with MLX's dtype and shape
    and values close to MLX's; the layer is replaced or listed as kept with a reason."""
    theirs = mlx_result(holder, args)
    assume(theirs is not None)
    report = kernels.install(holder, "auto")
    assert (name in report.replaced or name in report.elementwise
            or report.kept.get(name)), report
    ours = holder(*args)
    mx.eval(ours)
    kernels.install(holder, "mlx")
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    a, b = (np.array(y.astype(mx.float32)).astype(np.float64) for y in (ours, theirs))
    scale = max(float(np.abs(b[np.isfinite(b)]).max(initial=0.0)), 1e-3)
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    ok = np.isfinite(b)
    assert float(np.abs(a[ok] - b[ok]).max(initial=0.0)) <= 0.05 * scale
    return report


def quantize_layer(layer, mode, group_size, bits, scales_dtype, biases_dtype):
    """``layer`` quantized as MLX does, its scales and biases then cast (a checkpoint
    may store them so)."""
    try:
        q = layer.to_quantized(group_size=group_size, bits=bits, mode=mode)
    except ValueError:  # a format or width MLX does not quantize
        assume(False)
    if mode == "affine":
        q.scales = q.scales.astype(scales_dtype)
        q.biases = q.biases.astype(biases_dtype)
    return q


def x_of(draw, k, dtype, lead=None):
    lead = draw(st.lists(st.integers(1, 3), max_size=2)) if lead is None else lead
    return (mx.random.normal((*lead, k), key=mx.random.key(draw(st.integers(0, 99))))
            * 2).astype(dtype)


@st.composite
def linear_cases(draw):
    """A dense or quantized linear layer (or an embedding's ``as_linear``) and input."""
    k = draw(st.sampled_from([32, 64, 96, 128, 256, 40]))
    n = draw(st.sampled_from([1, 8, 33]))
    embedding = draw(st.booleans())
    mx.random.seed(draw(st.integers(0, 99)))
    layer = nn.Embedding(n, k) if embedding else nn.Linear(k, n, bias=draw(st.booleans()))
    layer.set_dtype(draw(st.sampled_from(ANY_FLOAT)))
    if draw(st.booleans()):
        mode, group_size, bits = draw(st.sampled_from(FORMATS))
        layer = quantize_layer(layer, mode, group_size, bits, draw(st.sampled_from(FLOATS)),
                               draw(st.sampled_from(FLOATS)))
    x_dtype = draw(st.sampled_from([*ANY_FLOAT, mx.int32]))
    x = x_of(draw, draw(st.sampled_from([k, k, k, k + 1])), x_dtype)
    call = (lambda m, x: m.as_linear(x)) if embedding else (lambda m, x: m(x))
    return Holder(layer, call), (x,)


@st.composite
def switch_cases(draw):
    """mlx-lm's expert layers (``SwitchLinear``, ``QuantizedSwitchLinear``) as SwitchGLU
    calls them: x (batch, 1, 1, k), indices (batch, top-k)."""
    k, n, experts = draw(st.sampled_from([64, 128])), draw(st.sampled_from([8, 16])), 4
    mx.random.seed(draw(st.integers(0, 99)))
    layer = SwitchLinear(k, n, experts, bias=draw(st.booleans()))
    dtype = draw(st.sampled_from(ANY_FLOAT))
    layer.set_dtype(dtype)
    if draw(st.booleans()):
        mode, group_size, bits = draw(st.sampled_from(FORMATS))
        layer = quantize_layer(layer, mode, group_size, bits, draw(st.sampled_from(FLOATS)),
                               draw(st.sampled_from(FLOATS)))
    batch, top = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    x = x_of(draw, k, draw(st.sampled_from(ANY_FLOAT)), lead=[batch, 1, 1])
    index_dtype = draw(st.sampled_from([mx.uint32, mx.int32, mx.int64, mx.uint8, mx.int16]))
    indices = mx.random.randint(0, experts, (batch, top),
                                key=mx.random.key(draw(st.integers(0, 99)))).astype(index_dtype)
    return Holder(layer, lambda m, x, i: m(x, i)), (x, indices)


@st.composite
def norm_and_rope_cases(draw):
    """``nn.RMSNorm`` and ``nn.RoPE`` with their weights' and inputs' dtypes and shapes."""
    if draw(st.booleans()):
        n = draw(st.sampled_from([1, 16, 33]))
        layer = nn.RMSNorm(n, eps=draw(st.sampled_from([1e-5, 1e-20, 0.5])))
        layer.weight = (mx.random.normal((n,)) + 1).astype(draw(st.sampled_from(ANY_FLOAT)))
        x = x_of(draw, draw(st.sampled_from([n, n, n + 1])),
                 draw(st.sampled_from([*ANY_FLOAT, mx.int32])))
        return Holder(layer, lambda m, x: m(x)), (x,)
    d = draw(st.sampled_from([8, 16, 64]))
    layer = nn.RoPE(draw(st.sampled_from([2, 8, 16, 5, 24])), traditional=draw(st.booleans()),
                    base=draw(st.sampled_from([10000.0, 500000.0])))
    lead = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    x = x_of(draw, d, draw(st.sampled_from(ANY_FLOAT)), lead=lead)
    offset = draw(st.sampled_from([0, 7, 4000]))
    return Holder(layer, lambda m, x, o: m(x, offset=o)), (x, offset)


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@SETTINGS
@given(linear_cases())
def test_auto_computes_every_linear_layer_mlx_computes(case):
    check_auto(*case)


@SETTINGS
@given(switch_cases())
def test_auto_computes_every_expert_layer_mlx_computes(case):
    check_auto(*case)


@SETTINGS
@given(norm_and_rope_cases())
def test_auto_computes_every_norm_and_rope_mlx_computes(case):
    check_auto(*case)


def mixed_scales(bits=4):
    layer = nn.Linear(64, 32, bias=False).to_quantized(group_size=32, bits=bits)
    layer.scales = layer.scales.astype(mx.float16)
    layer.biases = layer.biases.astype(mx.bfloat16)
    return layer


def float64_linear():
    layer = nn.Linear(64, 32)
    layer.set_dtype(mx.float64)
    return layer


@pytest.mark.parametrize("make,why", [
    (mixed_scales, "biases of dtype mlx.core.bfloat16 with scales of dtype mlx.core.float16"),
    (float64_linear, "weights of dtype mlx.core.float64"),
], ids=["mixed-scales", "float64"])
def test_a_layer_the_kernels_refuse_keeps_mlx_and_the_report_says_why(make, why):
    """A quantized layer whose biases are bfloat16 and scales float16: MLX computes it
    (promoting), the kernels take one dtype for both, so the layer keeps MLX's op (as a
    float64 one does)."""
    holder = Holder(make(), lambda m, x: m(x))
    x = mx.random.normal((2, 64))
    theirs = holder(x)
    report = kernels.install(holder, "auto")
    assert report.kept == {"layer": why} and not report.replaced
    assert why in report.summary()
    assert mx.array_equal(holder(x), theirs).item()


def test_attention_computes_every_input_mlx_computes():
    """mlx-lm's attention function under a model with kernels: inputs the kernel does
    not take (batch sizes that differ, an additive mask of a wider dtype than the
    queries', an integer mask) go to mlx-lm's function, which computes or refuses them
    as it does without the kernels."""
    this = sys.modules[__name__]

    class Attends(nn.Module):
        def __call__(self, q, k, v, mask):
            return this.scaled_dot_product_attention(q, k, v, None, 0.25, mask)

    model = Holder(Attends(), lambda m, *a: m(*a))
    q16 = mx.random.normal((1, 4, 3, 16)).astype(mx.float16)
    k16 = mx.random.normal((1, 2, 5, 16)).astype(mx.float16)
    cases = [(q16, k16, k16, mx.zeros((3, 5), mx.int32)),
             (q16, k16, k16, mx.zeros((3, 5), mx.float32)),
             (mx.concatenate([q16, q16]), k16, k16, None),
             (q16, k16, k16, mx.zeros((1, 1, 1, 3, 5), mx.float16)),
             (q16, k16, k16, "causal"), (q16, k16, k16, mx.zeros((3, 5), mx.bool_))]
    expected = [mlx_result(model, c) for c in cases]
    report = kernels.install(model, "auto")
    try:
        assert report.attention == [__name__]
        for case, theirs in zip(cases, expected):
            if theirs is None:
                assert mlx_result(model, case) is None
            else:
                ours = model(*case)
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    finally:
        kernels.install(model, "mlx")
        this.scaled_dot_product_attention = getattr(
            this.scaled_dot_product_attention, "pyloader_original",
            this.scaled_dot_product_attention)
