"""The ``stream`` workload: decode speed of a streamed model (the streaming benchmark).

Set-up: the child loads the model, runs the prompt (prefill) and the first token; ready
carries ``load_s``, ``ttft_s`` and ``prefill_tps``. After ``go`` it decodes ``--tokens``
more tokens (timed by the parent: the benchmark's measured phase); the result has
``decode_s``,
``decode_tps`` (tokens of every sequence per second), the generated tokens
(for the identity check against the baseline), pyloader's streaming stats of
the decode phase and this process's memory.

``--mode mlx-lm`` is the baseline: ``mlx_lm.utils.load_model`` (everything
read and evaluated at load). ``--mode stream`` is ``pyloader.load_model``; with
``--planned BUDGET`` it is ``pyloader.residency.load_planned(path, BUDGET)`` (the planner
chooses the resident set; ready carries the plan: resident layers, expected peak,
predicted speed). ``--kernels`` makes every mode compute with MLX's ops or pyloader's
CPU kernels (ready's ``kernels`` says which modules use which).
With ``--batch B > 1`` the B prompts (the prompt and B-1 shifted copies) go
through ``mlx_lm``'s ``BatchGenerator``: one weight pass serves every sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import time
from pathlib import Path

import mlx.core as mx

from pyloader.compare.system import parse_amount, parse_bytes
from pyloader.kernels import KERNELS
from pyloader.kernels import install as install_kernels
from pyloader.loading import load_model
from pyloader.residency import load_planned
from pyloader.streaming import Residency, StreamOptions, controller_of, stats
from pyloader.streaming.depth import prefetch_arg
from pyloader.streaming.trace import trace
from pyloader.compare.protocol import process_memory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--mode", choices=("mlx-lm", "stream"), default="stream")
    p.add_argument("--strategy", choices=("mmap", "pread", "auto"), default="mmap",
                   help="auto: with --planned only (load_planned's choice)")
    p.add_argument("--resident", default="0.0", help="count, fraction or byte budget")
    p.add_argument("--planned", default=None, metavar="BUDGET",
                   help="load_planned(path, BUDGET) instead (bytes, e.g. 6GB, or auto)")
    p.add_argument("--placement", default="first_n")
    p.add_argument("--granularity", default="layer")
    p.add_argument("--prefetch", type=prefetch_arg, default=1)
    p.add_argument("--read-backend", default="threads")
    p.add_argument("--keep-page-cache", action="store_true")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8, help="decode steps after the first token")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--experts", default="layer",
                   help="expert cache: layer, slots, a fraction or a byte budget")
    p.add_argument("--expert-policy", default="lru")
    p.add_argument("--expert-source", default="bank")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="decode by sampling (temperature 1) from this seed instead of greedily")
    p.add_argument("--trace", action="store_true",
                   help="record the experts' routing (prompt included) into the result")
    p.add_argument("--kernels", choices=KERNELS, default=None,
                   help="MLX's ops or pyloader's CPU kernels, in every mode (default: "
                        "load_model's, $PYLOADER_KERNELS or auto; mlx-lm mode: mlx)")
    p.add_argument("--timeline", default=None, metavar="FILE.json",
                   help="write the decode phase's streaming timeline (pyloader.trace) to "
                        "FILE.json; its summary goes into the result")


def vocab_size(model) -> int:
    """The model's vocabulary (``args.vocab_size``, or its ``text_config``'s for
    multimodal configs such as qwen3_5); 256 when it has no args."""
    a = getattr(model, "args", None)
    if a is None:
        return 256
    v = getattr(a, "vocab_size", None)
    return v if v is not None else a.text_config["vocab_size"]


def prepare(args) -> tuple[dict, dict]:
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))  # MLX start-up, untimed
    t0 = time.perf_counter()
    plan = None
    if args.mode == "mlx-lm":
        from mlx_lm.utils import load_model as mlx_lm_load_model

        model, _ = mlx_lm_load_model(Path(args.model))
    elif args.planned is not None:
        budget = args.planned if args.planned == "auto" else parse_bytes(args.planned)
        model, _, p, _ = load_planned(
            args.model, budget, strategy=args.strategy, tokenizer=False,
            **({} if args.kernels is None else {"kernels": args.kernels}),
            options=StreamOptions(
                placement=args.placement, granularity=args.granularity, prefetch=args.prefetch,
                keep_page_cache=args.keep_page_cache, read_backend=args.read_backend))
        plan = {"resident_layers": list(p.resident_layers), "layers": p.model.n_layers,
                "strategy": p.strategy,
                "budget_bytes": p.budget_bytes, "expected_peak": p.expected_peak,
                "prediction": p.prediction,
                "calibration_source": p.calibration.source if p.calibration else None}
    else:
        model, _ = load_model(
            args.model, resident=Residency.from_text(args.resident), tokenizer=False,
            **({} if args.kernels is None else {"kernels": args.kernels}),
            options=StreamOptions(
                strategy=args.strategy, placement=args.placement, granularity=args.granularity,
                prefetch=args.prefetch, keep_page_cache=args.keep_page_cache,
                read_backend=args.read_backend, experts=parse_amount(args.experts),
                expert_policy=args.expert_policy, expert_source=args.expert_source))
    load_s = time.perf_counter() - t0
    # mlx-lm's model takes them here; pyloader's already has them (installing again
    # changes nothing and reports what computes with which).
    kernels = (install_kernels(model, args.kernels).summary() if args.kernels is not None
               else None)
    vocab = vocab_size(model)
    prompts = [[(7 * i + 13 * b + 1) % vocab for i in range(args.prompt_tokens)]
               for b in range(args.batch)]
    state = {"model": model}
    if args.trace:
        state["trace_cm"] = controller_of(model).routing_trace()
        state["trace"] = state["trace_cm"].__enter__()
    sampler = None
    if args.sample_seed is not None:
        mx.random.seed(args.sample_seed)

        def sampler(logits):
            return mx.random.categorical(logits)
    t1 = time.perf_counter()
    if args.batch == 1:
        from mlx_lm.generate import generate_step

        steps = generate_step(mx.array(prompts[0]), model, max_tokens=args.tokens + 1,
                              sampler=sampler)
        state["first"] = [int(next(steps)[0])]
        state["steps"] = steps
        prompt_tokens = args.prompt_tokens
    else:
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(model, stop_tokens=[], max_tokens=args.tokens + 1,
                             completion_batch_size=args.batch, prefill_batch_size=args.batch)
        uids = gen.insert(prompts, [args.tokens + 1] * args.batch)
        results = {u: [] for u in uids}
        while not all(results.values()):  # prefill + first token of every sequence
            for r in gen.next_generated():
                results[r.uid].append(r.token)
        state.update(gen=gen, uids=uids, results=results)
        prompt_tokens = args.batch * args.prompt_tokens
    ttft = time.perf_counter() - t1
    state["before"] = stats(model) if args.mode == "stream" else None
    ready = {"load_s": load_s, "ttft_s": ttft, "prefill_tps": prompt_tokens / ttft}
    if kernels is not None:
        ready["kernels"] = kernels
    if plan is not None:
        ready["plan"] = plan
    return ready, state


def run(args, state: dict) -> dict:
    model = state["model"]
    recording = (trace(model, args.timeline) if args.timeline and args.mode == "stream"
                 else contextlib.nullcontext())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with recording as timeline:
        t2 = time.perf_counter()
        if args.batch == 1:
            tokens = state["first"] + [int(t) for t, _ in state["steps"]]
            decode_s = time.perf_counter() - t2
            n_decoded = len(tokens) - 1
            out_tokens = [tokens]
        else:
            gen, results = state["gen"], state["results"]
            while responses := gen.next_generated():
                for r in responses:
                    results[r.uid].append(r.token)
            decode_s = time.perf_counter() - t2
            gen.close()
            out_tokens = [results[u] for u in state["uids"]]
            n_decoded = sum(len(t) - 1 for t in out_tokens)
    end = resource.getrusage(resource.RUSAGE_SELF)
    result = {"decode_s": decode_s, "decode_tps": n_decoded / decode_s, "tokens": out_tokens,
              "memory": process_memory(mx),
              # Page faults while decoding: major ones read from disk on a thread that
              # touched a page (the compute thread, when a streamed unit's pages were
              # reclaimed before it ran).
              "faults": {"major": end.ru_majflt - usage.ru_majflt,
                         "minor": end.ru_minflt - usage.ru_minflt},
              "cpu_s": {"user": end.ru_utime - usage.ru_utime,
                        "system": end.ru_stime - usage.ru_stime}}
    if timeline is not None:
        summary = timeline.summary()
        summary.pop("per_pass")
        result["timeline"] = summary
    before = state["before"]
    if before is not None:
        after = stats(model)
        phase = {k: after[k] - before[k] for k in ("passes", "bytes_read", "wait_s", "compute_s")}
        phase["streamed_bytes_per_pass"] = after["streamed_bytes_per_pass"]
        phase["streamed_units"] = after["streamed_units"]
        phase["resident_bytes"] = after["resident_bytes"]
        phase["prefetch"] = after["prefetch"]  # the depth in effect ("auto" resolved)
        busy = phase["wait_s"] + phase["compute_s"]
        phase["overlap_efficiency"] = phase["compute_s"] / busy if busy else 1.0
        result["stream"] = phase
        if "experts" in after:
            b, a = before["experts"]["total"], after["experts"]["total"]
            result["experts"] = {
                "decode": {k: a[k] - b[k] for k in (
                    "calls", "rounds", "routed", "hits", "misses", "evictions", "bytes_read",
                    "reads", "stall_s")},
                "total": a, "bank_bytes": a["bank_bytes"],
                "setting": after["experts"]["setting"], "source": after["experts"]["source"],
                "policy": after["experts"]["policy"]}
    if "trace" in state:
        state["trace_cm"].__exit__(None, None, None)
        t = state["trace"]
        result["trace"] = {"layers": t.layers, "num_experts": t.num_experts}
    return result
