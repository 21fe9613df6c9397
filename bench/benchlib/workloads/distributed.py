"""The ``distributed`` workload: one greedy generation per process, distributed or not
(the distributed test's and benchmark's child).

Run under ``mlx.launch --backend ring -n 2 -- python -m pyloader.compare.child
bench/benchlib/workloads/distributed.py --no-wait --result-file DIR/rank{rank}.json MODEL
--distributed``, each rank loads ``MODEL`` (``{rank}`` in the path is replaced by the
rank, so each rank can read its own copy, as on two machines) with
``pyloader.load_model(group=Distribution(group, shard=...))``, or with ``--loader mlx-lm``
with mlx-lm's ``sharded_load`` (``pipeline_group`` or ``tensor_group``);
without ``--distributed`` it is the single-process run (mlx-lm:
``mlx_lm.utils.load_model``). Each result holds the greedy tokens, load and decode timings,
streaming stats with the reader's byte counters (pyloader), the process's read
counters during the load (``read_bytes``, ``rchar``), MLX's peak memory at the end of
the load, memory at the end (``mx.get_peak_memory()``, peak RSS, anonymous RSS) and, for
every tensor of the checkpoint, how many of its pages are in the page cache after the
run (``mincore`` through a fresh mapping) — with one copy per rank, the page cache shows
what each rank ever read.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import mlx.core as mx

from pyloader.distributed import Distribution, rank_stats
from pyloader.io.checkpoint import Checkpoint
from pyloader.io.pagecache import evict
from pyloader.io.readers import MmapReader
from pyloader.loading import has_tokenizer, load_model
from pyloader.streaming import Residency, StreamOptions, stats
from pyloader.compare.protocol import process_memory, read_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory; '{rank}' is replaced by the rank")
    p.add_argument("--distributed", action="store_true",
                   help="mx.distributed.init(strict=True) and load with group=")
    p.add_argument("--loader", choices=("pyloader", "mlx-lm"), default="pyloader")
    p.add_argument("--shard", choices=("pipeline", "tensor"), default="pipeline")
    p.add_argument("--strategy", choices=("mmap", "pread"), default="mmap")
    p.add_argument("--resident", default="1.0",
                   help="count, fraction, byte budget or 'auto' (pyloader)")
    p.add_argument("--split", default=None, help="layers per rank, e.g. 3,5")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16, help="tokens generated")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="keep read pages in the page cache (the read-set evidence)")
    p.add_argument("--evict", action="store_true", help="cold page cache before loading")


def prepare(args) -> tuple[dict, dict]:
    group = mx.distributed.init(strict=True) if args.distributed else None
    rank = group.rank() if group is not None else 0
    path = Path(args.model.replace("{rank}", str(rank)))
    if args.evict:
        os.sync()  # dirty pages (a fresh copy) are not dropped by an evict
        evict(Checkpoint(path).files)
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))  # MLX start-up, untimed
    mx.reset_peak_memory()
    return {"rank": rank, "model": str(path)}, {"group": group, "rank": rank, "path": path}


def _mlx_lm_load(path: Path, group, shard: str):
    """mlx-lm's own load: ``sharded_load`` with the group as its ``pipeline_group`` or
    ``tensor_group``, or ``load_model`` for one process."""
    import mlx_lm.utils

    if group is None:
        return mlx_lm.utils.load_model(path)[0]
    if not has_tokenizer(path):  # sharded_load always loads one
        mlx_lm.utils.load_tokenizer = lambda *args, **kwargs: None
    groups = {f"{shard}_group": group}
    return mlx_lm.utils.sharded_load(str(path), **groups)[0]


def run(args, state: dict) -> dict:
    from mlx_lm.generate import generate_step, generation_stream

    group, rank, path = state["group"], state["rank"], state["path"]
    split = [int(s) for s in args.split.split(",")] if args.split else None
    io0 = read_bytes()
    t0 = time.perf_counter()
    if args.loader == "mlx-lm":
        model = _mlx_lm_load(path, group, args.shard)
    else:
        model, _ = load_model(
            path, resident=Residency.from_text(args.resident), tokenizer=False,
            group=None if group is None else Distribution(group, shard=args.shard, split=split),
            options=StreamOptions(
                strategy=args.strategy, prefetch=args.prefetch,
                keep_page_cache=args.keep_page_cache))
    state["model"] = model
    load_s = time.perf_counter() - t0
    io1 = read_bytes()
    load_io = io1.since(io0)  # None where this platform does not count it
    load_peak = mx.get_peak_memory()
    vocab = 256
    prompt = [(7 * i + 1) % vocab for i in range(args.prompt_tokens)]
    tokens, times = [], []
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=args.tokens):
        tokens.append(int(tok))
        times.append(time.perf_counter())
    # generate_step leaves its next step (and that step's collectives) running: let it
    # finish, so the barrier below pairs with the other ranks' barrier.
    mx.synchronize(generation_stream)
    decode = times[-1] - times[0]
    if args.loader == "mlx-lm":
        st = {"rank": rank, "size": group.size() if group is not None else 1}
    elif group is not None:
        st = rank_stats(model)
    else:
        st = stats(model)
        st["rank"], st["size"] = 0, 1
    st.pop("units", None)
    mem = process_memory(mx)
    reader = MmapReader(path)
    cached = {t.name: reader.resident_bytes(t.name) for t in reader.checkpoint.tensors()}
    result = {
        "rank": rank, "size": group.size() if group is not None else 1, "model": str(path),
        "loader": args.loader, "shard": args.shard,
        "tokens": tokens, "load_s": load_s, "load_io": load_io, "load_mx_peak": load_peak,
        "ttft_s": times[0] - t0,
        "decode_tps": (len(tokens) - 1) / decode if decode > 0 else None,
        "memory": mem, "stats": st, "page_cache": cached,
    }
    if group is not None:  # every rank done before any exits
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
    return result
