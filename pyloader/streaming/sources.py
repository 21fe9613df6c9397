"""Where each parameter of an mlx-lm model comes from: the source map.

mlx-lm builds a model from its config, then ``model.sanitize(weights)`` renames, drops
and sometimes computes (stacks, fuses) checkpoint tensors into parameters. pyloader runs
``sanitize`` on MLX's own lazy loads of every tensor (``mx.load``: the real values, of
which nothing is read unless ``sanitize`` evaluates it — a ``sanitize`` that checks
values sees the real ones): a parameter that comes out as one of those arrays, the same
object, is *direct* (read from that tensor, possibly renamed); anything else is *derived*
(computed by ``sanitize`` from several tensors) and is computed once from the real
tensors and kept resident. A file MLX cannot load (a dtype it has no type for) gets
shape-only stand-ins (:func:`placeholder`: ``sanitize`` evaluating one raises).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .._native import core
from ..io.checkpoint import MLX_DTYPES, Checkpoint, TensorMeta
from ..io.readers import MmapReader

log = logging.getLogger(__name__)

#: Checkpoint tensors by name → the model's parameters by path (renamed, dropped, derived).
Sanitize = Callable[[dict[str, mx.array]], dict[str, mx.array]]

_NOT_READ = ("pyloader: a computation read a parameter whose bytes were never read "
             "(a stand-in: shape and dtype only)")


def placeholder(shape, dtype, message: str = _NOT_READ) -> mx.array:
    """A stand-in: an array of ``shape`` and ``dtype`` that holds no data and cannot be
    computed with. Its shape, dtype and nbytes read as the parameter's; evaluating it,
    or anything computed from it, raises :class:`pyloader.StandInError` with
    ``message`` (C++ ``stand_in``: its primitive throws from eval). What a streamed
    parameter is while its unit is out: a forward that reaches it other than through the
    unit's call fails before a token is returned instead of computing with a number."""
    return core.stand_in(list(shape), dtype, message)


def stand_in(t: TensorMeta, message: str = _NOT_READ) -> mx.array:
    """:func:`placeholder` for a checkpoint tensor."""
    return placeholder(t.shape, MLX_DTYPES.get(t.dtype, mx.uint8), message)


@dataclass
class SourceMap:
    """Parameters of a model and the checkpoint tensors they come from.

    Attributes:
        direct: Parameter path → the tensor it is read from.
        derived: Parameter paths ``sanitize`` computes from several tensors.
    """

    direct: dict[str, TensorMeta]
    derived: set[str] = field(default_factory=set)

    def restrict_to(self, model: nn.Module) -> SourceMap:
        """Only the parameters ``model`` has (a non-strict load ignores the rest)."""
        have = {p for p, _ in tree_flatten(model.parameters())}
        dropped = sorted((set(self.direct) | self.derived) - have)
        if dropped:
            log.info("%d checkpoint tensors match no parameter and are ignored "
                     "(strict=False): %s", len(dropped), dropped[:5])
        return SourceMap({p: t for p, t in self.direct.items() if p in have},
                         {p for p in self.derived if p in have})

    def compute_derived(self, model: nn.Module, ckpt: Checkpoint,
                        sanitize: Sanitize | None = None) -> dict[str, mx.array]:
        """The derived parameters, computed by running ``sanitize`` (default: the
        model's own, as :func:`source_map`) on the real tensors (mapped, so only the
        pages sanitize touches are read) and evaluated."""
        if not self.derived:
            return {}
        computed = sanitizer(model, sanitize)(MmapReader(ckpt).load())
        out = {p: computed[p] for p in self.derived}
        mx.eval(list(out.values()))
        return out


def lazy_tensors(metas: list[TensorMeta]) -> dict[str, mx.array]:
    """Each tensor of ``metas`` as MLX's lazy load of it (nothing read until evaluated);
    a :func:`stand_in` for the tensors of a file MLX cannot load."""
    by_file: dict[str, list[TensorMeta]] = {}
    for t in metas:
        by_file.setdefault(t.file, []).append(t)
    out: dict[str, mx.array] = {}
    for file, tensors in by_file.items():
        try:
            arrays = mx.load(file)
        except (ValueError, RuntimeError) as exc:
            log.debug("%s: mx.load cannot open it (%s); shape-only stand-ins", file, exc)
            arrays = {}
        for t in tensors:
            out[t.name] = arrays[t.name] if t.name in arrays else stand_in(t)
    return out


def sanitizer(model: nn.Module, sanitize: Sanitize | None = None) -> Sanitize:
    """``sanitize`` if given, else the model's own ``sanitize``, else no change."""
    if sanitize is not None:
        return sanitize
    return model.sanitize if hasattr(model, "sanitize") else dict


def source_map(model: nn.Module, metas: list[TensorMeta],
               sanitize: Sanitize | None = None) -> SourceMap:
    """Runs ``sanitize`` (default: the model's own, if it has one) on lazy loads of
    ``metas`` (see the module doc). ``sanitize`` is a callable from
    ``{tensor name: array}`` to ``{parameter path: array}``: an engine whose loader
    renames or derives tensors outside the model class passes its steps here."""
    stand_ins = lazy_tensors(metas)
    by_id = {id(stand_ins[t.name]): t for t in metas}
    out = sanitizer(model, sanitize)(dict(stand_ins))
    return SourceMap(direct={k: by_id[id(v)] for k, v in out.items() if id(v) in by_id},
                     derived={k for k, v in out.items() if id(v) not in by_id})
