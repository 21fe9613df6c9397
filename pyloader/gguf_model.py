"""The mlx-lm model of a GGUF file, its tensors computed in place.

The model is mlx-lm's own class for the architecture; each linear layer and the embedding
become :class:`GGMLLinear` and :class:`GGMLEmbedding`, whose weight is the file's tensor as
it lies there (a uint8 ``(rows, row bytes)`` array of blocks, or a float array), computed
by pyloader's CPU kernels. Activations are float32, as llama.cpp computes them.
See docs/gguf.md.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import cpu_kernels
from .errors import FormatError, UnsupportedError
from .io.gguf_affine import AFFINE_TYPES, GROUP_SIZE, to_affine
from .io.gguf_source import GGUFSource, block_shape
from .io.readers import MmapReader

_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def _bytes(weight: mx.array) -> mx.array:
    """The tensor's bytes as the kernels take them (a float tensor reinterpreted, no copy)."""
    return weight if weight.dtype == mx.uint8 else mx.view(weight, mx.uint8)


def _weight(ggml_type: str, rows: int, k: int) -> mx.array:
    """A placeholder of the file tensor's in-memory shape and dtype (replaced at load)."""
    if ggml_type in _DTYPES:
        return mx.zeros((rows, k), dtype=_DTYPES[ggml_type])
    return mx.zeros(block_shape(ggml_type, (rows, k)), dtype=mx.uint8)


class GGMLLinear(nn.Module):
    """``x @ W.T (+ bias)`` with ``W`` a GGUF tensor in its file format (``ggml_type``)."""

    def __init__(self, input_dims: int, output_dims: int, ggml_type: str, bias: bool = False):
        super().__init__()
        self.ggml_type = ggml_type
        self.input_dims = input_dims
        self.weight = _weight(ggml_type, output_dims, input_dims)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = cpu_kernels.cpu_ggml_matmul(x, _bytes(self.weight), self.ggml_type, self.input_dims)
        return y + self.bias if "bias" in self else y


class GGMLSwitchLinear(nn.Module):
    """mlx-lm's ``SwitchLinear`` (each token times the experts it is routed to) with the
    experts' stacked matrices a GGUF tensor in its file format: a uint8
    ``(experts, rows, row bytes)`` array. Expert streaming serves it as mlx-lm's."""

    stacked_experts = True

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, ggml_type: str):
        super().__init__()
        self.ggml_type = ggml_type
        self.input_dims = input_dims
        self.weight = mx.zeros(block_shape(ggml_type, (num_experts, output_dims, input_dims)),
                               dtype=mx.uint8)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return cpu_kernels.cpu_gather_ggml_matmul(x, self.weight, self.ggml_type,
                                                  self.input_dims, indices)


