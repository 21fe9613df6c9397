"""Child of tests/test_zero_copy.py: runs every path that turns bytes into MLX arrays
under whatever PYLOADER_ZERO_COPY this process was started with, and prints one JSON
line: the arrays' digests, the greedy tokens and the readers' stats.

    python zero_copy_child.py DENSE_DIR MOE_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import pyloader
from pyloader.io.readers import zero_copy_mode
from pyloader.streaming import controller_of

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, size=40)]
N_TOKENS = 8


def digest(a: mx.array) -> str:
    data = bytes(memoryview(a.reshape(-1).view(mx.uint8))) if a.size else b""
    return f"{a.dtype}{a.shape}:{hashlib.sha256(data).hexdigest()}"


def greedy(model, cache=None) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS,
                                             prompt_cache=cache)]


def streamed(path: Path, strategy: str) -> dict:
    model, _ = pyloader.load_model(path, resident=0, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy=strategy))
    tokens = greedy(model)
    stats = controller_of(model).reads.reader.stats()
    return {"tokens": tokens, "stats": stats}


def main() -> None:
    dense, moe = Path(sys.argv[1]), Path(sys.argv[2])
    out: dict = {"mode": zero_copy_mode()}

    arrays, stats = pyloader.load_with_stats(dense / "model.safetensors", strategy="mmap")
    out["load"] = {"digests": {n: digest(a) for n, a in arrays.items()},
                   "stats": {k: getattr(stats, k) for k in (
                       "tensors", "zero_copy_tensors", "copied_tensors", "zero_copy_mode",
                       "zero_copy_verified")}}
    del arrays

    out["stream_mmap"] = streamed(dense, "mmap")
    out["stream_pread"] = streamed(dense, "pread")

    model, _ = pyloader.load_model(dense, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="mmap"))
    cache = pyloader.make_kv_cache(model, max_context=256)
    out["kv"] = {"tokens": greedy(model, cache),
                 "offsets": [c.offset for c in cache]}
    del model, cache

    model, _ = pyloader.load_model(moe, resident=0, tokenizer=False,
                                   options=pyloader.StreamOptions(experts=2))
    out["experts_bank"] = {"tokens": greedy(model),
                           "stats": controller_of(model).reads.reader.stats()}
    del model
    try:
        model, _ = pyloader.load_model(
            moe, tokenizer=False, options=pyloader.StreamOptions(experts=2, expert_source="mmap"))
        out["experts_mmap"] = {"tokens": greedy(model)}
    except pyloader.UnsupportedError as e:
        out["experts_mmap"] = {"error": str(e)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
