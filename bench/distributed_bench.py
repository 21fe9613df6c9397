"""Distributed loading on loopback: one process vs two ranks
(``mlx.launch --backend ring -n 2``), per-rank memory, bytes read and tok/s.

    python bench/distributed_bench.py [--size 900e6] [--tokens 8] [--rounds 2]
        [--out bench/results/raw/distributed.json]
    python bench/distributed_bench.py --suite tensor [--size 900e6] [--tokens 8]
        [--rounds 2] [--strategy pread]     # -> bench/results/raw/distributed-tensor.json
    python bench/distributed_bench.py --table bench/results/raw/distributed-tensor.json

``--suite tensor`` compares loaders and shardings, every layer resident: pyloader
(``load_model(group=, shard=)``) against mlx-lm (``sharded_load(pipeline_group=)`` /
``sharded_load(tensor_group=)``; one process: ``mlx_lm.utils.load_model``), pipeline vs
tensor, 1 vs 2 ranks. Per rank: bytes read during the load (pyloader's reader
counters; for both loaders the process's ``read_bytes`` from storage and ``rchar``
through read calls, page cache cold), load time, MLX's peak memory at the end of the
load, decode tok/s. A combination mlx-lm does not support (0.32.2: no ``pipeline`` for
llama) is recorded with its error. It writes the JSON and a Markdown table beside it
(``.md``); ``--table`` prints the table of a results file.

The default suite (``--suite residency``), pipeline only:

Model: a random bf16 llama of about ``--size`` bytes (``benchlib.synthetic``;
8 layers of 103 MB + 67 MB non-layer at the default), cached in
``~/.cache/pyloader/bench``. Configurations (mmap, prefetch 1): every layer
resident, a 500 MB weight budget per process (``resident="500MB"``), every
layer streamed (``resident=0``); the page cache is evicted before each run
(cold). Each run is a fresh process (or pair of processes); the median over
``--rounds`` is reported, with every round kept.
Both ranks share this machine's two cores and disk, so the two-rank tok/s is a
lower bound for two machines. ``--launcher direct`` (default) starts the ranks
with the environment ``mlx.launch`` would set (``MLX_RANK``, ``MLX_HOSTFILE``
with one ``ip:port`` per rank) but without its output-relaying process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pyloader import io as pio
from pyloader.compare.harness import environment
from benchlib.paths import RAW
from benchlib.synthetic import make_model
from benchlib.workloads import DISTRIBUTED

# Every layer resident; a 500 MB weight budget per process; every layer streamed.
CONFIGS = {"resident": "1.0", "budget-500MB": "500MB", "streamed": "0"}
# The tensor suite: (loader, shard) on two ranks; one process runs each loader once.
LOADERS = ("pyloader", "mlx-lm")
SHARDS = ("pipeline", "tensor")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model: Path, ranks: int, tokens: int, launcher: str, options: list[str]
         ) -> list[dict]:
    """One run (a process per rank, page cache evicted first) of the ``distributed``
    workload with ``options``; each rank's result."""
    for t in pio.open(model).tensors():
        pio.evict_file(t.file)
    with tempfile.TemporaryDirectory() as out:
        child = [sys.executable, "-m", "pyloader.compare.child", DISTRIBUTED, "--no-wait",
                 "--result-file", str(Path(out) / "rank{rank}.json"), str(model),
                 "--prefetch", "1", "--tokens", str(tokens), *options]
        if ranks > 1 and launcher == "mlx.launch":
            cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring",
                   "-n", str(ranks), "--starting-port", str(_port()), "--", *child,
                   "--distributed"]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=out)]
        elif ranks > 1:
            # What mlx.launch sets up for the ring backend, without its
            # output-relaying process (which takes a share of the 2 cores).
            port = _port()
            hostfile = Path(out) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
            procs = [subprocess.Popen([*child, "--distributed"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=out,
                                      env={**os.environ, "MLX_RANK": str(r),
                                           "MLX_HOSTFILE": str(hostfile)})
                     for r in range(ranks)]
        else:
            procs = [subprocess.Popen(child, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=out)]
        failed = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=1800)
            if p.returncode != 0:
                failed.append(stdout + stderr)
        results = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        errors = [r["error"] for r in results if "error" in r]
        if errors or failed or len(results) != ranks:  # mlx.launch exits 0 on failures
            raise RuntimeError(errors[0] if errors else _last_line(
                "\n".join(failed) or f"{len(results)} of {ranks} results"))
    for r in results:
        r.pop("page_cache", None)
    return results


