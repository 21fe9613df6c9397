"""The pipeline protocol around a stage's first and last layer, for architectures whose mlx-lm model
has no ``pipeline`` of its own (llama, qwen3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .._util.hooks import add_hook, get_hook


@dataclass
class StageHook:
    """The ``"pipeline"`` hook of a rank's first and last layer: receive the hidden state from the
    next rank, send the output to the previous one, gather rank 0's output."""

    group: Any = None
    recv_from: int | None = None
    send_to: int | None = None
    gather: Any = None
    #: The hidden state's dtype across this boundary (None before the first forward pass).
    wire_dtype: Any = None

    def __call__(self, module, call, x, *args, **kwargs):
        if self.recv_from is not None:
            if self.wire_dtype is None:
                self.wire_dtype = _WIRE_DTYPES[int(mx.distributed.recv(
                    (1,), mx.int32, self.recv_from, group=self.group, stream=mx.cpu).item())]
            # Received in the sender's dtype, which may differ from x's (float16 embedding,
            # float32 norms).
            x = mx.distributed.recv(x.shape, self.wire_dtype, self.recv_from,
                                    group=self.group)
        out = call(x, *args, **kwargs)
        if self.send_to is not None:
            if self.wire_dtype is None:
                # Once, before the first hidden state: the dtype the next stage receives.
                self.wire_dtype = out.dtype
                mx.eval(mx.distributed.send(mx.array([_WIRE_DTYPES.index(out.dtype)],
                                                     dtype=mx.int32),
                                            self.send_to, group=self.group, stream=mx.cpu))
            out = mx.distributed.send(out, self.send_to, group=self.group)
            # As in mlx-lm: the cache depends on the send, so evaluating it completes the send.
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            if cache is not None and hasattr(cache, "keys") and cache.keys is not None:
                cache.keys = mx.depends(cache.keys, out)
        if self.gather is not None:
            # Every rank gets rank 0's output (the end of the pipeline).
            out = mx.distributed.all_gather(out, group=self.gather)[: out.shape[0]]
        return out


_WIRE_DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.float64, mx.int32, mx.int64,
                mx.int16, mx.int8, mx.uint32, mx.uint64, mx.uint16, mx.uint8, mx.bool_,
                mx.complex64]


def stage_hook(layer: nn.Module) -> StageHook:
    """The layer's :class:`StageHook`, added on first use."""
    hook = get_hook(layer, "pipeline")
    if hook is None:
        hook = StageHook()
        add_hook(layer, "pipeline", hook)
    return hook