class GGMLEmbedding(nn.Module):
    """Token embeddings stored as a GGUF tensor: the rows asked for, dequantized to float32
    exactly; ``as_linear`` is the tied output projection."""

    def __init__(self, num_embeddings: int, dims: int, ggml_type: str):
        super().__init__()
        self.ggml_type = ggml_type
        self.dims = dims
        self.weight = _weight(ggml_type, num_embeddings, dims)

    def __call__(self, ids: mx.array) -> mx.array:
        rows = _bytes(self.weight[ids.reshape(-1)])
        out = cpu_kernels.ggml_dequantize(rows, self.ggml_type, self.dims)
        return out.reshape(*ids.shape, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        return cpu_kernels.cpu_ggml_matmul(x, _bytes(self.weight), self.ggml_type, self.dims)


class FloatEmbedding(nn.Embedding):
    """An embedding stored in half precision whose rows (and tied projection) are float32,
    as the rest of a GGUF model computes."""

    def __call__(self, ids: mx.array) -> mx.array:
        return super().__call__(ids).astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight.T


class FactoredRoPE(nn.Module):
    """RoPE with llama.cpp's per-pair frequency factors (``rope_freqs.weight``, how a GGUF file
    holds Llama 3.1-style scaling): pair i turns at ``base ** (-2i / dims) / factor[i]``."""

    def __init__(self, dims: int, base: float, factors: tuple[float, ...], traditional: bool):
        super().__init__()
        self.dims, self.traditional = dims, traditional
        wavelengths = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
        self._freqs = mx.array((wavelengths * np.asarray(factors)).astype(np.float32))

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


def _base_model(source: GGUFSource, model_config: dict[str, Any] | None) -> nn.Module:
    config = {**source.config, **(model_config or {})}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if config["model_type"] in ("gemma2", "gemma3_text"):
        _stored_norms(model, arch.RMSNorm)
    if config["model_type"] == "gemma3_text" and config["tie_word_embeddings"]:
        model.sanitize({})  # mlx-lm's gemma3 ties when no lm_head.weight comes
    if source.rope_factors is not None:
        rope = FactoredRoPE(config["head_dim"], config["rope_theta"], source.rope_factors,
                            traditional=bool(config.get("rope_traditional")))
        for layer in model.layers:
            layer.self_attn.rope = rope
    return model


def _stored_norms(model: nn.Module, norm_class: type) -> None:
    """Gemma's RMSNorms as ``nn.RMSNorm``: mlx-lm's multiply by ``1 + weight``, and a GGUF
    file stores that sum (llama.cpp's converter adds the 1), so the stored weight is used as
    it is, in place."""
    swaps = [(name, nn.RMSNorm(m.weight.shape[0], eps=m.eps))
             for name, m in model.named_modules()
             if isinstance(m, norm_class)]
    model.update_modules(tree_unflatten(swaps))


def skeleton(source: GGUFSource, model_config: dict[str, Any] | None = None) -> nn.Module:
    """mlx-lm's model for ``source`` with GGUF modules; every parameter matched to a file
    tensor of the right shape (FormatError naming the tensor otherwise)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    model = _base_model(source, model_config)
    swaps = []
    for name, module in model.named_modules():
        weight = f"{name}.weight"
        if weight not in source.types:
            continue
        ggml_type = source.types[weight]
        if isinstance(module, nn.Linear):
            out_dims, in_dims = module.weight.shape
            swaps.append((name, GGMLLinear(in_dims, out_dims, ggml_type, "bias" in module)))
        elif isinstance(module, nn.Embedding):
            rows, dims = module.weight.shape
            swaps.append((name, GGMLEmbedding(rows, dims, ggml_type)))
        elif isinstance(module, SwitchLinear) and ggml_type not in _DTYPES:
            if "bias" in module:
                raise UnsupportedError(f"{source.path}: {name} has expert biases, which no "
                                       "GGUF tensor holds")
            experts, out_dims, in_dims = module.weight.shape
            swaps.append((name, GGMLSwitchLinear(in_dims, out_dims, experts, ggml_type)))
        elif ggml_type not in _DTYPES:
            raise UnsupportedError(f"{source.path}: {weight} is {ggml_type}; a block format "
                                   f"is computed for linear layers only, not {type(module)}")
    model.update_modules(tree_unflatten(swaps))
    _check_fit(source, model, {
        name: shape if source.types[name] in _DTYPES else block_shape(source.types[name], shape)
        for name, shape in source.shapes.items()})
    return model


def _check_fit(source: GGUFSource, model: nn.Module, stored: dict[str, tuple]) -> None:
    """Every parameter of ``model`` has a file tensor of its shape as loaded (``stored``:
    parameter name -> that shape), and every file tensor a parameter."""
    params = dict(tree_flatten(model.parameters()))
    missing = sorted(set(params) - set(stored))
    if missing:
        raise FormatError(f"{source.path}: the {source.arch} model needs {missing[0]}, which "
                          f"no tensor of the file maps to ({len(missing)} missing)")
    extra = sorted(set(stored) - set(params))
    if extra:
        raise UnsupportedError(f"{source.path}: tensor for {extra[0]} has no parameter in "
                               f"mlx-lm's {source.arch} model")
    for name, p in params.items():
        if tuple(stored[name]) != tuple(p.shape):
            raise FormatError(f"{source.path}: {name}: shape {tuple(stored[name])} as loaded "
                              "from the file, but the metadata makes the parameter "
                              f"{tuple(p.shape)}")


def load_for_mlx(source: GGUFSource, model_config: dict[str, Any] | None = None) -> nn.Module:
    """The model with MLX's own modules: the block formats MLX computes exactly
    (:data:`AFFINE_TYPES`) rewritten into its affine format in memory, float tensors as views
    of the file. Any other block format raises :class:`pyloader.UnsupportedError` naming the
    tensor: MLX would need it requantized, which changes the weights."""
    model = _base_model(source, model_config)
    for name, ggml_type in source.types.items():
        if ggml_type not in _DTYPES and ggml_type not in AFFINE_TYPES:
            raise UnsupportedError(
                f"{source.path}: {name} is {ggml_type}, which MLX's ops cannot compute "
                f"without requantizing it (MLX computes {', '.join(AFFINE_TYPES)} exactly); "
                "pyloader's CPU kernels compute it in place: kernels='auto' on the CPU")
    swaps = []
    for name, module in model.named_modules():
        ggml_type = source.types.get(f"{name}.weight")
        if ggml_type in AFFINE_TYPES:
            swaps.append((name, _quantized(source, name, module, AFFINE_TYPES[ggml_type])))
        elif ggml_type in _DTYPES and isinstance(module, nn.Embedding):
            rows, dims = module.weight.shape
            swaps.append((name, FloatEmbedding(rows, dims)))
    model.update_modules(tree_unflatten(swaps))
    weights = {}
    for name, arr in MmapReader(source.checkpoint).load().items():
        ggml_type = source.types[name]
        if ggml_type in AFFINE_TYPES:
            base = name.removesuffix(".weight")
            packed, scales, biases = to_affine(np.asarray(arr), ggml_type)
            weights.update({name: mx.array(packed), f"{base}.scales": mx.array(scales),
                            f"{base}.biases": mx.array(biases)})
        else:
            weights[name] = arr
    _check_fit(source, model, {name: w.shape for name, w in weights.items()})
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _quantized(source: GGUFSource, name: str, module: nn.Module, bits: int) -> nn.Module:
    """MLX's quantized module in place of ``module`` (its arrays replaced at load)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if isinstance(module, SwitchLinear):
        experts, out_dims, in_dims = module.weight.shape
        return QuantizedSwitchLinear(in_dims, out_dims, experts, bias="bias" in module,
                                     group_size=GROUP_SIZE, bits=bits)
    if isinstance(module, nn.Embedding):
        rows, dims = module.weight.shape
        return nn.QuantizedEmbedding(rows, dims, group_size=GROUP_SIZE, bits=bits)
    if isinstance(module, nn.Linear):
        out_dims, in_dims = module.weight.shape
        return nn.QuantizedLinear(in_dims, out_dims, bias="bias" in module,
                                  group_size=GROUP_SIZE, bits=bits)
    raise UnsupportedError(f"{source.path}: {name}.weight is block-quantized; a block format "
                           "is computed for linear layers, experts and embeddings only")
