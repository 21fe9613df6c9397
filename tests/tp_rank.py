"""One rank of the tensor-parallel tests (run by mlx.launch, see test_tensor_parallel.py).

``python tp_rank.py MODEL OUT TOKENS RESIDENT``: ``MODEL`` with ``{rank}`` replaced by the
rank (each rank reads its own copy, as on two machines). The rank evicts its copy, loads it
with ``pyloader.load_model(group=Distribution(group, shard="tensor"))`` through pread
(keeping what it read in the page cache: the page-cache evidence) and through mmap, then
with mlx-lm's ``sharded_load(tensor_group=)``, generates ``TOKENS`` greedy tokens with each
(and keeps the prompt's last logits and MLX's peak memory during the load) and writes
``OUT/rank{rank}.json``. ``RESIDENT`` is pyloader's ``resident=`` (below 1: the
rest of the rank's layers stream, slices included).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
from mlx_lm.generate import generate_step, generation_stream

import pyloader
from pyloader.distributed import rank_stats
from pyloader.io.pagecache import evict

PROMPT = [(7 * i + 1) % 256 for i in range(16)]


def greedy(model, n: int) -> list[int]:
    tokens = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]
    # generate_step leaves the next step (and its all_sums) running on its stream: let
    # it finish, so the ranks' next collectives pair up in the same order.
    mx.synchronize(generation_stream)
    return tokens


def last_logits(model) -> list[float]:
    """The prompt's last-position logits (float32)."""
    return model(mx.array([PROMPT]))[0, -1].astype(mx.float32).tolist()


def main() -> None:
    template, out, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    resident = float(sys.argv[4])
    group = mx.distributed.init(strict=True)
    rank = group.rank()
    path = Path(template.replace("{rank}", str(rank)))
    ckpt = pyloader.open(path)
    os.sync()
    evict(ckpt.files)
    result: dict = {"rank": rank}
    for strategy in ("pread", "mmap"):
        mx.reset_peak_memory()
        model, _ = pyloader.load_model(
            path, group=pyloader.Distribution(group, shard="tensor"), resident=resident,
            tokenizer=False,
            options=pyloader.StreamOptions(strategy=strategy, keep_page_cache=True))
        load_peak = mx.get_peak_memory()
        logits = last_logits(model)
        tokens = greedy(model, n)
        st = rank_stats(model)
        st.pop("units", None)
        result[strategy] = {"tokens": tokens, "logits": logits, "stats": st,
                            "load_peak": load_peak}
        if strategy == "pread":
            reader = pyloader.MmapReader(ckpt)
            result["page_cache"] = {t.name: reader.resident_bytes(t.name)
                                    for t in ckpt.tensors()}
            reader.close()
        del model
    # The test checkpoints have no tokenizer; sharded_load always loads one.
    mlx_lm.utils.load_tokenizer = lambda *args, **kwargs: None
    mx.reset_peak_memory()
    model, _ = mlx_lm.utils.sharded_load(str(path), tensor_group=group)
    load_peak = mx.get_peak_memory()
    logits = last_logits(model)
    result["sharded_load"] = {"tokens": greedy(model, n), "logits": logits,
                              "load_peak": load_peak}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))


if __name__ == "__main__":
    main()
