"""Load + generation comparison of ``pyloader compare MODEL``. See docs/compare.md."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..io.pagecache import page_cache_fraction, prepare_cache
from .harness import Workload
from .protocol import Child
from .workloads.generate import KERNEL_MODES, KV_MODES, STRATEGIES

BASELINE = "mlx-lm"
#: A GGUF file's baseline: mapped and computed in place by pyloader's kernels (mlx-lm does
#: not read GGUF files; llama.cpp maps them too).
GGUF_BASELINE = "mmap+kernels"
#: Default residencies of ``stream`` (and expert caches of ``stream-experts``).
DEFAULT_RESIDENT = ("0.5", "0")
#: Strategies that take ``@value``.
TAKES_VALUE = ("stream", "stream-experts")
#: Run only when asked for by name (needs an MoE model, or overlapped loads).
OPT_IN_STRATEGIES = ("stream-experts", "pread-overlap", "mmap-overlap")
#: What ``pyloader compare`` runs when no ``--strategies`` are given.
DEFAULT_STRATEGIES = tuple(s for s in STRATEGIES if s not in OPT_IN_STRATEGIES)

METRICS = [
    ("load_s", "load s", 1.0),
    ("ttft_s", "TTFT s", 1.0),
    ("first_token_s", "to 1st token s", 1.0),
    ("prompt_tps", "prompt tok/s", 1.0),
    ("decode_tps", "decode tok/s", 1.0),
    ("total_s", "total s", 1.0),
    ("peak_rss", "peak RSS", 2**-20),
    ("peak_anon", "peak RssAnon", 2**-20),
    ("rss_anon", "RssAnon at end", 2**-20),
    ("mx_peak", "MLX peak", 2**-20),
    ("read_bytes", "read from storage", 2**-20),
    ("resident_bytes", "resident weights", 2**-20),
    ("overlap_efficiency", "overlap", 1.0),
    ("expert_hit_rate", "expert hit rate", 1.0),
]


@dataclass(frozen=True)
class Config:
    """One configuration under test (see the module docstring for its label)."""

    strategy: str
    resident: str | None = None
    kv: str = "default"
    kernels: str = "mlx"

    @property
    def label(self) -> str:
        """``strategy[@resident][+kv][+kernels]``."""
        text = self.strategy if self.resident is None else f"{self.strategy}@{self.resident}"
        return (text + ("+kv" if self.kv == "prealloc" else "")
                + ("+kernels" if self.kernels == "auto" else ""))

    @property
    def resident_fraction(self) -> float | None:
        """The resident fraction when it is given as one (every non-stream strategy: 1)."""
        if self.strategy != "stream":
            return 1.0
        try:
            value = float(self.resident)
        except (TypeError, ValueError):
            return None
        return value if "." in self.resident or value == 0 else None

    @classmethod
    def parse(cls, label: str) -> Config:
        """The inverse of :attr:`label`; raises ValueError naming what is wrong."""
        text, kernels = ((label[:-8], "auto") if label.endswith("+kernels")
                         else (label, "mlx"))
        text, kv = (text[:-3], "prealloc") if text.endswith("+kv") else (text, "default")
        strategy, _, resident = text.partition("@")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} in {label!r}; choose from "
                             f"{', '.join(STRATEGIES)}")
        if strategy in TAKES_VALUE and not resident:
            raise ValueError(f"{label!r}: the {strategy} strategy needs a value, e.g. "
                             f"{strategy}@0.25")
        if strategy not in TAKES_VALUE and resident:
            raise ValueError(f"{label!r}: only {' and '.join(TAKES_VALUE)} take @value")
        return cls(strategy, resident or None, kv, kernels)


def configurations(strategies: Iterable[str], residents: Iterable[str],
                   kv_modes: Iterable[str], kernel_modes: Iterable[str] = ("mlx",),
                   baseline: str = BASELINE) -> list[str]:
    """Every strategy x kv mode x kernels label, the baseline first."""
    out = dict.fromkeys(Config(s, r, kv, kernels).label for kernels in kernel_modes
                        for kv in kv_modes for s in strategies
                        for r in (residents if s in TAKES_VALUE else [None]))
    return sorted(out, key=lambda label: label != baseline)


@dataclass(frozen=True)
class GenerateArgs:
    """The generate workload's settings (its command-line flags)."""

    max_tokens: int = 16
    prompt: str | None = None
    prompt_tokens: int = 32
    sample_ms: float = 5.0

    def flags(self) -> list[str]:
        args = ["--max-tokens", str(self.max_tokens), "--prompt-tokens",
                str(self.prompt_tokens), "--sample-ms", str(self.sample_ms)]
        return args if self.prompt is None else [*args, "--prompt", self.prompt]


