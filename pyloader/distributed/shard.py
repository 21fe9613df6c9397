"""Applying mlx-lm's pipeline or tensor sharding to a lazily loaded model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from .pipeline import stage_hook
from .share import Share
from .split import SplitPlan, check_split, even_split, layer_range
from .tensor import shard_and_trace

SHARD_MODES = ("pipeline", "tensor")

# Architectures without mlx-lm's ``pipeline`` whose inner model runs exactly "embed -> layers ->
# norm", so the PipelineMixin protocol can wrap their first and last layers.
_ADAPTED = ("llama", "qwen3")


@dataclass(frozen=True)
class Distribution:
    """How a model is spread over the ranks of an MLX distributed group.

    Attributes:
        group: An ``mx.distributed.Group``.
        shard: ``"pipeline"`` (each rank its own layers) or ``"tensor"`` (mlx-lm's ``shard``).
        split: Pipeline only: layers per rank (rank 0 runs the last), a :class:`SplitPlan`, or None
            (mlx-lm's even split, or from the gathered budgets with ``resident="auto"``).
    """

    group: Any
    shard: str = "pipeline"
    split: Sequence[int] | SplitPlan | None = None

    def __post_init__(self) -> None:
        if self.group is None:
            raise ValueError("Distribution(group=None): pass an mx.distributed.Group")
        _check_mode(self.shard)
        if self.shard == "tensor" and self.split is not None:
            raise ValueError(_TENSOR_SPLIT)

    @classmethod
    def of(cls, group: Any) -> Distribution | None:
        """``group`` as a Distribution (a bare group wrapped; None stays None)."""
        if group is None or isinstance(group, Distribution):
            return group
        return cls(group)


_TENSOR_SPLIT = "split= is a pipeline setting; shard='tensor' gives every rank every layer"


def _check_mode(mode: str) -> None:
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}; expected one of {SHARD_MODES} "
                         "(one group is either pipeline- or tensor-sharded)")


def shard_model(model: nn.Module, group, *, mode: str = "pipeline",
                split: Sequence[int] | SplitPlan | None = None) -> Share:
    """Applies pipeline or tensor sharding to a lazily loaded mlx-lm model in place.

    Args:
        model: The model from ``mlx_lm.utils.load_model(path, lazy=True)``.
        group: An ``mx.distributed.Group``.
        mode: ``"pipeline"`` or ``"tensor"``.
        split: Pipeline only: layers per rank, a :class:`SplitPlan`, or None (even split).
    """
    _check_mode(mode)
    if mode == "tensor":
        return _shard_tensors(model, group, split)
    rank, size = group.rank(), group.size()
    if isinstance(split, SplitPlan):
        split = split.split
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__module__}: no model.model.layers to split")
    n_layers = len(layers)
    split = check_split(split if split is not None else even_split(n_layers, size),
                         n_layers, size)
    start, end = layer_range(split, rank)
    share = Share(rank=rank, size=size, mode=mode, split=split, start=start, end=end,
                  n_layers=n_layers, adapted=False, group=group)
    if hasattr(inner, "pipeline"):
        inner.pipeline(group, split=split)
        if (inner.start_idx, inner.end_idx) != (start, end):
            raise RuntimeError(f"mlx-lm's pipeline gave layers [{inner.start_idx}, "
                               f"{inner.end_idx}), expected [{start}, {end})")
        return share
    model_type = getattr(model, "model_type", None)
    if model_type not in _ADAPTED:
        raise ValueError(f"model type {model_type!r} does not implement mlx-lm's pipeline "
                         f"and has no adapter here (adapted: {', '.join(_ADAPTED)})")
    share.adapted = True
    paths = {id(m): name for name, m in model.named_modules()}
    own = list(layers[start:end])
    old = [paths[id(m)] for m in own]
    dropped = [paths[id(m)] for i, m in enumerate(layers) if not start <= i < end]
    inner.layers = own
    paths = {id(m): name for name, m in model.named_modules()}
    # Old path -> new path (None: another rank's layer); keys end with "." so none is a prefix.
    share.renames = {o + ".": paths[id(m)] + "." for o, m in zip(old, own)}
    share.renames.update({d + ".": None for d in dropped})
    if model_type == "llama":
        # Indices into the layer (and cache) list, computed for all layers.
        sliding = [getattr(m, "use_sliding", False) for m in own]
        inner.fa_idx = sliding.index(False) if False in sliding else 0
        inner.swa_idx = sliding.index(True) if True in sliding else None
    if size > 1:
        first, last = stage_hook(own[0]), stage_hook(own[-1])
        first.group = last.group = group
        first.recv_from = rank + 1 if rank < size - 1 else None
        last.send_to = rank - 1 if rank > 0 else None
        last.gather = group
    return share


def _shard_tensors(model: nn.Module, group, split) -> Share:
    if split is not None:
        raise ValueError(_TENSOR_SPLIT)
    if not hasattr(model, "shard"):
        raise ValueError(f"model type {getattr(model, 'model_type', type(model).__name__)!r} "
                         "does not implement mlx-lm's shard (tensor parallelism); "
                         "use shard='pipeline'")
    n_layers = len(getattr(model, "layers", []) or [])
    share = Share(rank=group.rank(), size=group.size(), mode="tensor", split=[], start=0,
                  end=n_layers, n_layers=n_layers, adapted=False, group=group)
    share.slices = shard_and_trace(model, group)
    return share