def _summary(rounds: list[list[dict]]) -> list[dict]:
    """Per rank: medians over rounds of the numbers the table shows."""
    out = []
    for k in range(len(rounds[0])):
        rs = [rnd[k] for rnd in rounds]

        def med(f, rs=rs):
            return statistics.median(f(r) for r in rs)
        st = rs[0]["stats"]
        out.append({
            "rank": rs[0]["rank"], "layers": st.get("layers"),
            "decode_tok_s": med(lambda r: r["decode_tps"]),
            "load_s": med(lambda r: r["load_s"]),
            "mx_peak_MB": med(lambda r: r["memory"]["mx_peak"]) / 1e6,
            "peak_rss_MB": med(lambda r: r["memory"]["VmHWM"]) / 1e6,
            "rss_anon_MB": med(lambda r: r["memory"]["RssAnon"]) / 1e6,
            "reader_bytes_MB": st["reader"]["bytes"] / 1e6,
            "streamed_MB_per_pass": st["streamed_bytes_per_pass"] / 1e6,
            "bytes_read_streamed_MB": st["bytes_read"] / 1e6,
            "tokens": rs[0]["tokens"],
        })
    return out


def _tensor_summary(rounds: list[list[dict]]) -> list[dict]:
    """Per rank: medians over rounds of what the tensor suite compares."""
    out = []
    for k in range(len(rounds[0])):
        rs = [rnd[k] for rnd in rounds]

        def med(f, rs=rs):
            return statistics.median(f(r) for r in rs)
        reader = rs[0]["stats"].get("reader")
        out.append({
            "rank": rs[0]["rank"],
            "reader_bytes_MB": (reader["bytes_read"] + reader.get("populate_bytes", 0)) / 1e6
            if reader else None,
            "storage_read_MB": med(lambda r: r["load_io"].get("read_bytes", 0)) / 1e6,
            "rchar_MB": med(lambda r: r["load_io"].get("rchar", 0)) / 1e6,
            "load_s": med(lambda r: r["load_s"]),
            "load_mx_peak_MB": med(lambda r: r["load_mx_peak"]) / 1e6,
            "decode_tok_s": med(lambda r: r["decode_tps"] or 0.0),
            "tokens": rs[0]["tokens"],
        })
    return out


def tensor_suite(args, model: Path) -> dict:
    """pyloader vs mlx-lm, pipeline vs tensor, 1 vs 2 ranks (every layer resident)."""
    runs = [(loader, None, 1) for loader in LOADERS]
    runs += [(loader, shard, 2) for shard in SHARDS for loader in LOADERS]
    configs = []
    for loader, shard, ranks in runs:
        options = ["--loader", loader, "--shard", shard or "pipeline", "--strategy",
                   args.strategy, "--resident", "1.0"]
        entry = {"loader": loader, "shard": shard, "ranks": ranks}
        try:
            rounds = [_run(model, ranks, args.tokens, args.launcher, options)
                      for _ in range(args.rounds)]
        except RuntimeError as e:
            entry["error"] = str(e)
            print(f"{loader} {shard or '-'} {ranks} rank(s): {entry['error']}", flush=True)
            configs.append(entry)
            continue
        entry["summary"], entry["rounds"] = _tensor_summary(rounds), rounds
        for r in rounds:
            for x in r:
                x.pop("page_cache", None)
        configs.append(entry)
        for s in entry["summary"]:
            print(f"{loader} {shard or '-'} {ranks} rank(s) rank {s['rank']}: load "
                  f"{s['load_s']:.2f} s, MLX peak {s['load_mx_peak_MB']:.0f} MB, read "
                  f"{s['storage_read_MB']:.0f} MB, {s['decode_tok_s']:.2f} tok/s", flush=True)
    # The reference of a run: mlx-lm's run of the same sharding and ranks, or (mlx-lm
    # cannot run it) the one-process mlx-lm run.
    ref = {(c["shard"], c["ranks"]): c["summary"][0]["tokens"] for c in configs
           if c["loader"] == "mlx-lm" and "summary" in c}
    for c in configs:
        if "summary" in c:
            want = ref.get((c["shard"], c["ranks"]), ref.get((None, 1)))
            c["tokens_match_mlx_lm"] = all(s["tokens"] == want for s in c["summary"])
    return {"strategy": args.strategy, "configs": configs}


def _last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else "failed"


