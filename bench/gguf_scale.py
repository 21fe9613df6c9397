"""The CPU seed's headline for GGUF files: an 8B-class Q4_K_M file, read in place, decoding
inside a memory limit barely above its size.

Writes (once, cached under ``~/.cache/pyloader/scale``) a GGUF file of a real model's shape
(:mod:`benchlib.synthetic.shapes`, ``llama3.1-8b``) in llama.cpp's Q4_K_M layout: Q4_K
matrices, Q6_K for the output and for ``attn_v`` and ``ffn_down`` of the blocks llama.cpp
gives more bits, F32 norms; random blocks with small scales (speed does not depend on the
values). Then, each in a fresh process with the file evicted from the page cache, runs
``load_model(file, kernels="auto")`` resident (mapped in place) without a limit and inside a
memory cgroup of ``--limit``: load time, prompt and decode tok/s, peak memory, and the
greedy tokens of both runs, which must be equal. Not part of CI (a run takes minutes).

    python bench/gguf_scale.py --limit 6GB --tokens 8

Results: ``bench/results/raw/gguf-scale-<shape>-q4_k_m-<isa>.json`` (medians of ``--runs``,
each limited run in a new cgroup; ``--isa avx2`` forces the kernels' level).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from benchlib.cgroup import MemoryCgroup, unavailable_reason
from benchlib.paths import RAW

from pyloader.compare.harness import environment
from pyloader.compare.system import cache_dir, loadavg, parse_bytes
from pyloader.io.pagecache import evict_file
from benchlib.synthetic.shapes import SHAPES

#: Bytes of a block of 256 values and where its half-precision scales lie.
_K_QUANTS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}

CHILD = textwrap.dedent("""
    import json, sys, time
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    import pyloader
    from pyloader import cpu_kernels
    from pyloader.compare.system import process_memory
    path, n, prompt_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    t0 = time.perf_counter()
    model, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
    t_load = time.perf_counter()
    steps = generate_step(mx.array([1 + i for i in range(prompt_tokens)]), model,
                          max_tokens=n)
    tokens = [int(next(steps)[0])]
    t_first = time.perf_counter()
    tokens += [int(t) for t, _ in steps]
    t_end = time.perf_counter()
    m = process_memory()
    print(json.dumps({"tokens": tokens, "load_s": t_load - t0,
                      "prompt_tps": prompt_tokens / (t_first - t_load),
                      "decode_tps": (len(tokens) - 1) / (t_end - t_first),
                      "peak_rss": m.peak_rss, "rss_anon": m.rss_anon,
                      "kernel_isa": cpu_kernels.kernel_isa()}))
""")


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for ``attn_v`` and ``ffn_down``: Q6_K in the first and last
    eighth of the blocks and every third block between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _blocks(rng: np.random.Generator, type_name: str, rows: int, k: int) -> np.ndarray:
    nbytes, halves = _K_QUANTS[type_name]
    raw = rng.integers(0, 256, size=(rows, k // 256, nbytes), dtype=np.uint8)
    small = rng.uniform(1e-5, 1e-4, size=(rows, k // 256)).astype(np.float16).view(np.uint8)
    for at in halves:
        raw[..., at:at + 2] = small.reshape(rows, k // 256, 2)
    return raw.reshape(rows, -1)


def tensors(shape: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, type, logical shape)`` of every tensor, in file order."""
    c = SHAPES[shape][0]
    h, ffn, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = [("token_embd.weight", "Q4_K", (c["vocab_size"], h)),
           ("output_norm.weight", "F32", (h,)), ("output.weight", "Q6_K", (c["vocab_size"], h))]
    for i in range(n):
        more = "Q6_K" if _more_bits(i, n) else "Q4_K"
        out += [(f"blk.{i}.attn_norm.weight", "F32", (h,)),
                (f"blk.{i}.ffn_norm.weight", "F32", (h,)),
                (f"blk.{i}.attn_q.weight", "Q4_K", (q, h)),
                (f"blk.{i}.attn_k.weight", "Q4_K", (kv, h)),
                (f"blk.{i}.attn_v.weight", more, (kv, h)),
                (f"blk.{i}.attn_output.weight", "Q4_K", (h, q)),
                (f"blk.{i}.ffn_gate.weight", "Q4_K", (ffn, h)),
                (f"blk.{i}.ffn_up.weight", "Q4_K", (ffn, h)),
                (f"blk.{i}.ffn_down.weight", more, (h, ffn))]
    return out


