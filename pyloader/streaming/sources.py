"""Where each parameter of an mlx-lm model comes from: the source map.

mlx-lm builds a model from its config, then ``model.sanitize(weights)`` renames, drops
and sometimes computes (stacks, fuses) checkpoint tensors into parameters. pyloader runs
``sanitize`` on shape-only stand-ins of every tensor (nothing is read): a parameter that
comes out as a stand-in is *direct* (read from that tensor, possibly renamed); anything
else is *derived* (computed by ``sanitize`` from several tensors) and is computed once
from the real tensors and kept resident.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..io.checkpoint import MLX_DTYPES, Checkpoint, TensorMeta
from ..io.readers import MmapReader


def placeholder(shape, dtype) -> mx.array:
    """A stand-in of the right shape and dtype that costs one element even if something
    evaluates it (what a streamed parameter is while its unit is out)."""
    return mx.broadcast_to(mx.zeros((), dtype=dtype), shape)


def stand_in(t: TensorMeta) -> mx.array:
    """:func:`placeholder` for a checkpoint tensor."""
    return placeholder(t.shape, MLX_DTYPES.get(t.dtype, mx.uint8))


@dataclass
class SourceMap:
    """Parameters of a model and the checkpoint tensors they come from.

    Attributes:
        direct: Parameter path → the tensor it is read from.
        derived: Parameter paths ``sanitize`` computes from several tensors.
    """

    direct: dict[str, TensorMeta]
    derived: set[str] = field(default_factory=set)

    def compute_derived(self, model: nn.Module, ckpt: Checkpoint) -> dict[str, mx.array]:
        """The derived parameters, computed by running ``sanitize`` on the real tensors
        (mapped, so only the pages sanitize touches are read) and evaluated."""
        if not self.derived:
            return {}
        computed = model.sanitize(MmapReader(ckpt).load())
        out = {p: computed[p] for p in self.derived}
        mx.eval(list(out.values()))
        return out


def source_map(model: nn.Module, metas: list[TensorMeta]) -> SourceMap:
    """Runs the model's ``sanitize`` on shape-only stand-ins of ``metas`` (see the module
    doc)."""
    stand_ins = {t.name: stand_in(t) for t in metas}
    by_id = {id(stand_ins[t.name]): t for t in metas}
    out = model.sanitize(dict(stand_ins)) if hasattr(model, "sanitize") else stand_ins
    return SourceMap(direct={k: by_id[id(v)] for k, v in out.items() if id(v) in by_id},
                     derived={k for k, v in out.items() if id(v) not in by_id})
