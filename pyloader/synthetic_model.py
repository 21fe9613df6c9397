"""Random-weight mlx-lm models of a chosen size, for streaming benchmarks.

Real mlx-lm model classes with fixed seeds, saved the way mlx-lm saves models
(``mlx_lm.utils.save_model``: ``mx.save_safetensors``, so tensors are packed in
hash order and mostly misaligned, as in real MLX checkpoints).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER = "pyloader-synthetic-model.json"


def llama_config(size_bytes: int, itemsize: int = 2) -> dict:
    """A llama config (hidden 2048, MHA, SwiGLU 5632, vocab 8192, untied) with
    as many layers as fit in ``size_bytes``."""
    hidden, inter, vocab = 2048, 5632, 8192
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * itemsize
    fixed = (2 * vocab * hidden + hidden) * itemsize
    layers = max(2, (size_bytes - fixed) // per_layer)
    return dict(model_type="llama", hidden_size=hidden, num_hidden_layers=int(layers),
                intermediate_size=inter, num_attention_heads=16, num_key_value_heads=16,
                rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=4096,
                tie_word_embeddings=False)


def make_model(path: str | os.PathLike[str], size_bytes: int, *, dtype: str = "bf16",
               seed: int = 0) -> Path:
    """Writes (once; reused when the marker matches) a llama model of about
    ``size_bytes`` with random weights scaled to keep activations finite."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    spec = {"size_bytes": size_bytes, "dtype": dtype, "seed": seed, "version": 1}
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    dt = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}[dtype]
    config = llama_config(size_bytes, dt.size)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: (p * 0.5).astype(dt), model.parameters()))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    marker.write_text(json.dumps(spec))
    return path


def make_variant(src: str | os.PathLike[str], dst: str | os.PathLike[str], tail: int, *,
                 seed: int, scale: float = 0.05) -> Path:
    """A "fine-tuned" variant of the model at ``src``: seeded noise on the
    floating-point tensors of its head (the last ``tail`` layers, the final
    norm, lm_head; quantized layers through their scales and biases), every
    other tensor byte-identical. Saved like mlx-lm saves models
    (``mx.save_safetensors``, one file); other files are copied."""
    import shutil

    import mlx.core as mx

    from .checkpoint import Checkpoint
    from .heads import is_head_tensor, num_layers

    src, dst = Path(src), Path(dst)
    ckpt = Checkpoint(src)
    layers = num_layers(ckpt.keys())
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
