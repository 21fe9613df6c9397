"""Which layers stay resident for a memory budget. See docs/memory-planning.md."""

from __future__ import annotations

import collections
import itertools
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .._util.memory import read_memory
from .._util.sizes import format_bytes, parse_bytes
from ..loading import load_model
from ..streaming.depth import planning_depth
from ..streaming.options import StreamOptions
from .budget import RUNTIME_RESERVE, MemoryTable, ModelBudget, model_budget
from .calibration import Calibration, cached_calibration, calibrate
from .cost import pass_time, predict
from .monitor import DEFAULT_HIGH_WATER, PressureMonitor, PressureSettings

#: Tokens of KV cache reserved by each priority (max_context: the whole context).
PRIORITIES = {"max_tps": 512, "balanced": 1024, "max_context": None}


@dataclass(frozen=True)
class KVSpec:
    """The KV cache a plan reserves memory for.

    Attributes:
        context: Expected context in tokens (None: min(model max, 4096)).
        priority: ``"max_tps"`` (512 tokens), ``"balanced"`` (1024) or ``"max_context"``.
        bits, dtype: KV quantization (None, 8, 4) and float dtype (None: working precision).
    """

    context: int | None = None
    priority: str = "balanced"
    bits: int | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"unknown priority {self.priority!r}; expected one of "
                             f"{tuple(PRIORITIES)}")
        if self.context is not None and self.context < 1:
            raise ValueError(f"context must be positive, got {self.context}")


@dataclass(frozen=True)
class Headroom:
    """The ``"auto"`` budget: this process's headroom now minus ``reserve`` bytes."""

    reserve: int = DEFAULT_HIGH_WATER


