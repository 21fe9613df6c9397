"""One measured generation in a fresh process (the streaming benchmark's child).

Protocol as in :mod:`pyloader._measure`: the child loads the model, runs the
prompt (prefill) and the first token, prints ``PYLOADER-READY {json}`` with
``load_s``, ``ttft_s`` and ``prefill_tps``, waits for ``go`` on stdin, decodes
``--tokens`` more tokens (timed by the parent: the benchmark's measured
phase) and prints ``PYLOADER-RESULT {json}`` with ``decode_s``,
``decode_tps`` (tokens of every sequence per second), the generated tokens
(for the identity check against the baseline), pyloader's streaming stats of
the decode phase and this process's memory.

``--mode mlx-lm`` is the baseline: ``mlx_lm.utils.load_model`` (everything
read and evaluated at load). ``--mode stream`` is ``pyloader.load_model``.
With ``--batch B > 1`` the B prompts (the prompt and B-1 shifted copies) go
through ``mlx_lm``'s ``BatchGenerator``: one weight pass serves every sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ._measure import READY, RESULT, parse_resident, process_memory, run_reported


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m pyloader._stream_measure")
    p.add_argument("model")
    p.add_argument("--mode", choices=("mlx-lm", "stream"), default="stream")
    p.add_argument("--strategy", choices=("mmap", "pread"), default="mmap")
    p.add_argument("--resident", default="0.0", help="count, fraction or byte budget")
    p.add_argument("--placement", default="first_n")
    p.add_argument("--granularity", default="layer")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--read-backend", default="threads")
    p.add_argument("--keep-page-cache", action="store_true")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8, help="decode steps after the first token")
    p.add_argument("--batch", type=int, default=1)
    return p.parse_args(argv)


def run(args) -> None:
    import mlx.core as mx

    import pyloader

    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))  # MLX start-up, untimed
    t0 = time.perf_counter()
    if args.mode == "mlx-lm":
        from pathlib import Path

        from mlx_lm.utils import load_model

        model, _ = load_model(Path(args.model))
    else:
        model, _ = pyloader.load_model(
            args.model, strategy=args.strategy, resident=parse_resident(args.resident),
            placement=args.placement, granularity=args.granularity, prefetch=args.prefetch,
            keep_page_cache=args.keep_page_cache, read_backend=args.read_backend,
            tokenizer=False)
    load_s = time.perf_counter() - t0
    vocab = model.args.vocab_size if hasattr(model, "args") else 256
    prompts = [[(7 * i + 13 * b + 1) % vocab for i in range(args.prompt_tokens)]
               for b in range(args.batch)]

    def counters():
        return pyloader.stats(model) if args.mode == "stream" else None

    if args.batch == 1:
        from mlx_lm.generate import generate_step

        steps = generate_step(mx.array(prompts[0]), model, max_tokens=args.tokens + 1)
        t1 = time.perf_counter()
        first = [int(next(steps)[0])]
        ttft = time.perf_counter() - t1
        before = counters()
        print(READY, json.dumps({"load_s": load_s, "ttft_s": ttft,
                                 "prefill_tps": args.prompt_tokens / ttft}), flush=True)
        sys.stdin.readline()
        t2 = time.perf_counter()
        tokens = first + [int(t) for t, _ in steps]
        decode_s = time.perf_counter() - t2
        n_decoded = len(tokens) - 1
        out_tokens = [tokens]
    else:
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(model, stop_tokens=[], max_tokens=args.tokens + 1,
                             completion_batch_size=args.batch, prefill_batch_size=args.batch)
        uids = gen.insert(prompts, [args.tokens + 1] * args.batch)
        results = {u: [] for u in uids}
        t1 = time.perf_counter()
        while not all(results.values()):  # prefill + first token of every sequence
            for r in gen.next_generated():
                results[r.uid].append(r.token)
        ttft = time.perf_counter() - t1
        before = counters()
        print(READY, json.dumps({"load_s": load_s, "ttft_s": ttft,
                                 "prefill_tps": args.batch * args.prompt_tokens / ttft}),
              flush=True)
        sys.stdin.readline()
        t2 = time.perf_counter()
        while responses := gen.next_generated():
            for r in responses:
                results[r.uid].append(r.token)
        decode_s = time.perf_counter() - t2
        gen.close()
        out_tokens = [results[u] for u in uids]
        n_decoded = sum(len(t) - 1 for t in out_tokens)
    after = counters()
    result = {"decode_s": decode_s, "decode_tps": n_decoded / decode_s, "tokens": out_tokens,
              "memory": process_memory(mx)}
    if after is not None:
        phase = {k: after[k] - before[k] for k in ("passes", "bytes_read", "wait_s", "compute_s")}
        phase["streamed_bytes_per_pass"] = after["streamed_bytes_per_pass"]
        phase["streamed_units"] = after["streamed_units"]
        phase["resident_bytes"] = after["resident_bytes"]
        busy = phase["wait_s"] + phase["compute_s"]
        phase["overlap_efficiency"] = phase["compute_s"] / busy if busy else 1.0
        result["stream"] = phase
    print(RESULT, json.dumps(result), flush=True)


def main(argv=None) -> int:
    return run_reported(run, _parse(argv))


if __name__ == "__main__":
    sys.exit(main())
