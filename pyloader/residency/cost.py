"""Cost model of one streamed forward pass. See docs/memory-planning.md."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .budget import ModelBudget


@dataclass
class Calibration:
    """Measured constants of the cost model (``k``, ``o``, read bandwidths, drop cost)."""

    disk_bytes_per_s: float
    decode_s_per_byte: float          # k for one decode token
    prefill_s_per_byte_token: float   # k per prompt token, for a chunk of prefill_tokens
    unit_overhead_s: float            # o
    prefill_tokens: int
    source: str                       # "model" (measured on this checkpoint) or "machine"
    key: str
    measured_at: float = field(default_factory=time.time)
    detail: dict = field(default_factory=dict)
    #: Read bandwidth while streaming beside compute (None: disk_bytes_per_s is used).
    stream_bytes_per_s: float | None = None
    #: Seconds per byte of dropping a released unit's pages (mmap streaming).
    release_s_per_byte: float = 0.0
    #: Cold direct-I/O read bandwidth as pread streaming reads (None: unmeasured).
    direct_bytes_per_s: float | None = None

    @property
    def read_bytes_per_s(self) -> float:
        """The bandwidth the cost model uses for streamed reads."""
        return self.stream_bytes_per_s or self.disk_bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(**d)

    def describe(self) -> str:
        """One paragraph: the calibration's source, format, age, load and constants."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at))
        age = max(0.0, time.time() - self.measured_at)
        age_s = (f"{age / 86400:.0f} d" if age >= 86400 else f"{age / 3600:.0f} h"
                 if age >= 3600 else f"{age / 60:.0f} min")
        text = f"{self.source} calibration {when} ({age_s} ago"
        fmt = self.detail.get("format")
        if isinstance(fmt, dict):
            q = f"q{fmt['bits']}g{fmt['group_size']} " if fmt.get("bits") else ""
            text += f"; {q}{fmt['weights']} weights, {fmt['activation']} activations"
        kernels = (fmt if isinstance(fmt, dict) else self.detail).get("kernels")
        if kernels in ("auto", "mlx"):
            text += "; pyloader's CPU kernels" if kernels == "auto" else "; MLX's ops"
        cond = (self.detail.get("conditions") or {}).get("before")
        if cond and cond.get("loadavg1") is not None:
            text += f"; load {cond['loadavg1']:.2f} on {cond.get('cpus')} CPUs"
            if cond.get("runnable_other") is not None:
                text += f", {cond['runnable_other']:.1f} other tasks running"
            if cond.get("psi_cpu_some") is not None:
                text += f", CPU pressure {cond['psi_cpu_some']:.0f}%"
        text += ")"
        if self.detail.get("contended"):
            until = self.detail.get("expires_at")
            kept = (f"reused until {time.strftime('%H:%M', time.localtime(until))}, then "
                    "measured again (pyloader plan --calibrate: now)" if until else "not cached")
            text += (f" MEASURED UNDER CONTENTION ({self.detail['contended']}), so the "
                     f"prediction is unreliable; {kept};")
        return (f"{text}: disk {self.disk_bytes_per_s / 1e9:.2f} GB/s, "
                f"decode compute {1e-9 / self.decode_s_per_byte:.2f} GB/s of weights, "
                f"unit overhead {self.unit_overhead_s * 1e3:.1f} ms, page-cache drop "
                f"{self.release_s_per_byte * 1e11:.1f} ms/100 MB, "
                f"streaming reads {self.read_bytes_per_s / 1e9:.2f} GB/s"
                + (f", direct reads {self.direct_bytes_per_s / 1e9:.2f} GB/s"
                   if self.direct_bytes_per_s else ""))


def lm_head_bytes(b: ModelBudget) -> int:
    """Bytes of the output projection (the tied embedding when there is no lm_head)."""
    return max(0, b.compute_bytes - sum(b.layer_bytes))


def pass_time(budget: ModelBudget, resident: Sequence[int], k: float, o: float,
               drop: float, bw: float, prefetch: int = 1, passes: int = 3) -> float:
    """Steady-state seconds of one forward pass under the streaming schedule."""
    res = set(resident)
    lb = budget.layer_bytes
    order = [i for i in range(len(lb)) if i not in res]
    pos = {i: j for j, i in enumerate(order)}
    m = len(order)
    head = k * lm_head_bytes(budget)
    if not m:
        return head + k * sum(lb)
    # Python's clock, the compute stream's, the reader's, the drop thread's.
    py = comp = reads = drops = 0.0
    ready: dict[int, float] = {}

    def request(j: int) -> None:
        nonlocal reads
        reads = max(py, reads, drops) + lb[order[j]] / bw  # after every earlier release
        ready[j] = reads

    start = 0.0
    for _ in range(passes):
        start, pending = py, 0.0
        for i, b in enumerate(lb):
            if i in res:
                pending += k * b
                continue
            j = pos[i]
            comp, pending = max(comp, py) + pending, 0.0  # inputs evaluated asynchronously
            if j not in ready:
                request(j)  # nothing in flight: read it now
            py = max(py, ready.pop(j))
            for step in range(1, min(prefetch, m - 1) + 1):
                if (j + step) % m not in ready:
                    request((j + step) % m)
            comp = max(comp, py) + k * b + o  # compute, then synchronize
            py = comp
            drops = max(drops, py) + drop * b  # queued: the unit's pages leave
            if prefetch >= m:
                request(j)  # the only streamed unit(s): read again for the next pass
        comp = max(comp, py) + pending + head
        py = comp
    return py - start


def predict(budget: ModelBudget, resident: Sequence[int], cal: Calibration,
            prefill_tokens: int | None = None, prefetch: int = 1,
            strategy: str = "mmap") -> dict[str, float]:
    """Predicted decode and prefill seconds and tokens/s for ``strategy``."""
    if strategy not in ("mmap", "pread"):
        raise ValueError(f"unknown strategy {strategy!r}; expected 'mmap' or 'pread'")
    p = prefill_tokens or cal.prefill_tokens
    bw, o, drop = cal.read_bytes_per_s, cal.unit_overhead_s, cal.release_s_per_byte
    if strategy == "pread":
        bw, drop = cal.direct_bytes_per_s or cal.disk_bytes_per_s, 0.0
    t_dec = pass_time(budget, resident, cal.decode_s_per_byte, o, drop, bw, prefetch)
    t_pre = pass_time(budget, resident, cal.prefill_s_per_byte_token * p, o, drop, bw,
                       prefetch)
    return {"decode_s_per_token": t_dec, "decode_tps": 1.0 / t_dec,
            "prefill_s_per_chunk": t_pre, "prefill_tokens": p, "prefill_tps": p / t_pre}


def fit_stream_bandwidth(budget: ModelBudget, k: float, o: float, drop: float, bw: float,
                          t_cold: float, prefetch: int) -> float:
    """Bandwidth at which the simulated all-streamed pass takes ``t_cold`` (bisection)."""
    def t(rate: float) -> float:
        return pass_time(budget, (), k, o, drop, rate, prefetch)

    lo, hi = bw * 1e-3, bw * 1e3
    if t(hi) >= t_cold:
        return bw
    if t(lo) <= t_cold:
        return lo
    for _ in range(60):  # invariant: t(lo) > t_cold >= t(hi)
        mid = (lo * hi) ** 0.5
        if t(mid) > t_cold:
            lo = mid
        else:
            hi = mid
    return hi
