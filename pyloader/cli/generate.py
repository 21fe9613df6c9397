"""``pyloader generate``: ``mlx_lm.generate``'s command line over pyloader's loading."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import textwrap
from pathlib import Path

from ..errors import PlotsUnavailable
from ..streaming.options import StreamOptions
from ..streaming.timeline import summary_line
from ..streaming.trace import require_pyplot, trace
from .common import (
    add_kernels_argument,
    add_residency_arguments,
    default_model,
    fail,
    mlx_lm_missing,
    resident_of,
)

#: mlx_lm.generate's defaults (mlx_lm/generate.py, 0.32.2).
DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_XTC_PROBABILITY = 0.0
DEFAULT_XTC_THRESHOLD = 0.1
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
DEFAULT_PREFILL_STEP_SIZE = 2048
DEFAULT_NUM_DRAFT_TOKENS = 3

#: mlx_lm.generate's flags that pyloader generate does not take, and why.
NOT_SUPPORTED = (
    ("--image", ("vision models' image input (mlx-lm's processor and embed_inputs) is not "
                 "wired into pyloader's generation")),
    ("--prompt-cache-file", ("a saved prompt cache names the model and tokenizer settings "
                             "it was made with and the prompt is then templated as a "
                             "suffix; not wired in (pyloader.load_prompt_cache reads such "
                             "files from Python)")),
    ("--quantize-activations, -qa", ("swaps nvfp4/mxfp8 layers for activation-quantized "
                                     "ones (QQLinear), untested on weights pyloader "
                                     "streams")),
)


def _epilog() -> str:
    lines = ["mlx_lm.generate flags not supported here (use mlx_lm.generate for them):"]
    for flag, why in NOT_SUPPORTED:
        lines.append(textwrap.fill(f"{flag}: {why}", 79, initial_indent="  ",
                                   subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


def _str2bool(text: str) -> bool:
    """``--verbose``'s value as mlx-lm reads it: anything but false/f is true."""
    return text.lower() not in ("false", "f")