def start_child(path: str, label: str, cache: str, *, files: list[str] | None = None,
                timeout: float = 1800.0, **generate_args) -> tuple[Child, float]:
    """Start ``label``'s child (``generate_args``: :class:`GenerateArgs`' fields), then set
    the page cache: (child, cached fraction)."""
    cfg = Config.parse(label)
    args = [os.path.abspath(path), "--strategy", cfg.strategy, "--kv", cfg.kv,
            "--kernels", cfg.kernels, *GenerateArgs(**generate_args).flags()]
    if cfg.resident is not None:
        args += ["--resident", cfg.resident]
    child = Child("generate", args, label=f"{label} on {path}", timeout=timeout)
    try:
        ready = child.start()
        prepare_cache(cache, files or ready["files"])
        return child, page_cache_fraction(path)
    except BaseException:
        child.close()
        raise


def measure_generation(path: str, label: str, cache: str, **kwargs) -> dict:
    """One run of ``label`` in a fresh child; the result gains ``page_cache_before``."""
    child, before = start_child(path, label, cache, **kwargs)
    with child:
        result = child.go()
    result["page_cache_before"] = before
    return result


def flatten(result: dict) -> dict:
    """A child's result as a row (tokens and memory samples kept for :func:`finish`)."""
    row = {k: result.get(k) for k in (
        "bytes", "prompt_tokens", "generated_tokens", "load_s", "ttft_s", "first_token_s",
        "prompt_tps",
        "decode_tps", "decode_s", "total_s", "peak_rss", "rss_anon", "rss_file", "peak_anon",
        "mx_peak", "read_bytes", "rchar", "page_cache_before", "tokens", "text", "samples")}
    st = result.get("stream")
    if st:
        row.update(resident_bytes=st["resident_bytes"], streamed_units=st["streamed_units"],
                   streamed_bytes_per_pass=st["streamed_bytes_per_pass"],
                   stream_bytes_read=st["bytes_read"], passes=st["passes"],
                   overlap_efficiency=st["overlap_efficiency"])
    else:
        row["resident_bytes"] = result.get("bytes")
    ex = result.get("experts")
    if ex:
        row.update(expert_hit_rate=ex["hit_rate"], expert_bytes_read=ex["bytes_read"],
                   expert_bank_bytes=ex["bank_bytes"])
    return row


def progress(row: dict) -> str:
    """One line of progress for a finished run."""
    return (f"load {row['load_s']:.3f} s, TTFT {row['ttft_s']:.2f} s, decode "
            f"{row['decode_tps'] or 0:.1f} tok/s, "
            f"peak RSS {_cell(row, 'peak_rss', 0, 2**-20)} MiB, "
            f"cached {100 * row['page_cache_before']:.0f}%")


