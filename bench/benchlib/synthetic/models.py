"""Random-weight mlx-lm models of a chosen size for tests and benchmarks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from pyloader.compare.system import count_layers
from pyloader.heads import is_head_tensor
from pyloader.io.checkpoint import Checkpoint
from .tokenizer import write_tokenizer

MARKER = "pyloader-synthetic-model.json"


def llama_config(size_bytes: int, itemsize: int = 2) -> dict:
    """A llama config (hidden 2048, vocab 8192) with as many layers as fit."""
    hidden, inter, vocab = 2048, 5632, 8192
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * itemsize
    fixed = (2 * vocab * hidden + hidden) * itemsize
    layers = max(2, (size_bytes - fixed) // per_layer)
    return dict(model_type="llama", hidden_size=hidden, num_hidden_layers=int(layers),
                intermediate_size=inter, num_attention_heads=16, num_key_value_heads=16,
                rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=4096,
                tie_word_embeddings=False)


def qwen3_config(size_bytes: int, itemsize: int = 2) -> dict:
    """A qwen3 config (hidden 2048, vocab 8192) with as many layers as fit."""
    hidden, inter, vocab, heads, kv, hd = 2048, 5632, 8192, 16, 8, 128
    per_layer = (2 * hidden * heads * hd + 2 * hidden * kv * hd + 3 * hidden * inter
                 + 2 * hidden + 2 * hd) * itemsize
    fixed = (2 * vocab * hidden + hidden) * itemsize
    layers = max(2, (size_bytes - fixed) // per_layer)
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=int(layers),
                intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=hd, rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=1000000.0,
                max_position_embeddings=4096, tie_word_embeddings=False)


#: Architectures :func:`make_model` writes: (config for a size, mlx-lm module).
MODEL_ARCHS = {"llama": llama_config, "qwen3": qwen3_config}


def make_model(path: str | os.PathLike[str], size_bytes: int, *, dtype: str = "bf16",
               seed: int = 0, arch: str = "llama") -> Path:
    """Writes (once, reused while the marker matches) a random-weight ``arch`` model."""
    import importlib

    if arch not in MODEL_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(MODEL_ARCHS)}, not {arch!r}")
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    path = Path(path)
    spec = {"size_bytes": size_bytes, "dtype": dtype, "seed": seed, "version": 1}
    if arch != "llama":  # (llama models were written before the field existed)
        spec["arch"] = arch
    marker = path / MARKER
    dt = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}[dtype]
    config = MODEL_ARCHS[arch](size_bytes, dt.size)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return write_tokenizer(path, config["vocab_size"])  # (older ones had none)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: (p * 0.5).astype(dt), model.parameters()))
    mx.eval(model.parameters())
    return _save(path, model, config, marker, spec)


def _save(path: Path, model, config: dict, marker: Path, spec: dict) -> Path:
    """Writes the model, its config and tokenizer, then the marker that says it is whole."""
    from mlx_lm.utils import save_config, save_model

    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, config["vocab_size"])
    marker.write_text(json.dumps(spec))
    return path


def make_variant(src: str | os.PathLike[str], dst: str | os.PathLike[str], tail: int, *,
                 seed: int, scale: float = 0.05) -> Path:
    """A "fine-tuned" copy of ``src``: seeded noise on its head, the rest byte-identical."""
    src, dst = Path(src), Path(dst)
    ckpt = Checkpoint(src)
    layers = count_layers(ckpt.keys())
    weights: dict = {}
    for f in ckpt.files:
        weights.update(mx.load(f))
    key = mx.random.key(seed)
    for name in sorted(weights):
        w = weights[name]
        if not is_head_tensor(name, layers, tail) or not mx.issubdtype(w.dtype, mx.floating):
            continue
        key, sub = mx.random.split(key)
        noise = mx.random.normal(w.shape, key=sub) * scale
        weights[name] = (w.astype(mx.float32) * (1 + noise)).astype(w.dtype)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    for entry in src.iterdir():
        if entry.is_file() and entry.suffix != ".safetensors" and \
                entry.name != "model.safetensors.index.json":
            shutil.copy2(entry, dst / entry.name)
    return dst


MOE_MARKER = "pyloader-synthetic-moe.json"


def moe_config(size_bytes: int, *, bits: int | None = 4, num_experts: int = 64,
               top_k: int = 4, hidden: int = 1024, moe_intermediate: int = 512) -> dict:
    """A qwen3_moe config with as many layers as fit (``bits=None``: float32)."""
    per_weight = 0.5 + 8 / 64 if bits == 4 else 4.0
    vocab, heads, kv_heads, head_dim = 8192, 8, 4, hidden // 8
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = (attention + 3 * hidden * moe_intermediate * num_experts) * per_weight
    per_layer += hidden * num_experts * (1 + 8 / 64 if bits == 4 else 4)  # router (8-bit)
    fixed = 2 * vocab * hidden * per_weight
    layers = max(2, int((size_bytes - fixed) // per_layer))
    return dict(model_type="qwen3_moe", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=4 * hidden, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=num_experts,
                num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
                moe_intermediate_size=moe_intermediate, rms_norm_eps=1e-6, vocab_size=vocab,
                rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
                norm_topk_prob=True)


def make_moe_model(path: str | os.PathLike[str], size_bytes: int, *, bits: int | None = 4,
                   num_experts: int = 64, top_k: int = 4, skew: float = 0.2,
                   token_scale: float = 16.0, seed: int = 0) -> Path:
    """Writes (once) a random-weight qwen3_moe whose routing has locality.

    With ``bits``, the model is quantized before anything is computed and the experts get
    random codes straight from numpy (scales and biases of the float init's range), so no
    float expert weight is ever drawn or quantized: a 1 GB model takes seconds."""
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import quantize_model

    path = Path(path)
    spec = {"size_bytes": size_bytes, "bits": bits, "num_experts": num_experts,
            "top_k": top_k, "skew": skew, "token_scale": token_scale, "seed": seed,
            "version": 4}
    marker = path / MOE_MARKER
    config = moe_config(size_bytes, bits=bits, num_experts=num_experts, top_k=top_k)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return write_tokenizer(path, config["vocab_size"])  # (older ones had none)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    # float32 throughout: MLX's CPU kernels favour float32 activations.
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    # The float (lazy) tables the calibration changes, kept before quantization.
    gate_weights = [layer.mlp.gate.weight for layer in model.model.layers]
    table = model.model.embed_tokens.weight
    if bits is not None:
        # quantize_model prints to stdout: keep it out of the command's output.
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size=64, bits=bits,
                                           quant_predicate=model.quant_predicate)
        _random_expert_codes(model, rng)
    u = rng.standard_normal(hidden).astype(np.float32)
    u /= np.linalg.norm(u)
    row = float(mx.sqrt(mx.mean(mx.sum(table * table, axis=1))))
    _set_weight(model.model.embed_tokens,
                token_scale * table + token_scale * 0.5 * row * mx.array(u))
    zipf = 1.0 / np.arange(1, num_experts + 1)
    logp = np.log(zipf / zipf.sum())
    # 16 tokens: the routers' input is dominated by the embeddings' shared component along
    # u, so its mean is steady, and MLX's CPU expert products cost per token.
    probe = mx.array(rng.integers(0, vocab, size=(1, 16)))
    gates = [layer.mlp.gate for layer in model.model.layers]

    def calibrate(i, x):
        # Router input of layer i depends only on layers < i: one pass calibrates all.
        gate = gates[i]
        along = float(mx.mean(x.astype(mx.float32) @ mx.array(u)))
        order = rng.permutation(num_experts)
        bias = (skew * logp[order] / along).astype(np.float32)
        weight = gate_weights[i] + mx.array(bias[:, None] * u[None, :])
        _set_weight(gate, weight)
        mx.eval(gate.parameters())
        return x @ weight.T

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate = lambda x, i=i: calibrate(i, x)  # for the calibration pass only
    try:
        model(probe)
    finally:
        for layer, gate in zip(model.model.layers, gates):
            layer.mlp.gate = gate
    mx.eval(model.parameters())
    return _save(path, model, config, marker, spec)


def _set_weight(module, weight: mx.array) -> None:
    """Sets a linear or embedding module's float weight, quantized as the module is."""
    if "scales" in module:
        module.weight, module.scales, module.biases = mx.quantize(weight, module.group_size,
                                                                  module.bits)
    else:
        module.weight = weight


def _random_expert_codes(model, rng: np.random.Generator) -> None:
    """Gives every quantized expert projection uniform random codes, with the scale and
    bias that map them onto the float init's range, +-1/sqrt(input size)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    for _, module in model.named_modules():
        if not isinstance(module, QuantizedSwitchLinear):
            continue
        shape = module.weight.shape
        bound = (module.scales.shape[-1] * module.group_size) ** -0.5
        module.weight = mx.array(rng.integers(0, 2**32, size=shape, dtype=np.uint32))
        levels = 2**module.bits - 1
        module.scales = mx.full(module.scales.shape, 2 * bound / levels, mx.float32)
        module.biases = mx.full(module.biases.shape, -bound, mx.float32)
