"""Where each parameter of an mlx-lm model comes from: the source map.

``sanitize`` runs on MLX's lazy loads of every tensor: a parameter that comes out as one of
those arrays is *direct* (read from that tensor); anything else is *derived*, computed once
and kept resident. Files MLX cannot load get shape-only stand-ins.
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
from ..io.gguf_header import is_gguf
from ..io.readers import MmapReader

log = logging.getLogger(__name__)

#: Checkpoint tensors by name → the model's parameters by path (renamed, dropped, derived).
Sanitize = Callable[[dict[str, mx.array]], dict[str, mx.array]]

_NOT_READ = ("pyloader: a computation read a parameter whose bytes were never read "
             "(a stand-in: shape and dtype only)")


def placeholder(shape, dtype, message: str = _NOT_READ) -> mx.array:
    """A stand-in: an array of ``shape`` and ``dtype`` that holds no data. Evaluating
    it, or anything computed from it, raises :class:`pyloader.StandInError` with ``message``."""
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
        """The derived parameters, computed by running ``sanitize``
        (default: the model's own) on the real (mapped) tensors, evaluated."""
        if not self.derived:
            return {}
        computed = sanitizer(model, sanitize)(MmapReader(ckpt).load())
        out = {p: computed[p] for p in self.derived}
        mx.eval(list(out.values()))
        return out


def lazy_tensors(metas: list[TensorMeta]) -> dict[str, mx.array]:
    """Each tensor of ``metas`` as MLX's lazy load (a :func:`stand_in` where MLX
    cannot load the file)."""
    by_file: dict[str, list[TensorMeta]] = {}
    for t in metas:
        by_file.setdefault(t.file, []).append(t)
    out: dict[str, mx.array] = {}
    for file, tensors in by_file.items():
        # mx.load reads (and converts) a whole GGUF file eagerly
        arrays = {} if is_gguf(file) else _mlx_lazy_load(file)
        for t in tensors:
            out[t.name] = arrays[t.name] if t.name in arrays else stand_in(t)
    return out


def _mlx_lazy_load(file: str) -> dict[str, mx.array]:
    try:
        return mx.load(file)
    except (ValueError, RuntimeError) as exc:
        log.debug("%s: mx.load cannot open it (%s); shape-only stand-ins", file, exc)
        return {}


def sanitizer(model: nn.Module, sanitize: Sanitize | None = None) -> Sanitize:
    """``sanitize`` if given, else the model's own ``sanitize``, else no change."""
    if sanitize is not None:
        return sanitize
    return model.sanitize if hasattr(model, "sanitize") else dict


def source_map(model: nn.Module, metas: list[TensorMeta],
               sanitize: Sanitize | None = None) -> SourceMap:
    """Runs ``sanitize`` (default: the model's own) on lazy loads of ``metas``; an
    engine that renames or derives tensors outside the model class passes its steps here."""
    stand_ins = lazy_tensors(metas)
    by_id = {id(stand_ins[t.name]): t for t in metas}
    out = sanitizer(model, sanitize)(dict(stand_ins))
    return SourceMap(direct={k: by_id[id(v)] for k, v in out.items() if id(v) in by_id},
                     derived={k for k, v in out.items() if id(v) not in by_id})