def thin(samples: list, limit: int = 300) -> list:
    """At most about ``limit`` evenly spaced samples, the last always kept."""
    if len(samples) <= limit:
        return samples
    kept = samples[::-(-len(samples) // limit)]
    if kept[-1] is not samples[-1]:
        kept.append(samples[-1])
    return kept


def finish(rows: list[dict], report: dict) -> None:
    """Flag and exclude runs whose tokens differ from the baseline's (of the same kernels);
    move traces."""
    baseline = Config.parse(report.get("baseline", BASELINE)).strategy
    reference: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        cfg = Config.parse(r["strategy"])
        if "error" not in r and (cfg.strategy, cfg.kv) == (baseline, "default"):
            reference.setdefault((r["checkpoint"], cfg.kernels), r["tokens"])
    for (ckpt, kernels), tokens in reference.items():
        plain = reference.get((ckpt, "mlx"))
        if kernels == "auto" and plain is not None:
            report.setdefault("kernels_vs_mlx", {})[ckpt] = _first_diff(tokens, plain)
    traces = []
    for i, r in enumerate(rows):
        if "error" in r:
            continue
        ref = reference.get((r["checkpoint"], Config.parse(r["strategy"]).kernels))
        tokens = r.pop("tokens")
        r["identical"] = None if ref is None else tokens == ref
        if r["identical"] is False:
            r["excluded"] = True
            r["first_diff"] = _first_diff(tokens, ref)
        traces.append({"row": i, "checkpoint": r["checkpoint"], "cache": r["cache"],
                       "strategy": r["strategy"], "run": r["run"], "tokens": tokens,
                       "text": r.pop("text"), "samples": thin(r.pop("samples"))})
    report["traces"] = traces
    report["reference_text"] = {t["checkpoint"]: t["text"] for t in traces
                                if t["strategy"] == report.get("baseline", BASELINE)}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """The first token where ``a`` and ``b`` differ (None when they are equal)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def sort_key(label: str) -> tuple:
    """Table order: default KV first, then strategy, then falling residency."""
    cfg = Config.parse(label)
    frac = cfg.resident_fraction
    return (cfg.kernels != "mlx", cfg.kv != "default", STRATEGIES.index(cfg.strategy),
            -(frac if frac is not None else -1.0), cfg.resident or "")


def _cell(s: dict, key: str, digits: int, scale: float = 1.0, spread: bool = True) -> str:
    if s.get(key) is None:
        return "-"
    text = f"{s[key] * scale:.{digits}f}"
    if spread and s.get(key + "_min") is not None and s[key + "_min"] != s[key + "_max"]:
        text += f" ({s[key + '_min'] * scale:.{digits}f}-{s[key + '_max'] * scale:.{digits}f})"
    return text


def format_table(report: dict) -> str:
    """The comparison as a plain-text table of medians, ranges and ratios."""
    widest = max([17, *(len(s["strategy"]) for s in report["summary"])])
    cols = [("config", widest), ("load s", 21), ("TTFT s", 17), ("1st token s", 17),
            ("1st x", 5), ("prompt tok/s", 17), ("decode tok/s", 17), ("x base", 6),
            ("peak RSS", 8), ("anon", 6), ("MLX pk", 6), ("read", 6), ("same out", 8)]
    experts = any(s.get("expert_hit_rate") is not None for s in report["summary"])
    if experts:
        cols.insert(-1, ("hit", 5))
    lines = []
    rows, base = report["runs"], report.get("baseline", BASELINE)
    for ckpt, cache in dict.fromkeys((s["checkpoint"], s["cache"]) for s in report["summary"]):
        block = sorted((s for s in report["summary"] if (s["checkpoint"], s["cache"])
                        == (ckpt, cache)), key=lambda s: sort_key(s["strategy"]))
        case = next((c for c in report["cases"] if c["label"] == ckpt), None)
        head = f"{ckpt} [{cache} page cache]"
        if case:
            head += f"  {case['bytes'] / 2**20:.0f} MiB of weights"
            head += f", {case['tensors']} tensors" if case.get("tensors") else ""
        head += f"; memory in MiB; {report['runs_per_case']} runs per config"
        lines += ["", head, "  ".join(f"{n:<{w}}" for n, w in cols)]
        for s in block:
            mine = [r for r in rows if (r["checkpoint"], r["cache"], r["strategy"])
                    == (ckpt, cache, s["strategy"]) and "error" not in r]
            same = sum(1 for r in mine if r.get("identical"))
            known = sum(1 for r in mine if r.get("identical") is not None)
            x = s.get(f"decode_tps_x_{base}")
            x1 = s.get(f"first_token_s_x_{base}")
            cells = [s["strategy"], _cell(s, "load_s", 3), _cell(s, "ttft_s", 2),
                     _cell(s, "first_token_s", 2), f"{x1:.2f}" if x1 else "-",
                     _cell(s, "prompt_tps", 1), _cell(s, "decode_tps", 2),
                     f"{x:.2f}" if x else "-",
                     *(_cell(s, k, 0, 2**-20, False)
                       for k in ("peak_rss", "peak_anon", "mx_peak", "read_bytes")),
                     f"{same}/{known}" if known else "n/a"]
            if experts:
                cells.insert(-1, _cell(s, "expert_hit_rate", 2, 1.0, False))
            lines.append("  ".join(f"{v:<{w}}" for v, (_, w) in zip(cells, cols)).rstrip())
    return "\n".join(lines).lstrip("\n")


def render(report: dict) -> str:
    """Table, flagged runs, failures and the baseline's output as text."""
    text = format_table(report)
    base = report.get("baseline", BASELINE)
    for ckpt, diff in report.get("kernels_vs_mlx", {}).items():
        text += (f"\n\n{BASELINE}+kernels on {ckpt}: "
                 + ("the same tokens as " + BASELINE if diff is None else
                    f"tokens first differ from {BASELINE}'s at token {diff}")
                 + " (pyloader's kernels sum in float32, in another order; docs/kernels.md)")
    flagged = [r for r in report["runs"] if r.get("identical") is False]
    if flagged:
        text += (f"\n\n{len(flagged)} run(s) produced tokens different from {base} "
                 "with the same kernels (excluded from the medians):")
        for r in flagged:
            text += f"\n  {r['strategy']} {r['cache']} run {r['run'] + 1}: first differs at " \
                    f"token {r['first_diff']}"
    missing = [s for s in report["strategies"]
               if not any(x["strategy"] == s for x in report["summary"])]
    errors = [r for r in report["runs"] if "error" in r]
    if errors:
        text += f"\n\n{len(errors)} run(s) failed; first error:\n{errors[0]['error']}"
    elif missing:
        text += f"\n\nno valid run of: {', '.join(missing)}"
    if not any(r["strategy"] == base and "error" not in r for r in report["runs"]):
        text += f"\n\nno {base} baseline run: outputs were not checked"
    for ckpt, ref in (report.get("reference_text") or {}).items():
        if ref is not None:
            text += f"\n\n{base} output on {ckpt}: {ref!r}"
    o = report.get("options", {})
    lens = {r.get("prompt_tokens") for r in report["runs"] if "error" not in r} - {None}
    prompt = "/".join(map(str, sorted(lens))) or "?"
    text += (f"\n\nload s: until the model can run; TTFT: from then to the first token "
             f"(prompt of {prompt} tokens); 1st token s: from the start of the "
             "load to the first token (load + TTFT, the time a user waits); 1st x: that "
             f"time / {base}'s (< 1 is sooner); decode: {o.get('max_tokens', '?')} "
             f"greedy tokens; x base: decode tok/s / {base}'s; peak RSS = VmHWM; anon = "
             "peak sampled RssAnon; MLX pk = mx.get_peak_memory(); read = bytes read from "
             f"storage (/proc/self/io); same out: runs whose tokens equal {base}'s"
             + (" (mlx-lm+kernels' for the +kernels rows)" if base == BASELINE else "")
             + ("; hit: the expert caches' hit rate (prompt and decode)"
                if any(s.get("expert_hit_rate") is not None for s in report["summary"])
                else ""))
    return text


WORKLOAD = Workload(name="generate", measure=measure_generation, metrics=METRICS, baseline=BASELINE,
                    order=tuple(STRATEGIES), flatten=flatten, progress=progress,
                    finish=finish, targets=lambda summary: [], render=render)
#: The same for a GGUF file, against :data:`GGUF_BASELINE`.
GGUF_WORKLOAD = dataclasses.replace(WORKLOAD, baseline=GGUF_BASELINE)


def median_trace(report: dict, checkpoint: str, cache: str, strategy: str) -> dict | None:
    """The memory trace of the kept run whose total time is the median of its config."""
    rows = report["runs"]
    kept = [t for t in report.get("traces", [])
            if (t["checkpoint"], t["cache"], t["strategy"]) == (checkpoint, cache, strategy)
            and not rows[t["row"]].get("excluded")]
    if not kept:
        return None
    kept.sort(key=lambda t: rows[t["row"]]["total_s"])
    return kept[(len(kept) - 1) // 2]


__all__ = [
    "BASELINE",
    "DEFAULT_RESIDENT",
    "DEFAULT_STRATEGIES",
    "GGUF_BASELINE",
    "GGUF_WORKLOAD",
    "KERNEL_MODES",
    "KV_MODES",
    "METRICS",
    "STRATEGIES",
    "WORKLOAD",
    "Config",
    "configurations",
    "finish",
    "flatten",
    "format_table",
    "measure_generation",
    "median_trace",
    "render",
    "sort_key",
    "start_child",
    "thin",
]
