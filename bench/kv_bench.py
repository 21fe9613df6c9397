"""KV cache benchmark: pyloader's preallocated arena vs mlx-lm's growing KVCache.

Each context runs in a fresh process (``python bench/kv_bench.py run ...``) that
builds the model once, warms every cache kind up, then runs rounds in which all
cache kinds go through the same generation interleaved step by step (see
``lockstep``): a shared 2-core machine's speed varies by ±30% from one second to
the next, and only paired measurements resolve a 2% difference. The ratios are
medians of per-round paired ratios. Each memory trace runs in a fresh process of
its own, through mlx-lm's ``generate_step``.

Model (chosen so a 32k-token prefill finishes in about a minute and a half on a
2-core CPU, where MLX's CPU matmul reaches only a few GFLOP/s): llama, 2 layers,
hidden 128, 2 query heads, 1 KV head of dim 64, MLP 256, vocabulary 512,
bfloat16, random weights (seed 0). Its attention is cheap, so the cache's own
per-token cost weighs more in the ratios than it would in a real model.

Per context N (2k, 8k, 32k by default): a random prompt of N - D tokens and D
decode tokens (D = 256), with mlx-lm's prefill loop and step (2048) and
``max_context = N`` for pyloader; greedy tokens are checked to be identical.

* first-token latency (TTFT): making the cache (pyloader's arena is allocated
  and committed inside the timed region) + prefill + the first token's step;
* prompt tok/s: prompt tokens / TTFT (what mlx-lm reports);
* decode tok/s: 1 / median per-token latency over the D decode tokens (the
  median leaves out mlx-lm's one reallocation in them; the mean is kept too);
* memory: the arena's bytes (MLX active memory across make_kv_cache, and
  RssAnon, which can grow by less when the allocator recycles memory) vs the plan.

The memory trace (``trace``) is a separate, decode-dominated run where the cache
outweighs activations: llama, 8 layers, hidden 256, 4 KV heads of dim 64, MLP
256, a 256-token prompt and 2816 decode tokens (KV: 8 KiB/token, 24 MiB at 3072).

int8 runs (``pyloader-int8``) only at the contexts in ``--int8-contexts`` (2k and
8k by default): MLX's CPU quantized matmul makes a 32k int8 prefill take ~10 min.
mlx-lm's ``QuantizedKVCache`` (``mlx-int8``) runs at the smallest context, for
reference: the same quantized attention, so the same speed and tokens.

Commands:
    python bench/kv_bench.py sweep [--contexts 2048,8192,32768] [--rounds 2] [--out DIR]
    python bench/kv_bench.py run --context 8192 --rounds 4 --caches mlx,pyloader
    python bench/kv_bench.py trace --cache mlx
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from pyloader.compare.harness import environment
from benchlib.paths import RAW

CACHES = ("mlx", "pyloader", "pyloader-int8", "mlx-int8")
BENCH_MODEL = dict(model_type="llama", hidden_size=128, num_hidden_layers=2,
                   intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                   rms_norm_eps=1e-5, vocab_size=512, rope_theta=10000.0,
                   tie_word_embeddings=False)
TRACE_MODEL = dict(BENCH_MODEL, hidden_size=256, num_hidden_layers=8, intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=4)
TRACE_TOKENS = 3072
DECODE = 256
KV_GROUP = 64
TARGETS = {"decode": 0.98, "prompt": 0.95, "ttft_overhead": 0.05}
MiB = 2**20


def status_bytes(key: str) -> int:
    """``VmHWM`` or ``RssAnon`` of this process in bytes (pyloader.compare.system: /proc on
    Linux, the kernel's task info on macOS); an error where the platform has no such
    figure, never a made-up 0."""
    from pyloader.compare.system import process_memory

    value = process_memory().as_status()[key]
    if value is None:
        raise SystemExit(f"kv_bench: this platform does not report {key}, which the "
                         "committed-memory figures need")
    return value


def build(config: dict, max_pos: int):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = dict(config, max_position_embeddings=max_pos)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def make_cache(kind: str, model, max_context: int):
    from mlx_lm.models import cache as mlx_cache

    from pyloader import kv as pkv

    if kind == "mlx":
        return mlx_cache.make_prompt_cache(model)
    if kind == "mlx-int8":
        return [mlx_cache.QuantizedKVCache(group_size=KV_GROUP, bits=8) for _ in model.layers]
    bits = 8 if kind == "pyloader-int8" else None
    return pkv.make_kv_cache(model, max_context=max_context, kv_bits=bits,
                                  kv_group_size=KV_GROUP)


class Sampler:
    """RssAnon every `period` seconds on a thread (catches transient peaks)."""

    def __init__(self, period: float = 0.02):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - t0, status_bytes("RssAnon")))
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def measure(kind: str, model, vocab: int, context: int, decode: int,
            prompt_len: int | None = None, prefill_step: int = 2048) -> dict:
    """One generation in this process: times and a memory trace at every step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from pyloader import kv as pkv

    n_prompt = prompt_len if prompt_len is not None else context - decode
    prompt = mx.random.randint(0, vocab, (n_prompt,), key=mx.random.key(1))
    mx.eval(prompt)
    plan = None
    if kind.startswith("pyloader"):
        plan = pkv.plan_kv_cache(model, context, kv_bits=8 if "int8" in kind else None,
                                      kv_group_size=KV_GROUP).nbytes
    mx.clear_cache()
    base_anon = status_bytes("RssAnon")
    trace = []  # (seconds, tokens in cache, RssAnon - base, mx active)
    t0 = time.perf_counter()

    def note(tokens):
        trace.append((time.perf_counter() - t0, tokens, status_bytes("RssAnon") - base_anon,
                      mx.get_active_memory()))

    with Sampler() as sampler:
        cache = make_cache(kind, model, context)
        t_cache = time.perf_counter() - t0
        arena = status_bytes("RssAnon") - base_anon
        note(0)
        stamps = []
        for i, _ in enumerate(generate_step(
                prompt, model, max_tokens=decode, prompt_cache=cache,
                prefill_step_size=prefill_step,
                prompt_progress_callback=lambda done, total: note(done))):
            stamps.append(time.perf_counter() - t0)
            note(n_prompt + i + 1)
    ttft = stamps[0]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    kv_bytes = sum(c.nbytes for c in cache)
    return {
        "cache": kind, "context": context, "prompt_tokens": n_prompt, "decode_tokens": decode,
        "t_make_cache": t_cache, "ttft": ttft, "prompt_tps": n_prompt / ttft,
        "decode_tps": 1 / statistics.median(gaps), "decode_tps_mean": len(gaps) / sum(gaps),
        "plan_bytes": plan, "arena_committed": arena if plan else None,
        "kv_bytes_end": kv_bytes, "vm_hwm": status_bytes("VmHWM"), "base_anon": base_anon,
        "peak_anon_delta": max(r for _, r in sampler.samples) - base_anon,
        "trace": trace,
    }


def lockstep(model, vocab: int, context: int, kinds: list[str], decode: int,
             step: int = 2048) -> dict:
    """Every cache kind through the same generation, interleaved step by step, so
    that background load falls on all of them alike (a shared 2-core machine
    varies by ±30% from one second to the next): each prefill chunk (mlx-lm's
    generate_step loop: model(chunk), eval of the cache state, clear_cache) and
    then each decode token runs for every kind in turn, the order flipping at
    every step. Decoding is synchronous (generate_step overlaps the next step's
    graph building with compute; that would mix the kinds' work on one stream).
    TTFT = making the cache + prefill + the first token's step."""
    import mlx.core as mx

    n_prompt = context - decode
    prompt = mx.random.randint(0, vocab, (n_prompt,), key=mx.random.key(1))
    mx.eval(prompt)

    def order(i):
        return kinds if i % 2 == 0 else kinds[::-1]

    res = {k: {"chunks": [], "decode": []} for k in kinds}
    caches = {}
    for k in order(0):
        mx.clear_cache()
        before, active = status_bytes("RssAnon"), mx.get_active_memory()
        t0 = time.perf_counter()
        caches[k] = make_cache(k, model, context)
        res[k]["make"] = time.perf_counter() - t0
        res[k]["committed"] = status_bytes("RssAnon") - before
        res[k]["allocated"] = mx.get_active_memory() - active
    for i, s in enumerate(range(0, n_prompt - 1, step)):
        chunk = prompt[s:min(s + step, n_prompt - 1)][None]
        for k in order(i):
            t0 = time.perf_counter()
            model(chunk, cache=caches[k])
            mx.eval([c.state for c in caches[k]])
            res[k]["chunks"].append(time.perf_counter() - t0)
            mx.clear_cache()
    ys, tokens = {}, {k: [] for k in kinds}
    for j in range(decode):
        for k in order(j):
            x = prompt[-1:][None] if j == 0 else ys[k][None]
            t0 = time.perf_counter()
            ys[k] = mx.argmax(model(x, cache=caches[k])[:, -1, :], axis=-1)
            mx.eval(ys[k])
            dt = time.perf_counter() - t0
            if j == 0:
                res[k]["first"] = dt
            else:
                res[k]["decode"].append(dt)
            tokens[k].append(ys[k].item())
    out = {}
    for k in kinds:
        r = res[k]
        ttft = r["make"] + sum(r["chunks"]) + r["first"]
        out[k] = {"ttft": ttft, "prompt_tps": n_prompt / ttft, "t_make_cache": r["make"],
                  "prefill_s": sum(r["chunks"]), "decode_tps": 1 / statistics.median(r["decode"]),
                  "decode_tps_mean": len(r["decode"]) / sum(r["decode"]),
                  "committed": r["committed"], "allocated": r["allocated"],
                  "kv_bytes_end": sum(c.nbytes for c in caches[k]),
                  "tokens": tokens[k]}
    return out


def run_context(context: int, rounds: int, caches: list[str], log=None) -> list[dict]:
    """Rounds of `lockstep` at one context in this process (one model, one warm-up).
    The int8 kinds run in a lockstep of their own, in the first round only: they
    are slow on CPU, informational, and would disturb the bf16 pair."""
    from pyloader import kv as pkv

    model = build(BENCH_MODEL, context + 1024)
    vocab = BENCH_MODEL["vocab_size"]
    lockstep(model, vocab, 512, caches, 8, step=256)  # warm every kind up
    plans = {k: pkv.plan_kv_cache(model, context, kv_bits=8 if "int8" in k else None,
                                       kv_group_size=KV_GROUP).nbytes
             for k in caches if k.startswith("pyloader")}
    out = []
    fp = [k for k in caches if "int8" not in k]
    q = [k for k in caches if "int8" in k]
    groups = [(r, fp if r % 2 == 0 else fp[::-1]) for r in range(rounds)] + ([(0, q)] if q else [])
    for r, kinds in groups:
        res = lockstep(model, vocab, context, kinds, DECODE)
        # Greedy tokens must match mlx-lm's cache of the same kind (bf16 or int8).
        ref = res.get("mlx-int8" if "mlx-int8" in res else "mlx", {}).get("tokens")
        for kind, m in res.items():
            m.update(cache=kind, context=context, round=r, prompt_tokens=context - DECODE,
                     decode_tokens=DECODE, plan_bytes=plans.get(kind),
                     arena_committed=m["committed"] if kind in plans else None,
                     arena_allocated=m["allocated"] if kind in plans else None,
                     same_tokens_as_mlx=(m["tokens"] == ref) if ref else None)
            del m["tokens"]
            out.append(m)
            if log:
                log(f"round {r} N={context:>6} {kind:<14} ttft {m['ttft']:7.2f}s  prompt "
                    f"{m['prompt_tps']:8.1f} tok/s  decode {m['decode_tps']:7.1f} tok/s")
    return out


# ----------------------------------------------------------------------------
# Orchestration


def child(args: list[str]) -> list | dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--json"],
                         capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"kv_bench {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    sys.stderr.write(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(contexts: list[int], rounds: int, caches: list[str], int8_contexts=()) -> dict:
    """One fresh process per context (see run_context)."""
    env = environment()
    runs = []
    for n in contexts:
        # int8 runs are slow on CPU: pyloader's at int8_contexts, mlx-lm's (for
        # reference: the same quantized attention) at the smallest context only.
        kinds = [k for k in caches if "int8" not in k
                 or (k == "pyloader-int8" and n in int8_contexts)
                 or (k == "mlx-int8" and n == min(contexts))]
        # Short runs are noisier and cheap: more rounds (x8 at 2k, x2 at 8k).
        scaled = rounds * min(8, max(1, 16384 // n))
        runs += child(["run", "--context", str(n), "--rounds", str(scaled),
                       "--caches", ",".join(kinds)])
    return {"env": env, "runs": runs, "rounds": rounds, "contexts": contexts}


def summarize(data: dict) -> list[dict]:
    """Per context: medians over rounds, and the medians of the per-round paired
    ratios pyloader / mlx-lm (both ran in the same round, interleaved)."""
    rows = []
    for n in data["contexts"]:
        runs = [r for r in data["runs"] if r["context"] == n]
        row = {"context": n}
        for kind in CACHES:
            rs = [r for r in runs if r["cache"] == kind]
            if rs:
                row[kind] = {k: statistics.median(r[k] for r in rs)
                             for k in ("ttft", "prompt_tps", "decode_tps", "kv_bytes_end")}
                row[kind]["plan_bytes"] = rs[0]["plan_bytes"]
                for key in ("arena_committed", "arena_allocated"):
                    row[kind][key] = (statistics.median(r[key] for r in rs)
                                      if rs[0]["plan_bytes"] else None)
                row[kind]["same_tokens_as_mlx"] = all(r["same_tokens_as_mlx"] in (None, True)
                                                      for r in rs)

        def paired(a, b, key, f):
            by_round = {}
            for r in runs:
                by_round.setdefault(r["round"], {})[r["cache"]] = r[key]
            vals = [f(d[a], d[b]) for d in by_round.values() if a in d and b in d]
            return statistics.median(vals) if vals else None

        if "mlx" in row and "pyloader" in row:
            row["decode_ratio"] = paired("pyloader", "mlx", "decode_tps", lambda p, m: p / m)
            row["prompt_ratio"] = paired("pyloader", "mlx", "prompt_tps", lambda p, m: p / m)
            row["ttft_overhead"] = paired("pyloader", "mlx", "ttft", lambda p, m: p / m - 1)
        if "pyloader" in row and "pyloader-int8" in row:
            q, p = row["pyloader-int8"], row["pyloader"]
            row["int8_saving"] = 1 - q["plan_bytes"] / p["plan_bytes"]
            row["int8_decode_ratio"] = paired("pyloader-int8", "pyloader", "decode_tps",
                                              lambda a, b: a / b)
            row["int8_prompt_ratio"] = paired("pyloader-int8", "pyloader", "prompt_tps",
                                              lambda a, b: a / b)
        if "mlx-int8" in row and "mlx" in row:
            row["mlx_int8_decode_ratio"] = paired("mlx-int8", "mlx", "decode_tps",
                                                  lambda a, b: a / b)
            row["mlx_int8_prompt_ratio"] = paired("mlx-int8", "mlx", "prompt_tps",
                                                  lambda a, b: a / b)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def ok(v, target, higher=True):
        good = v >= target if higher else v <= target
        return f"{v:+.1%} {'✓' if good else '✗'}" if not higher else \
            f"{v:.3f} {'✓' if good else '✗'}"

    lines = [
        "| context | decode tok/s mlx-lm / pyloader | ratio (≥ 0.98) | prompt tok/s mlx-lm / "
        "pyloader | ratio (≥ 0.95) | TTFT s mlx-lm / pyloader | overhead (≤ 5%) | KV MiB "
        "mlx-lm end / plan / allocated | int8: saving, decode, prompt vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p, q = r.get("mlx"), r.get("pyloader"), r.get("pyloader-int8")
        if not (m and p):
            continue
        int8 = (f"{r['int8_saving']:.1%}, {r['int8_decode_ratio']:.2f}×, "
                f"{r['int8_prompt_ratio']:.2f}×") if q else "-"
        if "mlx_int8_decode_ratio" in r:
            int8 += (f" (mlx-lm int8 vs its bf16: {r['mlx_int8_decode_ratio']:.2f}×, "
                     f"{r['mlx_int8_prompt_ratio']:.2f}×)")
        lines.append(
            f"| {r['context']} | {m['decode_tps']:.1f} / {p['decode_tps']:.1f} | "
            f"{ok(r['decode_ratio'], TARGETS['decode'])} | {m['prompt_tps']:.0f} / "
            f"{p['prompt_tps']:.0f} | {ok(r['prompt_ratio'], TARGETS['prompt'])} | "
            f"{m['ttft']:.2f} / {p['ttft']:.2f} | "
            f"{ok(r['ttft_overhead'], TARGETS['ttft_overhead'], higher=False)} | "
            f"{m['kv_bytes_end'] / MiB:.2f} / {p['plan_bytes'] / MiB:.2f} / "
            f"{p['arena_allocated'] / MiB:.2f} | {int8} |")
    return "\n".join(lines)


def plot(traces: dict, path: Path, plan_bytes: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"mlx": ("mlx-lm KVCache (grows by 256 tokens)", "tab:red"),
              "pyloader": ("pyloader make_kv_cache (preallocated)", "tab:blue"),
              "pyloader-int8": ("pyloader kv_bits=8", "tab:green")}
    for kind, res in traces.items():
        label, color = styles[kind]
        xs = [t for _, t, _, _ in res["trace"]]
        ys = [r / MiB for _, _, r, _ in res["trace"]]
        ax.step(xs, ys, where="post", label=label, color=color)
    if plan_bytes:
        ax.axhline(plan_bytes / MiB, color="tab:blue", ls=":", lw=1,
                   label=f"pyloader plan ({plan_bytes / MiB:.0f} MiB)")
    ax.set_xlabel("tokens in the cache (256-token prompt, then decoding)")
    ax.set_ylabel("process anonymous memory above baseline (MiB)")
    ax.set_title("KV cache memory during generation: staircase vs flat")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every cache at one context, in this process")
    r.add_argument("--context", type=int, required=True)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--caches", default="mlx,pyloader,pyloader-int8")
    r.add_argument("--json", action="store_true")
    t = sub.add_parser("trace", help="the decode-dominated memory trace, in this process")
    t.add_argument("--cache", choices=CACHES, required=True)
    t.add_argument("--tokens", type=int, default=TRACE_TOKENS)
    t.add_argument("--json", action="store_true")
    s = sub.add_parser("sweep", help="everything, each run in a fresh process")
    s.add_argument("--contexts", default=os.environ.get("PYLOADER_KV_CONTEXTS",
                                                        "2048,8192,32768"))
    s.add_argument("--rounds", type=int, default=int(os.environ.get("PYLOADER_KV_ROUNDS", "2")))
    s.add_argument("--caches", default="mlx,pyloader,pyloader-int8,mlx-int8")
    s.add_argument("--int8-contexts", default="2048,8192")
    s.add_argument("--out", default=str(RAW))
    args = ap.parse_args(argv)

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.cmd == "run":
        res = run_context(args.context, args.rounds, args.caches.split(","), log)
        print(json.dumps(res) if args.json else res)
        return 0
    if args.cmd == "trace":
        model = build(TRACE_MODEL, args.tokens + 1024)
        measure(args.cache, model, TRACE_MODEL["vocab_size"], 256, 8)  # warm-up
        res = measure(args.cache, model, TRACE_MODEL["vocab_size"], args.tokens,
                      args.tokens - 256, prompt_len=256)
        print(json.dumps(res) if args.json else {k: v for k, v in res.items() if k != "trace"})
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = sweep([int(c) for c in args.contexts.split(",")], args.rounds,
                 args.caches.split(","), [int(c) for c in args.int8_contexts.split(",") if c])
    data["traces"] = {k: child(["trace", "--cache", k]) for k in ("mlx", "pyloader")}
    data["summary"] = summarize(data)
    (out / "kv.json").write_text(json.dumps(data))
    plot(data["traces"], out / "kv_memory.png", data["traces"]["pyloader"]["plan_bytes"])
    text = table(data["summary"])
    (out / "kv.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out / 'kv.json'}, {out / 'kv.md'}, {out / 'kv_memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
