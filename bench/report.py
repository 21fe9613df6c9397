"""Markdown tables from a ``pytest bench/ --benchmark-json=FILE`` run.

    python bench/report.py bench.json            # to stdout
    python bench/report.py bench.json -o out.md  # to a file

One table per checkpoint and cache state. "bench" times are pytest-benchmark's
medians (min-max) of the timed target: the child's work plus a pipe round trip
of about 1-4 ms, which dominates the mmap strategy's time to dict. "child"
times are the medians of what the child measured itself, without the round
trip. Memory figures are medians over the rounds of the ``read_all`` benchmark
(memory once every byte has been read). Every metric has its ratio against the
``mlx`` row (``mx.load``) of the same table: below 1 is faster / smaller.
"""

from __future__ import annotations

import argparse
import json
import sys

STRATEGY_ORDER = ("mlx", "pread", "mmap", "safetensors")
MiB = 2**20


def _index(data: dict) -> dict[tuple, dict]:
    out = {}
    for b in data["benchmarks"]:
        p = b["params"]
        out[(p["checkpoint"], p["cache"], p["phase"], p["strategy"])] = b
    return out


def _ratio(v, base) -> str:
    if v is None or not base:
        return "-"
    return f"{v / base:.3f}"


def _sec(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _time(b: dict | None) -> tuple[str, float | None]:
    if b is None:
        return "-", None
    s = b["stats"]
    return f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})", s["median"]


def render(data: dict) -> str:
    idx = _index(data)
    lines = []
    m = data.get("machine_info", {})
    c = data.get("commit_info", {})
    lines.append(f"pytest-benchmark {data.get('version', '?')}, {data.get('datetime', '')}, "
                 f"{m.get('cpu', {}).get('brand_raw', m.get('processor', ''))}, "
                 f"Python {m.get('python_version', '?')}, commit {str(c.get('id', '?'))[:10]}"
                 f"{' (dirty)' if c.get('dirty') else ''}")
    pairs = dict.fromkeys((k[0], k[1]) for k in idx)
    for ckpt, cache in pairs:
        strategies = [s for s in STRATEGY_ORDER
                      if any((ckpt, cache, ph, s) in idx for ph in ("dict", "read_all"))]
        if not strategies:
            continue
        any_b = next(idx[k] for k in idx if k[:2] == (ckpt, cache))
        info = any_b["extra_info"]
        rounds = any_b["stats"]["rounds"]
        title = (f"### {ckpt}, {cache} page cache ({info.get('bytes', 0) / 2**30:.2f} GiB, "
                 f"{info.get('tensors', '?')} tensors, {rounds} rounds)")
        lines += ["", title, ""]
        lines.append("| strategy | dict, bench s (min-max) | x mlx | dict, child s | x mlx "
                     "| read all, bench s (min-max) | x mlx | read all, child s | x mlx "
                     "| anon added, MiB | x mlx | peak RSS, MiB | x mlx | mx peak, MiB | x mlx "
                     "| zero-copy |")
        lines.append("|---" * 17 + "|")
        base_d = _time(idx.get((ckpt, cache, "dict", "mlx")))[1]
        base_r = _time(idx.get((ckpt, cache, "read_all", "mlx")))[1]
        base_mem = (idx.get((ckpt, cache, "read_all", "mlx")) or {}).get("extra_info", {})

        def child(phase, strategy, key, ckpt=ckpt, cache=cache):
            b = idx.get((ckpt, cache, phase, strategy))
            return None if b is None else b["extra_info"].get(key)

        cd0, cr0 = child("dict", "mlx", "t_dict"), child("read_all", "mlx", "t_read_all")
        for s in strategies:
            td, vd = _time(idx.get((ckpt, cache, "dict", s)))
            tr, vr = _time(idx.get((ckpt, cache, "read_all", s)))
            mem = (idx.get((ckpt, cache, "read_all", s))
                   or idx.get((ckpt, cache, "dict", s)) or {}).get("extra_info", {})

            def mib(key, mem=mem):
                v = mem.get(key)
                return "-" if v is None else f"{v / MiB:.1f}"

            zc = mem.get("zero_copy_fraction")
            cd, cr = child("dict", s, "t_dict"), child("read_all", s, "t_read_all")
            lines.append(
                f"| {s} | {td} | {_ratio(vd, base_d)} | {_sec(cd)} | {_ratio(cd, cd0)} "
                f"| {tr} | {_ratio(vr, base_r)} | {_sec(cr)} | {_ratio(cr, cr0)} | "
                f"{mib('anon_delta')} | {_ratio(max(mem.get('anon_delta', 0), 0), base_mem.get('anon_delta'))} | "
                f"{mib('peak_rss')} | {_ratio(mem.get('peak_rss'), base_mem.get('peak_rss'))} | "
                f"{mib('mx_peak')} | {_ratio(mem.get('mx_peak'), base_mem.get('mx_peak'))} | "
                f"{'-' if zc is None else f'{100 * zc:.0f}%'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="file written by pytest --benchmark-json")
    p.add_argument("-o", "--output", help="write the markdown here instead of stdout")
    args = p.parse_args(argv)
    with open(args.json) as f:
        text = render(json.load(f))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
