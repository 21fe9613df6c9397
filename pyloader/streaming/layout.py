"""What a streaming controller knows about its model: the typed :class:`Layout`, and how
a parameter path finds the module (or layer) that holds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn

from ..io.checkpoint import TensorMeta
from .experts import ExpertCache
from .units import LayerEntry, Unit


@dataclass
class Layout:
    """What the controller knows about its model; only the controller's parts change it.

    Attributes:
        layers: Every decoder layer, in order.
        sources: Every parameter read from the checkpoint -> its tensor.
        fixed_bytes: Non-layer weights (always resident).
        derived_bytes: Parameters not read from the checkpoint (always resident).
        resident: Indices of the layers kept in memory.
        units: The streamed units, in layer order (``unit.order`` is the position).
        in_flight: Reads requested ahead of use: unit -> ticket.
        experts: The expert caches, one per MoE module (their stacked tensors are not part
            of the layers' sources or bytes).
    """

    layers: list[LayerEntry]
    sources: dict[str, TensorMeta]
    fixed_bytes: int = 0
    derived_bytes: int = 0
    resident: set[int] = field(default_factory=set)
    units: list[Unit] = field(default_factory=list)
    in_flight: dict[Unit, int] = field(default_factory=dict)
    experts: list[ExpertCache] = field(default_factory=list)

    @property
    def layer_bytes(self) -> list[int]:
        """Bytes of each layer's weights."""
        return [layer.nbytes for layer in self.layers]

    @property
    def expert_bank_bytes(self) -> int:
        """Memory of the expert caches' banks (always resident)."""
        return sum(c.memory_bytes for c in self.experts)

    @property
    def resident_bytes(self) -> int:
        """Weights kept in memory: non-layer, derived, resident layers and expert banks."""
        return (self.fixed_bytes + self.derived_bytes + self.expert_bank_bytes
                + sum(self.layers[i].nbytes for i in self.resident))

    @property
    def streamed_layers(self) -> list[int]:
        """Indices of the layers that stream."""
        return [i for i in range(len(self.layers)) if i not in self.resident]


def longest_prefix(param: str, table: dict[str, Any]) -> tuple[Any, str] | None:
    """``(table[prefix], rest)`` for the longest module path ``prefix`` of ``param``
    in ``table`` (``""`` included); None if none is."""
    parts = param.split(".")
    for k in range(len(parts) - 1, -1, -1):
        found = table.get(".".join(parts[:k]))
        if found is not None:
            return found, ".".join(parts[k:])
    return None


def split_owner(param: str, modules: dict[str, nn.Module]) -> tuple[nn.Module, str]:
    """``(module, rest)``: the module holding ``param`` and the parameter's path in it."""
    found = longest_prefix(param, modules)
    if found is None:
        raise ValueError(f"{param}: no module of the model holds it")
    return found


def layer_of(param: str, layers: dict[str, LayerEntry]) -> LayerEntry | None:
    """The layer whose module path is the longest prefix of ``param``, if any."""
    found = longest_prefix(param, layers)
    return found[0] if found else None
