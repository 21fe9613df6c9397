"""Pipeline-parallel loading on loopback: one process vs two ranks
(``mlx.launch --backend ring -n 2``), per-rank memory, bytes read and tok/s.

    python bench/distributed_bench.py [--size 900e6] [--tokens 8] [--rounds 2]
        [--out bench/results/distributed.json]

Model: a random bf16 llama of about ``--size`` bytes (``pyloader.bench.synthetic``;
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

import pyloader
from pyloader.bench.synthetic import make_model

# Every layer resident; a 500 MB weight budget per process; every layer streamed.
CONFIGS = {"resident": "1.0", "budget-500MB": "500MB", "streamed": "0"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model: Path, resident: str, ranks: int, tokens: int, launcher: str
         ) -> list[dict]:
    for t in pyloader.open(model).tensors():
        pyloader.evict_file(t.file)
    with tempfile.TemporaryDirectory() as out:
        child = [sys.executable, "-m", "pyloader.bench.child", "distributed", "--no-wait",
                 "--result-file", str(Path(out) / "rank{rank}.json"), str(model),
                 "--strategy", "mmap", "--resident", resident, "--prefetch", "1",
                 "--tokens", str(tokens)]
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
        for p in procs:
            stdout, stderr = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(stdout + stderr)
        results = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    for r in results:
        r.pop("page_cache", None)
    return results


def _summary(rounds: list[list[dict]]) -> list[dict]:
    """Per rank: medians over rounds of the numbers the README quotes."""
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=float, default=900e6)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "distributed.json"))
    p.add_argument("--launcher", choices=("direct", "mlx.launch"), default="direct",
                   help="direct: the two ranks started here with MLX_RANK/MLX_HOSTFILE")
    args = p.parse_args(argv)
    cache = Path(os.path.expanduser("~/.cache/pyloader/bench"))
    model = make_model(cache / f"llama-{int(args.size / 1e6)}MB", int(args.size))
    results = {"model": str(model), "bytes": pyloader.open(model).total_nbytes,
               "command": " ".join(["python bench/distributed_bench.py", *sys.argv[1:]]),
               "launcher": args.launcher,
               "configs": {}}
    for name, resident in CONFIGS.items():
        entry = {}
        for ranks in (1, 2):
            rounds = [_run(model, resident, ranks, args.tokens, args.launcher)
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("tokens identical:", {k: v["tokens_identical"] for k, v in results["configs"].items()})


if __name__ == "__main__":
    main()
