"""The float64 reference the kernels are measured against (docs/kernels.md, "How exact"):
a checkpoint's model with every weight in float64, quantized ones dequantized exactly,
run with MLX's own ops. tests/test_kernels_models.py and tests/zoo.py share it."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

import pyloader


def _float64_switch_class():
    """mlx-lm's ``SwitchLinear`` computed as a gather of each index's matrix and one
    matmul: MLX's CPU ``gather_mm`` takes float32 only, this takes any float dtype and
    is the same product."""
    from mlx_lm.models.switch_layers import SwitchLinear

    class GatheredSwitchLinear(SwitchLinear):
        def __call__(self, x, indices, sorted_indices=False):
            y = x @ self["weight"][indices].swapaxes(-1, -2)
            if "bias" in self:
                y = y + mx.expand_dims(self["bias"][indices], -2)
            return y

    return SwitchLinear, GatheredSwitchLinear


def float64_reference(path: Path, dtype=mx.float64) -> nn.Module:
    """The checkpoint's model with every weight in float64 (or ``dtype``), quantized
    ones dequantized from float64 scales and biases; expert layers gather their
    matrices so that they compute in that dtype too."""
    from mlx_lm.utils import _get_classes

    config = json.loads((Path(path) / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    model, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    modules = dict(model.named_modules())
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        prefix, leaf = name.rsplit(".", 1)
        m = modules.get(prefix)
        quantized = m is not None and hasattr(m, "bits") and "scales" in m  # Switch ones too
        if quantized and leaf in ("weight", "scales", "biases"):
            if leaf == "weight" and getattr(m, "mode", "affine") == "affine":
                weights[name] = mx.dequantize(m.weight, m.scales.astype(mx.float64),
                                              m.biases.astype(mx.float64),
                                              group_size=m.group_size,
                                              bits=m.bits).astype(dtype)
            elif leaf == "weight":  # mxfp4: FP4 values times powers of two, exact
                weights[name] = mx.dequantize(m.weight, m.scales, None, group_size=m.group_size,
                                              bits=m.bits, mode=m.mode).astype(dtype)
            continue
        weights[name] = p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p
    # The checkpoint's arrays are read only through ``weights`` from here on, and freed
    # as the reference's are computed.
    del model, modules
    model_cls, args_cls = _get_classes(config)
    ref = model_cls(args_cls.from_dict(config))
    ref.set_dtype(dtype)
    ref.load_weights(list(weights.items()), strict=True)
    if dtype != mx.float32:
        switch, gathered = _float64_switch_class()
        for _, m in ref.named_modules():
            if type(m) is switch:
                m.__class__ = gathered
    mx.eval(ref.parameters())
    return ref
