"""Everyday text generation with a chosen loading strategy: ``pyloader generate``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ._util.fs import is_regular_file
from ._util.hooks import handle_of
from ._util.host import peak_rss
from .io.gguf_header import is_gguf
from .io.hub import resolve
from .kv import make_kv_cache
from .loading import load_model


@dataclass
class GenerationStats:
    """What one generation cost."""

    load_s: float = 0.0
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generated_tokens: int = 0
    decode_tps: float = 0.0
    peak_rss: int = 0           # VmHWM, bytes
    mx_peak: int = 0            # mx.get_peak_memory(), bytes
    resident_bytes: int = 0     # weights kept in memory
    streamed_units: int = 0
    overlap_efficiency: float = 1.0
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)

    def mlx_lm_lines(self) -> str:
        """The statistics ``mlx_lm.generate --verbose`` prints, in its words."""
        return (f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec\n"
                f"Generation: {self.generated_tokens} tokens, {self.decode_tps:.3f} "
                f"tokens-per-sec\nPeak memory: {self.mx_peak / 1e9:.3f} GB")

    def line(self) -> str:
        """The one-line summary of everything (``pyloader generate``'s last line)."""
        text = (f"load {self.load_s:.2f} s | prompt {self.prompt_tokens} tokens, "
                f"{self.prompt_tps:.1f} tok/s | generated {self.generated_tokens} tokens, "
                f"{self.decode_tps:.1f} tok/s | peak RSS {self.peak_rss / 2**20:.0f} MiB, "
                f"MLX peak {self.mx_peak / 2**20:.0f} MiB | resident weights "
                f"{self.resident_bytes / 2**20:.0f} MiB")
        if self.streamed_units:
            text += (f", {self.streamed_units} streamed units, overlap "
                     f"{100 * self.overlap_efficiency:.0f}%")
        return text


def load_for_generation(path: str | os.PathLike[str], **load_kwargs):
    """``(model, tokenizer, load seconds)`` from :func:`pyloader.load_model` (``load_kwargs``).

    Raises:
        FileNotFoundError: ``path`` is neither a GGUF file nor a directory with a
            ``config.json``, or has no tokenizer.
    """
    p = resolve(path)
    if not is_gguf(p) and not is_regular_file(p / "config.json", "config.json"):
        raise FileNotFoundError(
            f"{p} is not an mlx-lm model directory (no config.json) nor a GGUF file; give "
            "a directory written by mlx_lm.convert, or a GGUF file")
    t0 = time.perf_counter()
    model, tokenizer = load_model(p, **load_kwargs)
    load_s = time.perf_counter() - t0
    if tokenizer is None:
        raise FileNotFoundError(
            f"{p} has no tokenizer (tokenizer.json / tokenizer_config.json): generation "
            "needs one; copy the tokenizer files of the original model into it")
    return model, tokenizer, load_s


def prompt_tokens(tokenizer, prompt: str, *, chat_template: bool = True,
                  system_prompt: str | None = None, prefill_response: str | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids as ``mlx_lm.generate``'s command line makes them."""
    use_template = chat_template and bool(getattr(tokenizer, "has_chat_template",
                                                  getattr(tokenizer, "chat_template", None)))
    if use_template:
        messages = [] if system_prompt is None else [{"role": "system",
                                                      "content": system_prompt}]
        messages.append({"role": "user", "content": prompt})
        if prefill_response is not None:
            messages.append({"role": "assistant", "content": prefill_response})
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=prefill_response is not None,
            add_generation_prompt=prefill_response is None, **(template_kwargs or {}))
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


def generate_text(model, tokenizer, prompt: str | list[int], *, max_tokens: int = 100,
                  chat: bool = False, preallocate_kv: bool = False,
                  on_text: Callable[[str], None] | None = None,
                  **generate_kwargs) -> tuple[str, GenerationStats]:
    """Up to ``max_tokens`` tokens after ``prompt`` (greedy unless a ``sampler`` is given).

    Args:
        prompt: Text (chat-templated when ``chat``: :func:`prompt_tokens`) or token ids.
        preallocate_kv: Use :func:`pyloader.make_kv_cache` instead of mlx-lm's growing cache.
        on_text: Called with each new piece of text as soon as it is decoded.
        generate_kwargs: Passed on to ``mlx_lm.stream_generate`` as they are.

    Returns:
        The generated text and its :class:`GenerationStats` (``load_s`` left at 0).
    """
    from mlx_lm import stream_generate

    prompt_ids = (list(prompt) if not isinstance(prompt, str)
                  else prompt_tokens(tokenizer, prompt, chat_template=chat))
    kwargs = dict(generate_kwargs)
    if preallocate_kv and (kwargs.get("max_kv_size") is not None
                           or kwargs.get("kv_bits") is not None):
        raise ValueError("preallocate_kv takes neither max_kv_size (a rotating cache) nor "
                         "kv_bits (a cache quantized on the way): pass one or the other")
    if preallocate_kv:
        kwargs["prompt_cache"] = make_kv_cache(model, max_context=len(prompt_ids) + max_tokens)
    pieces = []
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    last = None
    try:
        for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens,
                                 **kwargs):
            pieces.append(r.text)
            if on_text and r.text:
                on_text(r.text)
            last = r
    except KeyboardInterrupt:
        stats.finish_reason = "interrupted"
    if last is not None:
        stats.prompt_tps = last.prompt_tps
        stats.generated_tokens = last.generation_tokens
        stats.decode_tps = last.generation_tps
        if stats.finish_reason is None:
            stats.finish_reason = last.finish_reason
    stats.peak_rss = peak_rss()
    stats.mx_peak = mx.get_peak_memory()
    h = handle_of(model)
    if h is not None and h.controller is not None:
        st = h.controller.stats()
        stats.resident_bytes = st["resident_bytes"]
        stats.streamed_units = st["streamed_units"]
        stats.overlap_efficiency = st["overlap_efficiency"]
    return "".join(pieces), stats


