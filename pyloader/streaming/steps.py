"""The public steps: stream the weights of any MLX model from a safetensors
checkpoint. :func:`stream` composes ``pyloader.open``, :func:`source_map`,
``compute_derived``, :class:`StreamingController` and ``attach``; each stays public for
engines that change one step. See docs/engines.md."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from ..io.checkpoint import Checkpoint, TensorMeta
from .controller import StreamingController
from .options import StreamOptions
from .preflight import auto_budget
from .sources import Sanitize, SourceMap, source_map


def stream(model: nn.Module, checkpoint: Checkpoint | str | os.PathLike[str],
           options: StreamOptions | None = None, *,
           tensors: Mapping[str, TensorMeta] | None = None,
           derived: Mapping[str, mx.array] | None = None,
           sanitize: Sanitize | None = None, strict: bool = True,
           lazy: bool = False) -> StreamingController:
    """Put ``model``'s weights in place from ``checkpoint``: the resident set read now,
    the other units streamed from disk as they run.

    Args:
        model: Any ``mlx.nn.Module`` whose parameter paths are the checkpoint's tensor names
            after ``sanitize``; its array values are never read. Quantized layers must
            already be quantized.
        checkpoint: A :class:`pyloader.Checkpoint` or a path.
        options: The streaming settings (default ``StreamOptions()``).
        tensors: A ready ``{parameter path: TensorMeta}`` map instead of a sanitize step;
            parameters absent from it must be in ``derived``.
        derived: Parameters given as arrays (kept resident).
        sanitize: ``{tensor name: array} -> {parameter path: array}`` (default:
            ``model.sanitize`` if any). Outputs that are unchanged input arrays are streamed;
            others are computed once and kept resident.
        strict: Every parameter must come from the checkpoint.
        lazy: False: every resident parameter is evaluated before returning.

    Returns:
        The :class:`StreamingController` now owning the weights.

    Raises:
        ValueError: both ``tensors`` and ``sanitize``; a ``units`` pattern that matches
            nothing or nests; with ``strict``, a parameter nothing provides.
        MemoryError: the resident set cannot fit (before anything is read).
    """
    if tensors is not None and sanitize is not None:
        raise ValueError("stream(): pass tensors= (a ready map) or sanitize= (a step "
                         "that makes one), not both")
    t0 = time.perf_counter()
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    opts = StreamOptions() if options is None else options
    given = dict(derived or {})
    if tensors is not None:
        sources = SourceMap(dict(tensors))
    else:
        sources = source_map(model, ckpt.tensors(), sanitize)
        if not strict:
            sources = sources.restrict_to(model)
        given.update(sources.compute_derived(model, ckpt, sanitize))
    if opts.resident.is_auto:
        opts = opts.with_(resident=f"{max(0, auto_budget())}B")
    controller = StreamingController(ckpt, opts)
    controller.attach(model, sources.direct, given, started=t0, strict=strict)
    if not lazy and not opts.overlap:
        mx.eval(controller.in_memory(model))  # not the streamed units' stand-ins
    return controller