@dataclass
class Plan:
    """A resident set for a budget, with its memory table and predicted speed."""

    budget_bytes: int
    budget_source: str           # "explicit" or "auto" (probes: headroom - reserve)
    priority: str
    context: int                 # expected context (tokens)
    kv_reserve_tokens: int       # tokens of KV cache the plan reserves
    resident_layers: tuple[int, ...]
    table: MemoryTable
    table_all_resident: MemoryTable
    max_context: int             # longest context that fits with this resident set
    max_context_all_resident: int
    model: ModelBudget = field(repr=False)
    prediction: dict | None = None
    calibration: Calibration | None = None
    #: The smallest budget this plan fits in (every layer streamed).
    min_budget_bytes: int = 0
    #: The read path the plan streams with: ``"mmap"`` or ``"pread"``.
    strategy: str = "mmap"

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.model.n_layers) if i not in self.resident_layers)

    @property
    def expected_peak(self) -> int:
        return self.table.total

    @property
    def fits(self) -> bool:
        """The plan's peak (resident set, KV reserve, activations, runtime) fits the budget."""
        return self.table.total <= self.budget_bytes

    @property
    def fits_all_resident(self) -> bool:
        return self.table_all_resident.total <= self.budget_bytes

    def to_dict(self) -> dict:
        t = self.table
        return {
            "model": self.model.to_dict(self.kv_reserve_tokens),
            "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
            "priority": self.priority, "context": self.context,
            "kv_reserve_tokens": self.kv_reserve_tokens,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "weights_bytes": self.model.weights_bytes,
            "table": {**asdict(t), "total": t.total},
            "table_all_resident": {**asdict(self.table_all_resident),
                                   "total": self.table_all_resident.total},
            "fits": self.fits, "fits_all_resident": self.fits_all_resident,
            "max_context": self.max_context,
            "max_context_all_resident": self.max_context_all_resident,
            "resident_layers": list(self.resident_layers),
            "streamed_layers": list(self.streamed_layers),
            "expected_peak": self.expected_peak,
            "min_budget_bytes": self.min_budget_bytes,
            "prediction": self.prediction,
            "strategy": self.strategy,
            "calibration": self.calibration.to_dict() if self.calibration else None,
        }

    def render(self) -> str:
        m, t, a = self.model, self.table, self.table_all_resident
        fb = format_bytes
        q = (f"{m.quantization['bits']}-bit g{m.quantization['group_size']}"
             if m.quantization else m.weights_dtype)
        lb = m.layer_bytes
        size = (fb(lb[0]) if len(set(lb)) == 1 else f"{fb(min(lb))}–{fb(max(lb))}")
        kinds = collections.Counter(c.kind for c in m.caches)
        lines = [
            f"model      {m.name} ({m.model_type}, {m.n_layers} layers, {q}; weights from "
            f"{'the checkpoint index' if m.source == 'checkpoint' else 'config shapes'})",
            f"budget     {fb(self.budget_bytes)} ({self.budget_source}), priority "
            f"{self.priority}, context {self.context}, KV reserve {self.kv_reserve_tokens} "
            f"tokens, KV {m.kv_dtype}",
            f"KV cache   {m.kv_bytes_per_token:,} B/token over {m.kv_layers} layers "
            f"({', '.join(f'{n} {k}' for k, n in kinds.items())})",
            "",
            f"{'':22}{'all resident':>16}{'this plan':>16}",
            f"{'weights (resident)':22}{fb(a.resident_weights):>16}{fb(t.resident_weights):>16}",
            f"{'  non-layer':22}{fb(m.nonlayer_bytes):>16}{fb(m.nonlayer_bytes):>16}",
            f"{'  layers':22}{f'{m.n_layers} × {size}':>16}"
            f"{f'{len(self.resident_layers)} resident':>16}",
            f"{'KV cache':22}{fb(a.kv_cache):>16}{fb(t.kv_cache):>16}",
            f"{'activations':22}{fb(a.activations):>16}{fb(t.activations):>16}",
            f"{'streaming buffers':22}{fb(a.stream_buffer):>16}{fb(t.stream_buffer):>16}",
            *([f"{'expert caches':22}{fb(a.expert_cache):>16}{fb(t.expert_cache):>16}"]
              if m.experts != "layer" else []),
            f"{'runtime reserve':22}{fb(a.runtime):>16}{fb(t.runtime):>16}",
            f"{'total (peak)':22}{fb(a.total):>16}{fb(t.total):>16}",
            f"{'fits':22}{'yes' if self.fits_all_resident else 'no':>16}"
            f"{'yes' if self.fits else 'no':>16}",
            f"{'max context':22}{self.max_context_all_resident:>16,}{self.max_context:>16,}",
            "",
            f"resident   {len(self.resident_layers)}/{m.n_layers} layers "
            f"{format_ranges(self.resident_layers)}; streamed {len(self.streamed_layers)} "
            f"({fb(sum(lb[i] for i in self.streamed_layers))} read per forward pass"
            + (f" with {self.strategy})" if self.streamed_layers else ")"),
        ]
        if not self.fits:
            least_mb = -(-self.min_budget_bytes // 10**6)
            how = (f"--ram {least_mb}MB" if self.budget_source == "explicit"
                   else "free memory beyond the pressure reserve")
            lines.append(f"no fit     the smallest budget that fits is {least_mb} MB "
                         f"({how}: every layer streamed, KV reserve "
                         f"{self.kv_reserve_tokens} tokens); every layer resident needs "
                         f"{fb(a.total)}; no speed is predicted for a plan that does not fit")
        if m.experts != "layer":
            lines.append(f"experts    {m.expert_slots} slots in each of {len(m.expert_layers)} "
                         f"MoE modules (experts={m.experts!r}, {m.expert_source}); no speed "
                         "prediction for expert caches")
        if self.prediction:
            p = self.prediction
            lines.append(f"predicted  decode {p['decode_tps']:.2f} tok/s, prefill "
                         f"{p['prefill_tps']:.1f} tok/s (chunks of {p['prefill_tokens']})")
        if self.calibration:
            lines.append(f"           {self.calibration.describe()}")
        return "\n".join(lines)


def format_ranges(idx: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``"[0-2,5,7-8]"``."""
    runs = [[i for _, i in run] for _, run in
            itertools.groupby(enumerate(sorted(idx)), lambda p: p[1] - p[0])]
    return "[" + ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) + "]"


def choose_layers(budget: ModelBudget, free: int, cal: Calibration | None,
            stream_buffer: int, prefetch: int = 1) -> tuple[int, ...]:
    """The resident set saving the most predicted time within ``free`` bytes."""
    n = budget.n_layers
    lb = budget.layer_bytes
    if sum(lb) <= free:
        return tuple(range(n))
    room = free - stream_buffer
    if room <= 0:
        return ()

    def saving(i: int) -> float:
        # Value of keeping layer i: its read or fixed cost, whichever bounds the pass.
        if cal is None:
            return float(lb[i])
        c = cal.decode_s_per_byte * lb[i]
        work = c + cal.unit_overhead_s + cal.release_s_per_byte * lb[i]
        return max(work, lb[i] / cal.read_bytes_per_s) - c

    slots = 4096
    q = max(1, -(-room // slots))
    cap = room // q
    size = [-(-b // q) for b in lb]
    # best[c] = (value, -count, chosen) with capacity c; ties prefer fewer, lower layers.
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())] * (cap + 1)
    for i in range(n):
        if size[i] > cap:
            continue
        v = saving(i) * (1 + 1e-9 * (n - i))  # ties: lower index first
        for c in range(cap, size[i] - 1, -1):
            cand = best[c - size[i]][0] + v
            if cand > best[c][0]:
                best[c] = (cand, best[c - size[i]][1] + (i,))
    chosen = tuple(sorted(best[cap][1]))
    if cal is not None and n <= _LOCAL_SEARCH_LAYERS:
        # Improve both the knapsack set and the empty set; the faster wins.
        found = [_improve(budget, start, room, cal, prefetch) for start in (chosen, ())]
        chosen = min(found, key=lambda r: r[0])[1]
    return chosen


#: Up to this many layers the knapsack choice is refined by local search.
_LOCAL_SEARCH_LAYERS = 32


def _improve(budget: ModelBudget, chosen: tuple[int, ...], room: int, cal: Calibration,
             prefetch: int) -> tuple[float, tuple[int, ...]]:
    """Local search from ``chosen`` within ``room``: (pass seconds, the set)."""
    lb = budget.layer_bytes

    def t(s) -> float:
        return pass_time(budget, s, cal.decode_s_per_byte, cal.unit_overhead_s,
                         cal.release_s_per_byte, cal.read_bytes_per_s, prefetch)

    cur, now = set(chosen), t(chosen)
    used = sum(lb[i] for i in cur)
    while True:
        best = None
        outside = [j for j in range(len(lb)) if j not in cur]
        moves = [None] + sorted(cur)  # add j, or swap it for i
        for j in outside:
            for i in moves:
                size = used + lb[j] - (lb[i] if i is not None else 0)
                if size > room:
                    continue
                cand = (cur - {i}) | {j}
                tc = t(cand)
                if tc >= now * (1 - 1e-9):
                    continue
                score = (now - tc) / max(size - used, 1)
                if best is None or score > best[0]:
                    best = (score, tc, cand, size)
        if best is None:
            return now, tuple(sorted(cur))
        _, now, cur, used = best


def plan(path_or_config, budget: int | str | Headroom = "auto", *,
         kv: KVSpec | None = None, options: StreamOptions | None = None,
         strategy: str = "auto", calibration: Calibration | str | None = "cached",
         kernels: str | None = None) -> Plan:
    """Plans the resident set of a model for a memory budget.

    Args:
        path_or_config: model directory, config path or dict, or a :class:`ModelBudget`.
        budget: bytes (int or e.g. ``"6GB"``) for the whole process, ``"auto"`` or a
            :class:`Headroom`.
        kv: the KV cache to reserve for (:class:`KVSpec`).
        options: :class:`pyloader.streaming.StreamOptions` (no prediction with expert caches).
        strategy: ``"mmap"``, ``"pread"`` or ``"auto"`` (:func:`read_strategy`).
        calibration: a :class:`Calibration`, ``"cached"``, ``"measure"`` or None.
        kernels: as :func:`pyloader.load_model` takes them.
    """
    if strategy not in ("auto", "mmap", "pread"):
        raise ValueError(f"unknown strategy {strategy!r}; expected 'auto', 'mmap' or "
                         "'pread'")
    kv = kv if kv is not None else KVSpec()
    options = options if options is not None else StreamOptions()
    prefetch = planning_depth(options.prefetch)
    if isinstance(path_or_config, ModelBudget):
        m, path_or_config = path_or_config, path_or_config.location
    else:
        m = model_budget(path_or_config, kv_bits=kv.bits, kv_dtype=kv.dtype,
                         experts=options.experts, expert_source=options.expert_source)
    context = kv.context if kv.context is not None else min(m.max_position_embeddings or 4096, 4096)
    kv_tokens = min(context, PRIORITIES[kv.priority] or context)
    if budget == "auto":
        budget = Headroom()
    if isinstance(budget, Headroom):
        head = read_memory().headroom
        if head is None:
            raise RuntimeError("budget='auto' needs a memory probe; none is readable here "
                               "(pass a byte budget)")
        total, source, runtime = max(0, head - budget.reserve), "auto", 0
    else:
        total = parse_bytes(budget) if isinstance(budget, str) else int(budget)
        source, runtime = "explicit", RUNTIME_RESERVE
    if calibration == "cached":
        cal = cached_calibration(path_or_config, m, kernels=kernels)
    elif calibration == "measure":
        cal = calibrate(path_or_config, budget=m, kernels=kernels)
    else:
        cal = calibration
    every = m.table(kv_tokens, None, runtime, prefetch)
    fixed = every.total - sum(m.layer_bytes)
    buffer = (prefetch + 1) * max(m.layer_bytes) if m.layer_bytes else 0
    resident = choose_layers(m, total - fixed, cal, buffer, prefetch)
    table = m.table(kv_tokens, resident, runtime, prefetch)
    floor = m.table(kv_tokens, (), runtime, prefetch).total
    fits = table.total <= total
    if strategy == "auto":
        strategy = read_strategy(m.layer_bytes, set(resident))
    # The resident set stays; the KV cache may grow into whatever is left.
    return Plan(
        budget_bytes=total, budget_source=source, priority=kv.priority, context=context,
        kv_reserve_tokens=kv_tokens, resident_layers=resident, table=table,
        table_all_resident=every,
        max_context=m.max_context(total, resident, runtime),
        max_context_all_resident=m.max_context(total, None, runtime),
        model=m, prediction=(predict(m, resident, cal, prefetch=prefetch, strategy=strategy)
                             if cal and m.experts == "layer" and fits else None),
        calibration=cal, min_budget_bytes=min(floor, every.total), strategy=strategy)


#: ``strategy="auto"`` uses pread when a streamed layer is at least this large.
PREAD_MIN_LAYER_BYTES = 64 << 20


def read_strategy(layer_bytes: Sequence[int], resident) -> str:
    """``"pread"`` if a streamed layer has :data:`PREAD_MIN_LAYER_BYTES`, else ``"mmap"``."""
    streamed = [b for i, b in enumerate(layer_bytes) if i not in resident]
    return "pread" if streamed and max(streamed) >= PREAD_MIN_LAYER_BYTES else "mmap"


def load_planned(path, budget: int | str | Headroom = "auto", *, kv: KVSpec | None = None,
                 monitor: bool | dict | PressureSettings = True, strategy: str = "auto",
                 options: StreamOptions | None = None, **load_kwargs):
    """Plans, loads the model with the plan's resident set, and attaches a
    :class:`PressureMonitor` (``monitor``: settings, or a dict of them and ``probe``).
    Other arguments as in :func:`plan`. Returns ``(model, tokenizer, plan, monitor_or_None)``."""
    opts = dict(monitor) if isinstance(monitor, dict) else {}
    probe = opts.pop("probe", None)
    settings = (monitor if isinstance(monitor, PressureSettings)
                else PressureSettings(**opts))
    options = options if options is not None else StreamOptions()
    if budget == "auto":
        budget = Headroom(settings.high_water)
    p = plan(path, budget, kv=kv, options=options, strategy=strategy,
             kernels=load_kwargs.get("kernels"))
    options = options.with_(strategy=p.strategy, resident=set(p.resident_layers))
    model, tok = load_model(path, options=options, **load_kwargs)
    mon = PressureMonitor(model, settings, probe=probe).attach() if monitor else None
    return model, tok, p, mon
