"""The public steps: stream the weights of any MLX model from a safetensors checkpoint.

A model built with its own classes (its arrays never read: random initial values or
lazy loads) gets its weights from a checkpoint in five steps, which :func:`stream`
composes::

    ckpt = pyloader.open(path)                                   # headers only
    sources = source_map(model, ckpt.tensors(), sanitize)        # parameter -> tensor
    derived = sources.compute_derived(model, ckpt, sanitize)     # computed ones, resident
    controller = StreamingController(ckpt, StreamOptions(...))   # settings, checked
    controller.attach(model, sources.direct, derived)            # resident set read,
                                                                 # the rest streamed

Each step stays public for an engine that needs to change one of them (see
docs/engines.md); :func:`pyloader.stats` reads the counters of a model streamed either way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from ..io.checkpoint import Checkpoint, TensorMeta
from .controller import StreamingController
from .depth import AUTO
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
    the other units (:attr:`StreamOptions.units`) streamed from disk as they run.

    Args:
        model: Any ``mlx.nn.Module`` whose parameter paths are the checkpoint's tensor
            names after ``sanitize``. Its own array values are never read; quantized
            layers must already be quantized (as the model's loader does before
            ``load_weights``).
        checkpoint: A :class:`pyloader.Checkpoint` (``pyloader.open``) or a path.
        options: The streaming settings (default ``StreamOptions()``: everything
            resident, read with mmap).
        tensors: A ready map ``{parameter path: TensorMeta}`` (e.g. ``ckpt[name]`` for
            each parameter) instead of running a sanitize step: for an engine that
            renames tensors itself. Parameters absent from it must be in ``derived``.
        derived: Parameters given as arrays (computed by the engine; kept resident).
        sanitize: ``{tensor name: array} -> {parameter path: array}``, as an engine's
            loader transforms the checkpoint (default: ``model.sanitize`` when the model
            has one, else names unchanged). It runs on lazy loads: a parameter that is
            one of its input arrays, unchanged, is read (and streamed) from that tensor;
            any other is computed from the real tensors once and kept resident.
        strict: Every parameter must come from the checkpoint (False: the others keep
            the values the model was built with, tensors that match no parameter are
            ignored).
        lazy: False: every resident parameter is evaluated before returning; True: left
            to first use.

    Returns:
        The :class:`StreamingController` now owning the weights (``controller.stats()``,
        or ``pyloader.stats(model)``).

    Raises:
        ValueError: both ``tensors`` and ``sanitize``; a ``units`` pattern that matches
            nothing or nests; with ``strict``, a parameter that nothing provides (named
            by MLX's ``load_weights``).
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
    if opts.resident == AUTO:
        opts = opts.with_(resident=f"{max(0, auto_budget())}B")
    controller = StreamingController(ckpt, opts)
    controller.attach(model, sources.direct, given, started=t0, strict=strict)
    if not lazy and not opts.overlap:
        mx.eval(controller.in_memory(model))  # not the streamed units' stand-ins
    return controller


__all__ = ["stream"]