def add_parser(sub) -> None:
    """``pyloader generate``."""
    c = sub.add_parser(
        "generate", help="generate text like mlx_lm.generate, the model loaded (or "
                         "streamed) by pyloader",
        description=textwrap.fill(
                    "mlx_lm.generate's command line (its flags, defaults and output: the "
                    "text, then prompt and generation tokens-per-sec and peak memory) with "
                    "MODEL (default: the default model) loaded by pyloader, some layers "
                    "streamed if asked; then one line of pyloader's own statistics on "
                    "stderr. Ctrl-C stops generating and prints the statistics so far.", 79),
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="mlx-lm model directory or Hugging Face repo id in the local cache "
                        "(or --model; default: the default model)")
    c.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (mlx_lm.generate's spelling)")
    c.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help="message to the model ('-' reads it from stdin; default %(default)r)")
    c.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="maximum number of tokens to generate (default %(default)s)")
    c.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    c.add_argument("--prefill-response", default=None,
                   help="the start of the assistant's reply, continued by the model")
    c.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt without the tokenizer's chat template (which is "
                        "applied by default, as mlx_lm.generate does)")
    c.add_argument("--chat-template-config", default=None, metavar="JSON",
                   help="extra keyword arguments for apply_chat_template, as a JSON object")
    c.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default now
    c.add_argument("--temp", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    c.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (default 1.0)")
    c.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    c.add_argument("--top-k", type=int, default=0, help="sampling top-k")
    c.add_argument("--min-tokens-to-keep", type=int, default=1,
                   help="minimum tokens to keep for min-p sampling (default 1)")
    c.add_argument("--xtc-probability", type=float, default=DEFAULT_XTC_PROBABILITY,
                   help="probability of XTC sampling for each next token (default "
                        "%(default)s)")
    c.add_argument("--xtc-threshold", type=float, default=DEFAULT_XTC_THRESHOLD,
                   help="probability threshold of the candidates XTC removes (default "
                        "%(default)s)")
    c.add_argument("--seed", type=int, default=None, help="PRNG seed")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="trust remote code for the tokenizer (and a config's model_file)")
    c.add_argument("--adapter-path", default=None, metavar="PATH",
                   help="a LoRA/DoRA adapter directory applied on top of the model "
                        "(streamed layers included)")
    c.add_argument("--use-default-chat-template", action="store_true",
                   help="accepted as mlx_lm.generate 0.32.2 accepts it: it changes nothing "
                        "there either (the tokenizer's template is used)")
    c.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="keep at most N tokens in the KV cache (mlx-lm's rotating cache)")
    c.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP_SIZE,
                   metavar="N", help="prompt tokens processed at a time (default "
                                     "%(default)s)")
    c.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache to this many bits (default: not quantized)")
    c.add_argument("--kv-group-size", type=int, default=DEFAULT_KV_GROUP_SIZE,
                   help="group size of the KV cache quantization (default %(default)s)")
    c.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                   metavar="N", help="with --kv-bits: quantize the KV cache from step N on "
                                     "(default %(default)s)")
    c.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a model for speculative decoding (loaded by pyloader, fully "
                        "resident; its tokenizer must match)")
    c.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                   metavar="N", help="tokens drafted per step with --draft-model (default "
                                     "%(default)s)")
    c.add_argument("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
                   help="more tokens that stop generation")
    # (dest: `pyloader -v`'s count is args.verbose)
    c.add_argument("--verbose", dest="show_all", type=_str2bool, default=True, metavar="BOOL",
                   help="print the text as it comes and the statistics (True), or only the "
                        "text once done (False)")
    add_residency_arguments(c)
    add_kernels_argument(c)
    c.add_argument("--kv-prealloc", action="store_true",
                   help="use pyloader's preallocated KV cache")
    c.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write a timeline of every streamed unit (read issued and done, "
                        "wait, compute, release, eviction) and of the reader threads as "
                        "Chrome trace-event JSON (open it in ui.perfetto.dev or "
                        "chrome://tracing), plus a PNG summary")
    c.add_argument("--trace-png", default=None, metavar="FILE.png",
                   help="where the trace's PNG summary goes (default: beside --trace, "
                        "with .png; needs matplotlib)")
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader generate``."""
    try:
        return _generate(args)
    except KeyboardInterrupt:  # while loading: nothing generated yet
        print("\npyloader generate: interrupted", file=sys.stderr)
        return 130


def _generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        return fail("generate", "--max-tokens must be at least 1")
    if args.model is not None and args.model_option is not None and \
            args.model != args.model_option:
        return fail("generate", f"two models given: {args.model} and --model "
                                f"{args.model_option}")
    model_arg = args.model if args.model is not None else args.model_option
    template_kwargs = {}
    if args.chat_template_config is not None:
        try:
            template_kwargs = json.loads(args.chat_template_config)
        except json.JSONDecodeError as exc:
            return fail("generate", f"--chat-template-config is not JSON: {exc}")
        if not isinstance(template_kwargs, dict):
            return fail("generate", "--chat-template-config must be a JSON object")
    if (status := mlx_lm_missing("generate")) is not None:
        return status
    if args.trace_png is not None and args.trace is None:
        return fail("generate", "--trace-png needs --trace FILE.json")
    png = args.trace_png
    for out in (args.trace, png):
        if out is not None and not Path(out).resolve().parent.is_dir():
            return fail("generate", f"{out}: no such directory")
    if args.trace is not None:
        try:
            require_pyplot()
            if png is None:
                png = str(Path(args.trace).with_suffix(".png"))
        except PlotsUnavailable as exc:
            if png is not None:
                return fail("generate", str(exc))
            print(f"pyloader generate: no PNG summary of the trace: {exc}", file=sys.stderr)
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from ..generation import generate_text, load_for_generation, prompt_tokens  # mlx-lm

    if args.kv_prealloc and (args.max_kv_size is not None or args.kv_bits is not None):
        return fail("generate", "--kv-prealloc takes neither --max-kv-size nor --kv-bits "
                                "(the preallocated cache is neither rotating nor quantized "
                                "on the way)")
    try:
        resident = resident_of(args)
    except ValueError as exc:
        return fail("generate", str(exc))
    if args.seed is not None:
        mx.random.seed(args.seed)  # where mlx_lm.generate seeds: before loading
    try:
        if model_arg is None:
            model_arg = default_model()
        model, tokenizer, load_s = load_for_generation(
            model_arg, resident=resident, options=StreamOptions(strategy=args.strategy),
            adapter_path=args.adapter_path, trust_remote_code=args.trust_remote_code,
            tokenizer_config={"trust_remote_code": args.trust_remote_code},
            kernels=args.kernels)
        draft_model = None
        if args.draft_model is not None:  # as mlx_lm.generate loads it: whole
            draft_model, draft_tokenizer, _ = load_for_generation(
                args.draft_model, options=StreamOptions(strategy=args.strategy),
                kernels=args.kernels)
            if draft_tokenizer.vocab_size != tokenizer.vocab_size:
                return fail("generate", "the draft model's tokenizer does not match the "
                                        "model's (vocabulary sizes differ)", 1)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        return fail("generate", f"{type(exc).__name__}: {exc}", 1)
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    ids = prompt_tokens(tokenizer, prompt, chat_template=not args.ignore_chat_template,
                        system_prompt=args.system_prompt,
                        prefill_response=args.prefill_response,
                        template_kwargs=template_kwargs)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep,
                           top_k=args.top_k, xtc_probability=args.xtc_probability,
                           xtc_threshold=args.xtc_threshold,
                           xtc_special_tokens=tokenizer.encode("\n")
                           + list(tokenizer.eos_token_ids))

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    recording = (trace(model, args.trace, png=png) if args.trace is not None
                 else contextlib.nullcontext())
    if args.show_all:
        print("=" * 10, flush=True)
    with recording as timeline:
        text, stats = generate_text(model, tokenizer, ids, max_tokens=args.max_tokens,
                                    preallocate_kv=args.kv_prealloc, sampler=sampler,
                                    on_text=show if args.show_all else None,
                                    # mlx_lm.generate's options, passed as it passes them
                                    max_kv_size=args.max_kv_size,
                                    prefill_step_size=args.prefill_step_size,
                                    kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                                    quantized_kv_start=args.quantized_kv_start,
                                    draft_model=draft_model,
                                    num_draft_tokens=args.num_draft_tokens)
    stats.load_s = load_s
    interrupted = stats.finish_reason == "interrupted"
    if not args.show_all:
        print(text)
    else:
        print()
        print("=" * 10)
        if interrupted:
            print("[interrupted]")
        if not text:
            print("No text generated for this prompt")
        else:
            print(stats.mlx_lm_lines(), flush=True)
    print(f"pyloader: {stats.line()}", file=sys.stderr)
    if timeline is not None:
        written = args.trace + (f" and {png}" if png is not None else "")
        print(f"trace: {written}: {summary_line(timeline.summary())}", file=sys.stderr)
    return 130 if interrupted else 0
