"""Real mlx-lm architectures: weights from every strategy give the same
logits and greedy tokens as plain mx.load + mlx-lm, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

import pyloader
from helpers import tensor_bytes
from models import logits, make_model_dir, model_with_weights, repad_header

CASES = {
    "llama-bf16": ("llama", mx.bfloat16, None),
    "llama-bf16-odd": ("llama", mx.bfloat16, None),  # every tensor at an odd offset
    "qwen2-f16": ("qwen2", mx.float16, None),
    "qwen3-bf16": ("qwen3", mx.bfloat16, None),
    "llama-4bit": ("llama", mx.bfloat16, 4),
    "qwen3-4bit": ("qwen3", mx.bfloat16, 4),
}
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]


@pytest.fixture(scope="module", params=sorted(CASES))
def model_case(request, tmp_path_factory):
    arch, dtype, bits = CASES[request.param]
    path = make_model_dir(tmp_path_factory.mktemp(request.param), arch, dtype=dtype, bits=bits)
    if request.param.endswith("-odd"):
        repad_header(path / "model.safetensors", residue=1)
        assert not any(t.aligned for t in pyloader.open(path).tensors())
    baseline, _ = load_model(path)
    return path, baseline, bits


def greedy(model, n=8) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=n):
        out.append(int(token))
    return out


@pytest.mark.parametrize("strategy,misaligned", [("mmap", False), ("mmap", True),
                                                 ("pread", False), ("mlx", False)])
def test_same_logits_and_tokens(model_case, strategy, misaligned):
    path, baseline, bits = model_case
    weights, stats = pyloader.load_with_stats(path, strategy, allow_misaligned=misaligned)
    ref = mx.load(str(path / "model.safetensors"))
    for name, arr in ref.items():
        assert tensor_bytes(weights[name]) == tensor_bytes(arr), name
    if bits:
        assert any(v.dtype == mx.uint32 for v in weights.values())
    if misaligned:
        assert stats.copied_tensors == 0  # every tensor a view of the mapping
    elif strategy == "mmap":
        aligned = [t for t in pyloader.open(path).tensors() if t.aligned]
        assert stats.zero_copy_tensors == len(aligned)
    model = model_with_weights(path, weights)
    assert tensor_bytes(logits(model, PROMPT)) == tensor_bytes(logits(baseline, PROMPT))
    assert greedy(model) == greedy(baseline)