def write_file(shape: str, path: Path) -> None:
    """The GGUF file, tensor by tensor (never all in memory)."""
    import gguf

    c = SHAPES[shape][0]
    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    for key, value in (("block_count", c["num_hidden_layers"]),
                       ("embedding_length", c["hidden_size"]),
                       ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", c["num_attention_heads"]),
                       ("attention.head_count_kv", c["num_key_value_heads"]),
                       ("attention.key_length", c["head_dim"]), ("context_length", 8192)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", float(c["rope_theta"]))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", float(c["rms_norm_eps"]))
    specs = tensors(shape)
    for name, type_name, dims in specs:
        qt = gguf.GGMLQuantizationType[type_name]
        if type_name == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            rows, k = dims
            byte_shape = (rows, k // 256 * _K_QUANTS[type_name][0])
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _name, type_name, dims in specs:
        if type_name == "F32":
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            w.write_tensor_data(_blocks(rng, type_name, *dims))
    w.close()
    os.replace(str(path) + ".part", path)


def run_child(path: Path, args, cgroup: MemoryCgroup | None) -> dict:
    evict_file(str(path))
    cmd = [sys.executable, "-c", CHILD, str(path), str(args.tokens), str(args.prompt_tokens)]
    env = {**os.environ, "PYLOADER_KERNELS": "auto"}
    if args.isa != "auto":
        env["PYLOADER_KERNEL_ISA"] = args.isa
    if cgroup is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    else:
        proc = cgroup.run(cmd, timeout=3600, env=env)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    out = json.loads(proc.stdout)
    if cgroup is not None:
        out.update(cgroup_peak=cgroup.read("memory.max_usage_in_bytes"),
                   failcnt=cgroup.read("memory.failcnt"))
    return out


def table(raw: dict) -> str:
    """The result as a Markdown table of medians (one row per run kind)."""
    lines = ["| file | kernels level | limit | load s | prompt tok/s | decode tok/s | peak RSS GB "
             "| peak cgroup GB | tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in (raw.get("medians") or {}).items():
        limit = f"{raw['limit'] / 1e9:.2f} GB" if name == "limited" else "none"
        cg = f"{m['cgroup_peak'] / 1e9:.2f}" if "cgroup_peak" in m else "-"
        lines.append(
            f"| {raw['shape']} {raw['format']}, {raw['file_bytes'] / 1e9:.2f} GB | {raw['isa']} "
            f"| {limit} | {m['load_s']:.1f} | {m['prompt_tps']:.1f} | {m['decode_tps']:.2f} "
            f"| {m['peak_rss'] / 1e9:.2f} | {cg} | "
            f"{'identical' if raw['same_tokens'] else 'DIFFER'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["llama3.1-8b"], default="llama3.1-8b")
    ap.add_argument("--limit", type=parse_bytes, default=parse_bytes("6GB"))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3, help="runs of each, alternated; medians")
    ap.add_argument("--isa", default="auto", help="the kernels' SIMD level (PYLOADER_KERNEL_ISA)")
    args = ap.parse_args(argv)
    path = cache_dir("scale") / f"{args.shape}-q4_k_m.gguf"
    if not path.exists():
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        write_file(args.shape, path)
    load = loadavg()
    why = unavailable_reason()
    runs: dict[str, list[dict]] = {"free": [], "limited": []}
    for _ in range(args.runs):
        runs["free"].append(run_child(path, args, None))
        if why:
            runs["limited"].append({"skipped": why})
            continue
        with MemoryCgroup(args.limit) as cg:
            runs["limited"].append(run_child(path, args, cg))
    rows = [r for rs in runs.values() for r in rs]
    ok = all("error" not in r and "skipped" not in r for r in rows)
    same = ok and len({tuple(r["tokens"]) for r in rows}) == 1
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in (
        "load_s", "prompt_tps", "decode_tps", "peak_rss", *(
            ("cgroup_peak",) if name == "limited" else ()))} for name, rs in runs.items()
               } if ok else None
    env = environment()
    env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                       .splitlines() if ln.startswith("model name")), None)
    result = {"env": env, "shape": args.shape, "format": "q4_k_m",
              "file_bytes": path.stat().st_size,
              "limit": args.limit, "isa": args.isa, "loadavg_before": load,
              "loadavg_after": loadavg(), "medians": summary, "same_tokens": same,
              "runs": runs, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    RAW.mkdir(parents=True, exist_ok=True)
    out = RAW / f"gguf-scale-{args.shape}-q4_k_m-{args.isa}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
