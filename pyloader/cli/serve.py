"""``pyloader serve``: mlx-lm's HTTP server over pyloader. See docs/serving.md."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from .._util.fs import is_regular_file
from .._util.sizes import parse_amount
from ..io.gguf_header import is_gguf
from ..serving.requests import MAX_REQUEST_BYTES
from ..serving.settings import DEFAULT_KV_CONTEXT, SERVER_DEFAULTS, ServeOptions
from ..streaming import stats
from ..streaming.depth import prefetch_arg
from ..streaming.options import StreamOptions
from .common import (
    add_expert_arguments,
    add_kernels_argument,
    add_residency_arguments,
    default_model,
    fail,
    mlx_lm_missing,
    model_location,
    parse_size,
    resident_of,
)

#: mlx-lm server settings passed through: (flag, argparse keywords); defaults are mlx-lm's.
PASSED_THROUGH = [
    ("--max-tokens", {"type": int, "metavar": "N",
                      "help": "default maximum number of tokens per request"}),
    ("--temp", {"type": float, "help": "default sampling temperature (0: greedy)"}),
    ("--top-p", {"type": float, "help": "default nucleus sampling top-p"}),
    ("--top-k", {"type": int, "help": "default top-k sampling (0 disables it)"}),
    ("--min-p", {"type": float, "help": "default min-p sampling (0 disables it)"}),
    ("--chat-template", {"metavar": "TEMPLATE",
                         "help": "a chat template for the tokenizer"}),
    ("--use-default-chat-template", {"action": "store_true",
                                     "help": "use the tokenizer's default chat template when "
                                             "it has none"}),
    ("--chat-template-args", {"type": json.loads, "metavar": "JSON",
                              "help": "keyword arguments of apply_chat_template, e.g. "
                                      "'{\"enable_thinking\": false}'"}),
    ("--adapter-path", {"metavar": "PATH",
                        "help": "a LoRA adapter directory (applied on streamed layers too)"}),
    ("--draft-model", {"metavar": "PATH",
                       "help": "a model for speculative decoding (loaded by pyloader, fully "
                               "resident; requests are then served one at a time)"}),
    ("--num-draft-tokens", {"type": int, "metavar": "N",
                            "help": "tokens drafted per step with --draft-model"}),
    ("--trust-remote-code", {"action": "store_true",
                             "help": "run a model's or tokenizer's own Python code"}),
    ("--decode-concurrency", {"type": int, "metavar": "N",
                              "help": "requests decoded together in one batch"}),
    ("--prompt-concurrency", {"type": int, "metavar": "N",
                              "help": "prompts processed together in one batch"}),
    ("--prefill-step-size", {"type": int, "metavar": "N",
                             "help": "prompt tokens per prefill step"}),
    ("--prompt-cache-size", {"type": int, "metavar": "N",
                             "help": "KV caches of earlier requests kept for reuse"}),
    ("--prompt-cache-bytes", {"type": parse_size, "metavar": "SIZE",
                              "help": "memory for those caches, e.g. 2GB (default: no limit)"}),
    ("--kv-bits", {"type": int, "metavar": "BITS",
                   "help": "quantize the KV cache to 4 or 8 bits after --quantized-kv-start "
                           "tokens (requests are then served one at a time)"}),
    ("--kv-group-size", {"type": int, "metavar": "N", "help": "with --kv-bits"}),
    ("--quantized-kv-start", {"type": int, "metavar": "TOKENS", "help": "with --kv-bits"}),
    ("--allowed-origins", {"type": lambda text: text.split(","), "metavar": "ORIGINS",
                           "help": "CORS origins, comma-separated"}),
]


def add_parser(sub) -> None:
    """``pyloader serve``."""
    c = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (mlx-lm's) over a model loaded by pyloader",
        description="Serve MODEL (default: the default model) with mlx-lm's HTTP server "
                    "(POST /v1/completions, /v1/chat/completions, with \"stream\": true; "
                    "GET /health, /v1/models), the model loaded or streamed by pyloader. "
                    "Requests are checked before they reach the model and the model is "
                    "pinned, but there is no authentication: listen on loopback or a "
                    "trusted network only.",
        epilog="Details: docs/serving.md.")
    c.add_argument("--model", default=None, metavar="MODEL",
                   help="mlx-lm model directory or Hugging Face repo id (default: the "
                        "default model)")
    c.add_argument("--host", default=SERVER_DEFAULTS["host"],
                   help=f"address to listen on (default {SERVER_DEFAULTS['host']})")
    c.add_argument("--port", type=int, default=SERVER_DEFAULTS["port"],
                   help=f"port to listen on, 0 for any free one (default "
                        f"{SERVER_DEFAULTS['port']})")

    s = c.add_argument_group("what clients may do (docs/serving.md, \"Running it safely\")")
    s.add_argument("--allow-client-models", action="store_true",
                   help="let a request's \"model\" name another model directory or repo "
                        "id, which the server then loads in place of MODEL (mlx-lm's "
                        "behaviour; refused with --trust-remote-code). Default: MODEL only")
    s.add_argument("--max-request-bytes", type=parse_size, default=MAX_REQUEST_BYTES,
                   metavar="SIZE",
                   help=f"largest request body accepted (default {MAX_REQUEST_BYTES >> 20}MiB)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on Ctrl-C or SIGTERM, seconds the requests in flight get to "
                        "finish before the server stops (default 30)")

    g = c.add_argument_group("how pyloader loads the model")
    add_residency_arguments(g)
    add_kernels_argument(g)
    g.add_argument("--prefetch", type=prefetch_arg, default="auto", metavar="N",
                   help="streamed units read ahead of the one computing (0: none; "
                        "default auto: chosen from the units' sizes and the memory)")
    add_expert_arguments(g)
    g.add_argument("--expert-policy", choices=("lru", "lfu"), default="lru",
                   help="with --experts: the caches' eviction policy (default lru)")
    g.add_argument("--kv-prealloc", type=int, nargs="?", const=DEFAULT_KV_CONTEXT,
                   default=None, metavar="TOKENS",
                   help="give every request pyloader's preallocated KV cache with room for "
                        f"TOKENS tokens (default {DEFAULT_KV_CONTEXT}; longer contexts fall "
                        "back to a growing cache with a warning). mlx-lm's server batches "
                        "requests by merging their caches into its own growing batch cache, "
                        "so with this flag requests are served one at a time, and each cache "
                        "kept for reuse (--prompt-cache-size) holds a whole arena")

    m = c.add_argument_group("mlx-lm server settings (passed through; defaults are mlx-lm's)")
    for flag, kwargs in PASSED_THROUGH:
        default = SERVER_DEFAULTS[_dest(flag)]
        if kwargs.get("action") != "store_true":
            shown = f" (default {_shown(default)})" if default not in (None, "") else ""
            kwargs = {**kwargs, "default": default, "help": kwargs["help"] + shown}
        m.add_argument(flag, **kwargs)
    c.set_defaults(func=main)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _shown(value) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value) if isinstance(value, dict) else ",".join(value)
    return str(value)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader serve`` until Ctrl-C."""
    if not 0 <= args.port <= 65535:
        return fail("serve", f"--port must be in 0..65535, got {args.port}")
    if args.max_tokens < 1:
        return fail("serve", "--max-tokens must be at least 1")
    if args.kv_prealloc is not None and args.kv_prealloc < 1:
        return fail("serve", "--kv-prealloc must be a positive token count")
    if args.allow_client_models and args.trust_remote_code:
        return fail("serve", "--allow-client-models with --trust-remote-code would let any "
                             "client choose a directory whose code the server runs; use one "
                             "or the other")
    if args.max_request_bytes < 1:
        return fail("serve", "--max-request-bytes must be positive")
    if args.drain_timeout < 0:
        return fail("serve", "--drain-timeout must be >= 0")
    try:
        resident = resident_of(args)
    except ValueError as exc:
        return fail("serve", str(exc))
    if (status := mlx_lm_missing("serve")) is not None:
        return status
    from ..serving.server import Server, ServerFailed  # needs mlx-lm

    try:
        stream = StreamOptions(strategy=args.strategy, resident=resident,
                               prefetch=args.prefetch, experts=parse_amount(args.experts),
                               expert_policy=args.expert_policy,
                               expert_source=args.expert_source)
    except ValueError as exc:
        return fail("serve", str(exc))
    options = ServeOptions(stream=stream, kv_context=args.kv_prealloc, kernels=args.kernels)
    settings = {_dest(flag): getattr(args, _dest(flag)) for flag, _ in PASSED_THROUGH}
    try:
        model = (model_location(args.model) if args.model is not None
                 else default_model(announce=True))
        if not (is_gguf(model) or is_regular_file(Path(model) / "config.json", "config.json")):
            return fail("serve", f"{model} is neither an mlx-lm model directory (no "
                        "config.json) nor a GGUF file", 1)
        server = Server(model, options, host=args.host, port=args.port,
                        allow_client_models=args.allow_client_models,
                        max_request_bytes=args.max_request_bytes, **settings)
    except KeyboardInterrupt:
        return fail("serve", "interrupted while loading", 130)
    except (OSError, ValueError, TypeError, RuntimeError, MemoryError) as exc:
        return fail("serve", f"{type(exc).__name__}: {exc}", 1)
    st = stats(server.model)
    print(f"pyloader serve: {model} at {server.url} ({args.strategy}, "
          f"{st['resident_bytes'] / 2**20:.0f} MiB resident weights, "
          f"{st['streamed_units']} streamed units); Ctrl-C stops", flush=True)
    # SIGTERM stops the server as Ctrl-C does: requests in flight are drained.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    except ServerFailed as exc:
        return fail("serve", f"stopped: {exc}", 1)
    finally:
        try:
            server.close(drain_s=args.drain_timeout)
        except KeyboardInterrupt:  # a second Ctrl-C/SIGTERM: stop without waiting
            server.close()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
