"""The ``generate`` workload: one load + generation. See docs/compare.md."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import mlx.core as mx

from ..._util.host import process_memory
from ..._util.sizes import parse_amount
from ...errors import UnsupportedError
from ...io.checkpoint import Checkpoint
from ...io.gguf_header import is_gguf
from ...io.gguf_source import GGUFSource
from ...io.strategies import load
from ...kernels import install as install_kernels
from ...loading import has_tokenizer, load_model
from ...streaming import Residency, StreamOptions, stats
from ..protocol import read_bytes

STRATEGIES = ("mlx-lm", "pread", "mmap", "mmap-prefetch", "stream", "stream-experts",
              "pread-overlap", "mmap-overlap")
KV_MODES = ("default", "prealloc")
#: ``--kernels``: MLX's own ops, or pyloader's CPU kernels (:mod:`pyloader.kernels`).
KERNEL_MODES = ("mlx", "auto")

#: The fixed English prompt, so runs on every machine are alike.
DEFAULT_PROMPT = (
    "In the fifteenth century, Johannes Gutenberg combined movable metal type, oil-based "
    "ink and a screw press. Within a few decades, printing"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="mlx-lm model directory or GGUF file")
    p.add_argument("--strategy", choices=STRATEGIES, default="mlx-lm")
    p.add_argument("--resident", default="1.0",
                   help="stream: layers kept resident (count, fraction or byte budget); "
                        "stream-experts: the expert cache (fraction, slots or byte budget)")
    p.add_argument("--kv", choices=KV_MODES, default="default")
    p.add_argument("--kernels", choices=KERNEL_MODES, default="mlx")
    p.add_argument("--prompt", default=None, help="prompt text (default: a fixed paragraph)")
    p.add_argument("--prompt-tokens", type=int, default=96,
                   help="prompt length when the model has no tokenizer (token ids 1..N)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sample-ms", type=float, default=5.0)


class MemorySampler:
    """A thread sampling this process's memory every ``interval`` seconds."""

    def __init__(self, interval: float):
        self.interval = interval
        self.samples: list[tuple[float, int | None, int | None, int]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="pyloader-memory-sampler",
                                        daemon=True)

    def start(self) -> MemorySampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def sample(self) -> None:
        s = process_memory()
        self.samples.append((time.perf_counter() - self._t0, s.rss, s.rss_anon,
                             mx.get_active_memory()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> list[tuple[float, int | None, int | None, int]]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.samples


def _load_weights(args, gguf: bool):
    """The model, loaded with ``args.strategy`` (a ``gguf`` file: ``mmap`` is
    :func:`load_model`'s mapping in place; mlx-lm does not read it)."""
    if gguf and args.strategy == "mlx-lm":
        raise UnsupportedError(f"{args.model}: mlx-lm does not read GGUF files")
    if args.strategy in ("mlx-lm", "mmap") and not gguf:
        from mlx_lm.utils import load_model as mlx_lm_load_model

        if args.strategy == "mlx-lm":
            return mlx_lm_load_model(Path(args.model))[0]
        model, _ = mlx_lm_load_model(Path(args.model), lazy=True)  # structure; nothing read
        weights = load(args.model, "mmap")
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        model.load_weights(list(weights.items()), strict=True)
        return model
    if args.strategy == "stream-experts":
        return load_model(args.model, tokenizer=False, kernels=args.kernels,
                          options=StreamOptions(experts=parse_amount(args.resident)))[0]
    if gguf and args.strategy == "mmap":
        return load_model(args.model, tokenizer=False, kernels=args.kernels)[0]
    resident = Residency.from_text(args.resident) if args.strategy == "stream" else 1.0
    source = "pread" if args.strategy.startswith("pread") else "mmap"
    return load_model(
        args.model, resident=resident, tokenizer=False, kernels=args.kernels,
        options=StreamOptions(
            strategy=source, prefetch=1, overlap=args.strategy.endswith("-overlap")))[0]


def prepare(args) -> tuple[dict, dict]:
    gguf = GGUFSource.open(args.model) if is_gguf(args.model) else None
    ckpt = gguf.checkpoint if gguf else Checkpoint(args.model)
    files, total_bytes = list(ckpt.files), ckpt.total_nbytes
    del ckpt
    prompt_text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    tokenizer = None
    if gguf:
        tokenizer = gguf.tokenizer()
    elif has_tokenizer(args.model):
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(args.model))
    prompt = (tokenizer.encode(prompt_text) if tokenizer is not None
              else [1 + i % 200 for i in range(args.prompt_tokens)])
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))  # MLX start-up, untimed
    mx.reset_peak_memory()
    state = {"tokenizer": tokenizer, "prompt": prompt, "bytes": total_bytes,
             "gguf": gguf is not None, "io0": read_bytes()}
    return {"files": files, "prompt_tokens": len(prompt)}, state


def run(args, state: dict) -> dict:
    from mlx_lm.generate import generate_step

    prompt, tokenizer, io0 = state["prompt"], state["tokenizer"], state["io0"]
    sampler = MemorySampler(args.sample_ms / 1000).start()
    t0 = time.perf_counter()
    model = state["model"] = _load_weights(args, state["gguf"])
    install_kernels(model, args.kernels)  # part of the load: computing with args.kernels
    t_load = time.perf_counter()
    cache = None
    if args.kv == "prealloc":
        from ...kv import make_kv_cache  # mlx-lm, which the parent need not have

        cache = make_kv_cache(model, max_context=len(prompt) + args.max_tokens)
    steps = generate_step(mx.array(prompt), model, max_tokens=args.max_tokens,
                          prompt_cache=cache)
    tokens = [int(next(steps)[0])]
    t_first = time.perf_counter()
    tokens += [int(t) for t, _ in steps]
    t_end = time.perf_counter()
    samples = sampler.stop()
    read = read_bytes().since(io0)
    st = process_memory()
    anon = [s[2] for s in samples if s[2] is not None]
    n_decode = len(tokens) - 1
    result = {
        "strategy": args.strategy,
        "resident": args.resident if args.strategy.startswith("stream") else None,
        "kv": args.kv,
        "bytes": state["bytes"],
        "prompt_tokens": len(prompt),
        "generated_tokens": len(tokens),
        "load_s": t_load - t0,
        "ttft_s": t_first - t_load,
        "first_token_s": t_first - t0,
        "prompt_tps": len(prompt) / (t_first - t_load),
        "decode_s": t_end - t_first,
        "decode_tps": n_decode / (t_end - t_first) if n_decode else None,
        "total_s": t_end - t0,
        "peak_rss": st.peak_rss,
        "rss_anon": st.rss_anon,
        "rss_file": st.rss_file,
        "peak_anon": max(anon) if anon else None,
        "mx_peak": mx.get_peak_memory(),
        "read_bytes": read["read_bytes"],
        "rchar": read["rchar"],
        "tokens": tokens,
        "text": tokenizer.decode(tokens) if tokenizer is not None else None,
        "samples": samples,
    }
    if args.strategy not in ("mlx-lm", "mmap") or state["gguf"]:  # by load_model
        st = stats(model)
        result["stream"] = {k: st[k] for k in (
            "streamed_units", "streamed_bytes_per_pass", "resident_bytes", "passes",
            "bytes_read", "wait_s", "compute_s", "overlap_efficiency")}
        if "experts" in st:
            result["experts"] = {k: st["experts"]["total"][k] for k in (
                "hit_rate", "bytes_read", "bank_bytes", "hits", "misses")}
    return result
