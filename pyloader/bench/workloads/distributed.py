"""The ``distributed`` workload: one greedy generation per process, distributed or not
(the distributed test's and benchmark's child).

Run under ``mlx.launch --backend ring -n 2 -- python -m pyloader.bench.child distributed
--no-wait --result-file DIR/rank{rank}.json MODEL --distributed``, each rank loads
``MODEL`` (``{rank}`` in the path is replaced by the rank, so each rank can read its own
copy, as on two machines) with ``pyloader.load_model(group=...)``; without
``--distributed`` it is the single-process run. Each result holds the greedy tokens, load and decode timings, streaming stats with the reader's byte
counters, memory (``mx.get_peak_memory()``, peak RSS, anonymous RSS) and, for
every tensor of the checkpoint, how many of its pages are in the page cache
after the run (``mincore`` through a fresh mapping) — with one copy per rank,
the page cache shows what each rank ever read.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import mlx.core as mx

from ..._util.sizes import parse_amount
from ...distributed import rank_stats
from ...io.checkpoint import Checkpoint
from ...io.pagecache import evict
from ...io.readers import MmapReader
from ...loading import load_model
from ...streaming import stats
from ..protocol import process_memory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory; '{rank}' is replaced by the rank")
    p.add_argument("--distributed", action="store_true",
                   help="mx.distributed.init(strict=True) and load with group=")
    p.add_argument("--strategy", choices=("mmap", "pread"), default="mmap")
    p.add_argument("--resident", default="1.0", help="count, fraction or byte budget")
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


def run(args, state: dict) -> dict:
    from mlx_lm.generate import generate_step

    group, rank, path = state["group"], state["rank"], state["path"]
    split = [int(s) for s in args.split.split(",")] if args.split else None
    t0 = time.perf_counter()
    model, _ = load_model(path, strategy=args.strategy, resident=parse_amount(args.resident),
                          prefetch=args.prefetch, keep_page_cache=args.keep_page_cache,
                          tokenizer=False, group=group, split=split)
    state["model"] = model
    load_s = time.perf_counter() - t0
    vocab = 256
    prompt = [(7 * i + 1) % vocab for i in range(args.prompt_tokens)]
    tokens, times = [], []
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=args.tokens):
        tokens.append(int(tok))
        times.append(time.perf_counter())
    decode = times[-1] - times[0]
    if group is not None:
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
        "tokens": tokens, "load_s": load_s, "ttft_s": times[0] - t0,
        "decode_tps": (len(tokens) - 1) / decode if decode > 0 else None,
        "memory": mem, "stats": st, "page_cache": cached,
    }
    if group is not None:  # every rank done before any exits
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
    return result
