"""What one rank owns, and how it restricts the model's sources to its own tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .._util.hooks import attach_handle
from ..io.checkpoint import Checkpoint, TensorMeta
from ..streaming import SourceMap
from ..streaming.resident import Residency
from .memory import RankMemory, check_memory, gather_memory, least_need
from .split import tensor_layer_bytes
from .tensor import ParamSlice


@dataclass
class Share:
    """What one rank owns.

    Attributes:
        rank, size: The rank in the group and the group size.
        mode: ``"pipeline"`` or ``"tensor"`` (``split`` is then empty).
        split: Layers per rank (rank 0 runs the *last* ``split[0]`` layers).
        start, end: This rank's layers ``[start, end)`` in checkpoint numbering.
        adapted: True when pyloader applied the pipeline protocol, False when mlx-lm did.
        resident: The rank's resident set (with ``resident="auto"``: its byte budget).
        slices: Tensor sharding: each sharded parameter → the slice this rank keeps.
        memory: ``resident="auto"``: every rank's gathered :class:`RankMemory`.
    """

    rank: int
    size: int
    mode: str
    split: list[int]
    start: int
    end: int
    n_layers: int
    adapted: bool
    resident: Residency | None = None
    group: Any = field(default=None, repr=False)
    renames: dict[str, str | None] = field(default_factory=dict, repr=False)
    owned_tensors: list[str] = field(default_factory=list, repr=False)
    slices: dict[str, ParamSlice] = field(default_factory=dict, repr=False)
    memory: list[RankMemory] = field(default_factory=list, repr=False)
    load_s: float = 0.0

    def restrict(self, model: nn.Module, sources: SourceMap, ckpt: Checkpoint
                 ) -> tuple[SourceMap, Checkpoint]:
        """Keeps this rank's parameters (renamed to its module paths); drops the others unread."""
        have = {k for k, _ in tree_flatten(model.parameters())}
        out = {q: t for p, t in sources.direct.items() if (q := self._rename(p)) in have}
        kept_derived = {self._rename(p) for p in sources.derived} & have
        if kept_derived:
            raise ValueError(
                f"{len(kept_derived)} parameters (e.g. {next(iter(kept_derived))!r}) are "
                "computed by the model's sanitize from several tensors; a rank cannot "
                "compute them from its own tensors only. Convert the checkpoint with "
                "mlx_lm.convert first (as mlx_lm.utils.sharded_load requires).")
        missing = have - set(out)
        if missing:
            raise ValueError(f"rank {self.rank}: the checkpoint has no tensor for "
                             f"{sorted(missing)[:3]} ({len(missing)} parameters)")
        if self.slices:
            ckpt, out = self._sliced(ckpt, out)
        self.owned_tensors = sorted({t.name for t in out.values()})
        return SourceMap(direct=out), ckpt

    def auto_resident(self, direct: dict[str, TensorMeta], prefetch: int) -> Residency:
        """``resident="auto"`` for this rank: budgets gathered and checked (:func:`check_memory`),
        then this rank's byte budget (``"tensor"``: the smallest rank's)."""
        layer_bytes, fixed = tensor_layer_bytes(direct.values())
        self.memory = gather_memory(self.group, least_need(layer_bytes, fixed, prefetch))
        check_memory(self.memory, f"a {self.mode} share")
        budget = (min(m.budget for m in self.memory) if self.mode == "tensor"
                  else self.memory[self.rank].budget)
        self.resident = Residency.of_bytes(budget)
        return self.resident

    def _sliced(self, ckpt: Checkpoint, direct: dict[str, TensorMeta]
                ) -> tuple[Checkpoint, dict[str, TensorMeta]]:
        """The checkpoint of this rank's slices, and ``direct`` with sharded tensors as slices."""
        specs = {}
        for param, sl in self.slices.items():
            t = direct[param]
            if tuple(t.shape) != sl.shape:
                raise ValueError(
                    f"{t.file}: tensor {t.name!r} has shape {list(t.shape)} but parameter "
                    f"{param!r} had {list(sl.shape)} before sharding; a rank can only read "
                    "slices of tensors stored as the model holds them (convert the "
                    "checkpoint with mlx_lm.convert)")
            specs[sl.name(t.name)] = (t.name, sl.axis, sl.ranges)
        ckpt = ckpt.with_slices([(n, t, a, r) for n, (t, a, r) in specs.items()])
        return ckpt, {p: ckpt[self.slices[p].name(t.name)] if p in self.slices else t
                      for p, t in direct.items()}

    def _rename(self, param: str) -> str | None:
        """The parameter's path in this rank's model; None for another rank's layer."""
        for old, new in self.renames.items():
            if param.startswith(old):
                return None if new is None else new + param[len(old):]
        return param

    def finish(self, model: nn.Module) -> None:
        """Records the share in the model's handle and synchronizes the ranks after loading."""
        attach_handle(model).share = self
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=self.group))


def check_lockstep(mode: str, resident: Residency) -> None:
    """ValueError for per-rank ``resident`` values that differ under tensor sharding."""
    if (mode == "tensor" and resident.kind == "per_rank"
            and any(v != resident.value[0] for v in resident.value)):
        raise ValueError(f"resident={resident}: with shard='tensor' every rank must "
                         "stream the same layers (their collectives run in lockstep); "
                         "pass one value for every rank, or 'auto' (the smallest rank's "
                         "budget)")
