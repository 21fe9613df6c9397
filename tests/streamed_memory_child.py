"""Child of tests/test_zero_copy.py: how much MLX memory a streamed model holds, under
whatever PYLOADER_ZERO_COPY this process was started with. Prints one JSON line.

    python streamed_memory_child.py MODEL_DIR [--never-release]

For resident=0 and then resident=1.0 (``strategy="mmap"``, ``prefetch=1``), after the
load: ``mx.reset_peak_memory()``, greedy tokens, ``mx.get_active_memory()`` after each
token and ``mx.get_peak_memory()`` at the end, with what the bound is made of (the
non-layer bytes, the prefetch depth, the largest streamed unit, all weight bytes).
MLX counts there what its allocator holds: copies, and on Metal every buffer
``make_buffer`` wrapped (its residency set); the CPU allocator's views are not
allocations and count nothing.

``--never-release`` makes the mmap reads' release do nothing once the resident=0 model
is loaded (a streamed unit's arrays stay attached until the unit is brought in again):
what the bound must catch.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from zero_copy_child import N_TOKENS, PROMPT

import pyloader
from pyloader.io.readers import zero_copy_mode
from pyloader.streaming import controller_of
from pyloader.streaming.reads import MmapReads


def measure(path: Path, resident: float, never_release: bool = False) -> dict:
    model, _ = pyloader.load_model(path, resident=resident, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="mmap", prefetch=1))
    if never_release:  # after the load, which releases each unit once
        MmapReads.release = lambda self, unit: None
    layout = controller_of(model).layout
    after_load = mx.get_active_memory()
    mx.reset_peak_memory()
    tokens, active = [], []
    for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS):
        tokens.append(int(t))
        active.append(mx.get_active_memory())
    out = {"tokens": tokens, "active_after_load": after_load, "active": active,
           "peak": mx.get_peak_memory(),
           "non_layer_bytes": layout.fixed_bytes + layout.derived_bytes,
           "depth": controller_of(model).depth,
           "largest_unit": max((u.nbytes for u in layout.units), default=0),
           "streamed_units": len(layout.units)}
    del model, layout
    gc.collect()
    mx.clear_cache()
    return out


def main() -> None:
    path = Path(sys.argv[1])
    weights = sum(a.nbytes for a in mx.load(str(path / "model.safetensors")).values())
    mx.clear_cache()
    out = {"mode": zero_copy_mode(), "weight_bytes": weights,
           "streamed": measure(path, 0, "--never-release" in sys.argv[2:]),
           "resident": measure(path, 1.0)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