def tensor_table(results: dict) -> str:
    """The tensor suite's results as a Markdown table (one row per rank of a run)."""
    def num(v, fmt):
        return "–" if v is None else format(v, fmt)
    title = (f"Model `{Path(results['model']).name}` ({results['bytes'] / 1e6:.0f} MB), "
             f"pyloader strategy `{results['strategy']}`, every layer resident; "
             f"`{results['command']}`")
    columns = ("loader", "shard", "ranks", "rank", "reader MB", "read from storage MB",
               "rchar MB", "load s", "MLX peak at load MB", "decode tok/s", "tokens = mlx-lm")
    lines = [title, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for c in results["configs"]:
        head = f"| {c['loader']} | {c['shard'] or '–'} | {c['ranks']} "
        if "error" in c:
            lines.append(head + f"| – | {c['error']} | | | | | | |")
            continue
        for s in c["summary"]:
            lines.append(head + f"| {s['rank']} | {num(s['reader_bytes_MB'], '.1f')} | "
                         f"{s['storage_read_MB']:.1f} | {s['rchar_MB']:.1f} | "
                         f"{s['load_s']:.2f} | {s['load_mx_peak_MB']:.1f} | "
                         f"{s['decode_tok_s']:.2f} | {c['tokens_match_mlx_lm']} |")
    lines += ["", ("Both ranks read one copy of the checkpoint through this machine's "
                   "page cache: storage reads split between them; the reader counters and "
                   "rchar are each rank's own. tokens = mlx-lm: the greedy tokens of "
                   "mlx-lm's run of the same sharding (one process where mlx-lm has none).")]
    return "\n".join(lines)


def residency_table(results: dict) -> str:
    """The residency suite's results as a Markdown table (one row per rank of a run)."""
    columns = ("resident", "ranks", "rank", "layers", "decode tok/s", "load s", "MLX peak MB",
               "peak RSS MB", "reader MB", "streamed MB/pass", "tokens identical")
    lines = [f"Model `{Path(results['model']).name}` ({results['bytes'] / 1e6:.0f} MB); "
             f"`{results['command']}`", "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name, entry in results["configs"].items():
        for ranks in (1, 2):
            for s in entry.get(f"{ranks}_rank", {}).get("summary", []):
                lines.append(
                    f"| {name} | {ranks} | {s['rank']} | {s['layers'] or 'all'} | "
                    f"{s['decode_tok_s']:.2f} | {s['load_s']:.2f} | {s['mx_peak_MB']:.0f} | "
                    f"{s['peak_rss_MB']:.0f} | {s['reader_bytes_MB']:.0f} | "
                    f"{s['streamed_MB_per_pass']:.0f} | {entry['tokens_identical']} |")
    return "\n".join(lines)


def table(results: dict) -> str:
    """The Markdown table of either suite's results file."""
    return tensor_table(results) if "strategy" in results else residency_table(results)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("residency", "tensor"), default="residency",
                   help="residency: pipeline at three resident settings (distributed.json); "
                        "tensor: loaders x shardings x ranks (distributed-tensor.json)")
    p.add_argument("--size", type=float, default=900e6)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--strategy", choices=("mmap", "pread"), default="pread",
                   help="tensor suite: pyloader's strategy (pread: its MLX peak counts "
                        "what it holds, as mlx-lm's does)")
    p.add_argument("--out", default=None, help="default: bench/results/raw/distributed.json "
                   "or distributed-tensor.json")
    p.add_argument("--table", default=None, metavar="JSON",
                   help="print the Markdown table of a results file (either suite) and exit")
    p.add_argument("--launcher", choices=("direct", "mlx.launch"), default="direct",
                   help="direct: the two ranks started here with MLX_RANK/MLX_HOSTFILE")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    name = "distributed.json" if args.suite == "residency" else "distributed-tensor.json"
    out = Path(args.out or RAW / name)
    cache = Path(os.path.expanduser("~/.cache/pyloader/bench"))
    model = make_model(cache / f"llama-{int(args.size / 1e6)}MB", int(args.size))
    results = {"env": environment(), "model": str(model), "bytes": pio.open(model).total_nbytes,
               "command": " ".join(["python bench/distributed_bench.py", *sys.argv[1:]]),
               "launcher": args.launcher}
    if args.suite == "tensor":
        results.update(tensor_suite(args, model))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        text = tensor_table(results)
        print(text)
        return
    results["configs"] = {}
    for name, resident in CONFIGS.items():
        entry = {}
        for ranks in (1, 2):
            rounds = [_run(model, ranks, args.tokens, args.launcher,
                           ["--strategy", "mmap", "--resident", resident])
                      for _ in range(args.rounds)]
            entry[f"{ranks}_rank"] = {"summary": _summary(rounds), "rounds": rounds}
            for s in entry[f"{ranks}_rank"]["summary"]:
                print(f"{name:9s} {ranks} rank(s) rank {s['rank']} layers {s['layers']}: "
                      f"{s['decode_tok_s']:.2f} tok/s, MLX peak {s['mx_peak_MB']:.0f} MB, "
                      f"peak RSS {s['peak_rss_MB']:.0f} MB, reader {s['reader_bytes_MB']:.0f} MB, "
                      f"streamed {s['streamed_MB_per_pass']:.0f} MB/pass", flush=True)
        tokens = {tuple(s["tokens"]) for v in entry.values() for s in v["summary"]}
        entry["tokens_identical"] = len(tokens) == 1
        results["configs"][name] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print("tokens identical:", {k: v["tokens_identical"] for k, v in results["configs"].items()})


if __name__ == "__main__":
    main()
