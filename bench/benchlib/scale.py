"""A model larger than memory, end to end: the scale runs of ``bench/seed_scale.py``.

:func:`run_scale` takes a model directory (typically :func:`benchlib.synthetic.shapes.
make_sharded_model`'s) and a memory limit and measures, each in a fresh child
(:class:`pyloader.compare.protocol.Child`, workload ``stream``):

1. the reference: plain mlx-lm (``mlx_lm.utils.load_model``, every weight in memory),
   no limit: its greedy tokens and its decode time per token (the compute bound);
2. the planned run: ``load_planned(path, "auto")`` inside a memory cgroup of ``limit``
   bytes, from a cold page cache: load time, time to the first token, decode time per
   token, the planner's resident set and predicted speed, peak cgroup usage;
3. one row per resident fraction (``residency``) inside the same limit, cold: decode
   time per token, or the pre-flight's ``MemoryError`` when the fraction cannot fit.

Every constrained run is preceded by two cold sequential ``read()`` passes over 1 GiB of
the model's largest shard into one reused buffer (:func:`read_bandwidth`, evicted before
each). This VM's host caches what the guest read recently (a second cold read runs at
1.5-2.1 GB/s against 0.5-1.0 for the first), and a stream re-reads the same bytes every
token, so the bound uses the second, faster pass: ``max(streamed bytes per token / that
bandwidth, the reference's compute per token)`` (both passes are recorded).
Tokens of every run are compared with the reference's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Sequence

from pyloader.compare.system import count_layers
from pyloader.compare.system import loadavg
from pyloader.io.checkpoint import Checkpoint
from pyloader.io.pagecache import evict_file
from pyloader.residency import model_budget, read_strategy
from pyloader.streaming.resident import choose_resident
from benchlib.cgroup import MemoryCgroup, unavailable_reason
from pyloader.compare.protocol import Child, MeasureError
from benchlib.workloads import STREAM

#: Bytes of the bandwidth probe before each constrained run, and its read size.
PROBE_BYTES = 1 << 30
PROBE_BUFFER = 8 << 20


def read_bandwidth(ckpt: Checkpoint, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s of a cold sequential ``read()`` of ``nbytes`` from the middle of the
    checkpoint's largest file (evicted before and after), into one reused buffer: the
    plain read bound, the same one ``bench/pread_sweep.py`` measures."""
    path = max(ckpt.files, key=os.path.getsize)
    size = os.path.getsize(path)
    start = max(0, (size - nbytes) // 2) // PROBE_BUFFER * PROBE_BUFFER
    evict_file(path)
    buf = bytearray(PROBE_BUFFER)
    done = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while done < nbytes and (n := f.readinto(buf)):
            done += n
    seconds = time.perf_counter() - t0
    evict_file(path)
    return done / max(seconds, 1e-9)


def _evict(ckpt: Checkpoint) -> None:
    for f in ckpt.files:
        evict_file(f)


def step_stats(ready: dict, result: dict, tokens: int) -> dict:
    """One ``stream`` child's measurements (``tokens`` generated, the first in prepare)."""
    stream = result.get("stream") or {}
    out = {
        "load_s": ready["load_s"], "ttft_s": ready["ttft_s"],
        "decode_s_per_token": result["decode_s"] / max(tokens - 1, 1),
        "decode_tps": result["decode_tps"], "tokens": result["tokens"][0],
        "memory": result["memory"], "faults": result.get("faults"),
        "cpu_s": result.get("cpu_s"),
        "streamed_bytes_per_token": stream.get("streamed_bytes_per_pass", 0),
        "resident_bytes": stream.get("resident_bytes"),
        "wait_s": stream.get("wait_s"), "compute_s": stream.get("compute_s"),
        "passes": stream.get("passes"), "prefetch": stream.get("prefetch"),
        "kernels": ready.get("kernels"),
    }
    if "timeline" in result:
        out["timeline"] = result["timeline"]
    return out


def _child_args(path: Path, tokens: int, prompt_tokens: int, strategy: str,
                extra: Sequence[str], kernels: str) -> list[str]:
    return [str(path), "--tokens", str(tokens - 1), "--prompt-tokens", str(prompt_tokens),
            "--strategy", strategy, "--kernels", kernels, *extra]


def constrained_run(ckpt: Checkpoint, limit: int, args: list[str], label: str,
                    tokens: int, timeout: float, python: str | None = None) -> dict:
    """One cold ``stream`` child (``args``) inside a fresh cgroup of ``limit`` bytes, after
    two :func:`read_bandwidth` probes (``bandwidth_bps`` is the second's): its
    :func:`step_stats`, or ``ran=False`` with the error (``refused`` for a MemoryError),
    and the cgroup's peak, failcnt and OOM kills. ``python``: as :class:`Child`'s."""
    first = read_bandwidth(ckpt)
    bps = read_bandwidth(ckpt)
    _evict(ckpt)
    out: dict = {"bandwidth_bps": bps, "first_read_bps": first, "loadavg_before": loadavg()}
    with MemoryCgroup(limit) as cg:
        try:
            with Child(STREAM, args, label=label, timeout=timeout, cgroup=cg,
                       python=python) as child:
                ready = child.start()
                result = child.go()
            out.update(step_stats(ready, result, tokens), ran=True)
            if "plan" in ready:
                out["plan"] = ready["plan"]
        except MeasureError as exc:
            text = str(exc)
            refused = "MemoryError" in text
            out.update(ran=False, refused=refused, error=_first_error_line(text))
        out["loadavg_after"] = loadavg()
        out["cgroup"] = {"limit": limit, "peak": cg.read("memory.max_usage_in_bytes"),
                         "failcnt": cg.read("memory.failcnt"), "oom_kills": cg.oom_kills()}
    return out


def _first_error_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if "Error" in line and not line.startswith(" "):
            return line.strip()
    return text.splitlines()[0]


def add_bound(row: dict, compute_s: float) -> None:
    """Adds ``bound_s`` = max(streamed bytes per token / the row's bandwidth, ``compute_s``),
    ``io_s`` and ``vs_bound`` to a row that ran."""
    if not row.get("ran"):
        return
    io_s = row["streamed_bytes_per_token"] / row["bandwidth_bps"]
    row["bound_s"] = max(io_s, compute_s)
    row["io_s"] = io_s
    row["vs_bound"] = row["decode_s_per_token"] / row["bound_s"]


def run_scale(path: str | Path, limit: int, *, tokens: int = 16, prompt_tokens: int = 16,
              residency: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), row_tokens: int = 4,
              strategy: str = "auto", timeout: float = 3600.0,
              timeline: str | None = None, kernels: str = "mlx",
              log: Callable[[str], None] | None = None) -> dict:
    """Runs the reference, the planned run and the residency rows (see the module doc)
    and returns their measurements (JSON-ready). ``timeline``: a file the planned run's
    decode timeline (:func:`pyloader.trace`) is written to; its summary is in the result.
    ``kernels``: what every run computes with (:mod:`pyloader.kernels`: ``"mlx"``,
    MLX's ops, or ``"auto"``, pyloader's CPU kernels), the reference included, so the
    tokens compare bit for bit.

    Raises:
        RuntimeError: no memory cgroup can be created here (the reason says why).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the scale runs need a memory cgroup: {reason}")
    say = log or (lambda _: None)
    path = Path(path)
    ckpt = Checkpoint(path)
    out: dict = {
        "model": {"path": str(path), "bytes": ckpt.total_nbytes, "shards": len(ckpt.files),
                  "tensors": len(ckpt), "layers": count_layers(ckpt.keys())},
        "limit": limit, "tokens": tokens, "prompt_tokens": prompt_tokens,
        "row_tokens": row_tokens, "strategy": strategy, "kernels": kernels,
        "started": time.time()}

    say(f"reference: mlx-lm, no limit, {tokens} tokens, kernels={kernels}")
    _evict(ckpt)  # cold, as every run after it
    with Child(STREAM, _child_args(path, tokens, prompt_tokens, strategy,
                                     ["--mode", "mlx-lm"], kernels),
               label="reference (mlx-lm)", timeout=timeout) as child:
        ready = child.start()
        ref = step_stats(ready, child.go(), tokens)
    out["reference"] = ref
    compute_s = ref["decode_s_per_token"]
    say(f"  {compute_s:.2f} s/token, tokens {ref['tokens']}")

    say(f"planned: load_planned(auto) in {limit / 1e9:.2f} GB, {tokens} tokens")
    planned = constrained_run(ckpt, limit, _child_args(
        path, tokens, prompt_tokens, strategy,
        ["--planned", "auto"] + (["--timeline", str(timeline)] if timeline else []), kernels),
        "planned (auto)",
        tokens, timeout)
    add_bound(planned, compute_s)
    if planned.get("ran"):
        planned["tokens_identical"] = planned["tokens"] == ref["tokens"]
        pred = (planned.get("plan") or {}).get("prediction")
        if pred:
            planned["predicted_s_per_token"] = pred["decode_s_per_token"]
            planned["prediction_error"] = (pred["decode_s_per_token"]
                                           / planned["decode_s_per_token"] - 1)
    out["planned"] = planned
    say(f"  {_describe(planned)}")

    rows = []
    layer_bytes = model_budget(path).layer_bytes if strategy == "auto" else None
    for frac in residency:
        say(f"resident {frac:.0%} in {limit / 1e9:.2f} GB, {row_tokens} tokens")
        row_strategy = strategy if strategy != "auto" else read_strategy(
            layer_bytes, choose_resident(layer_bytes, frac, "first_n"))
        row = constrained_run(ckpt, limit, _child_args(
            path, row_tokens, prompt_tokens, row_strategy, ["--resident", str(frac)], kernels),
            f"resident {frac}", row_tokens, timeout)
        row["resident"] = frac
        add_bound(row, compute_s)
        if row.get("ran"):
            row["tokens_identical"] = row["tokens"] == ref["tokens"][:row_tokens]
        rows.append(row)
        say(f"  {_describe(row)}")
    out["rows"] = rows
    out["identical"] = all(r.get("tokens_identical", True) for r in [planned, *rows]
                           if r.get("ran")) and planned.get("ran", False)
    out["finished"] = time.time()
    return out


def _describe(row: dict) -> str:
    if not row.get("ran"):
        return f"did not run: {row.get('error')}"
    s = (f"{row['decode_s_per_token']:.2f} s/token (bound {row['bound_s']:.2f}, "
         f"{row['vs_bound']:.2f}x), load {row['load_s']:.1f} s, "
         f"peak {row['cgroup']['peak'] / 1e9:.2f} GB, identical {row['tokens_identical']}")
    if "plan" in row:
        p = row["plan"]
        s += f", planner kept {len(p['resident_layers'])}/{p['layers']} layers"
    return s

