"""What streams: a model's decoder layers, and the units each is cut into.

A *unit kind* decides how one layer is cut into streamed units (modules whose weights are
brought in just before they run and released right after). Two kinds exist:

* ``"layer"``: the whole decoder layer is one unit;
* ``"sublayer"``: each child module holding at least 1% of the layer's bytes (attention,
  MLP, ...) is a unit; the small rest (norms) stays resident.

A new kind is a subclass of :class:`UnitKind` registered in :data:`UNIT_KINDS`: the
controller asks it for the modules of a layer and does the rest (hooks, reads, release).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..io.checkpoint import TensorMeta


@dataclass
class UnitStats:
    """Counters of one streamed unit."""

    loads: int = 0
    bytes_read: int = 0
    wait_s: float = 0.0     # time the forward pass waited for this unit's data
    compute_s: float = 0.0  # time in the synchronizing eval after the unit ran
    prefetched: int = 0     # loads whose data was requested ahead of time
    stray_entries: int = 0  # loads made by a holder's call, not the unit's own


@dataclass(eq=False)
class LayerEntry:
    """One decoder layer of the model (``decoder_layers(model)[index]``).

    Attributes:
        index: Position in the layer list (``model.layers``).
        path: Module path (``"model.layers.3"``).
        module: The layer module.
        sources: Full parameter path → the checkpoint tensor it is read from.
    """

    index: int
    path: str
    module: nn.Module
    sources: dict[str, TensorMeta]

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's weights in the checkpoint."""
        return sum(t.nbytes for t in self.sources.values())

    def sources_under(self, module_path: str) -> dict[str, TensorMeta]:
        """The sources of the parameters under ``module_path``, by path relative to it."""
        prefix = module_path + "."
        return {p[len(prefix):]: t for p, t in self.sources.items() if p.startswith(prefix)}


@dataclass(eq=False)
class Unit:
    """A module whose weights stream (hashable by identity).

    Attributes:
        name: Module path (``"model.layers.3.mlp"``).
        module: The module; its class is hooked while it streams.
        layer: Index of the decoder layer it belongs to.
        sources: Parameter path relative to the module → the checkpoint tensor.
        copied: Parameters read into fresh buffers at each use rather than viewed
            (the mmap strategy's misaligned tensors).
        order: Position in the controller's execution order (kept by the controller).
        stats: Its counters.
        stand_ins: Parameter path → the stand-in it holds while the unit is out
            (made at the first release, then reused).
        holders: The modules below ``module`` that hold its parameters (found by the
            controller; None until then).
    """

    name: str
    module: nn.Module
    layer: int
    sources: dict[str, TensorMeta]
    copied: list[str] = field(default_factory=list)
    order: int = -1
    stats: UnitStats = field(default_factory=UnitStats)
    stand_ins: dict[str, mx.array] = field(default_factory=dict, repr=False)
    holders: list[nn.Module] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes read to bring the unit in."""
        return sum(t.nbytes for t in self.sources.values())

    @property
    def tensor_names(self) -> list[str]:
        """Checkpoint tensor names of its parameters."""
        return [t.name for t in self.sources.values()]


class UnitKind(ABC):
    """How a decoder layer is cut into streamed units."""

    name: ClassVar[str]

    @abstractmethod
    def modules(self, layer: LayerEntry) -> list[tuple[str, nn.Module]]:
        """``(module path, module)`` of each unit of ``layer``, in execution order."""


class WholeLayer(UnitKind):
    """The layer is one unit."""

    name = "layer"

    def modules(self, layer: LayerEntry) -> list[tuple[str, nn.Module]]:
        return [(layer.path, layer.module)]


class Sublayers(UnitKind):
    """Each child module with at least ``min_share`` of the layer's bytes is a unit; the
    rest (norms and other small children) stays resident with the layer."""

    name = "sublayer"

    def __init__(self, min_share: float = 0.01):
        self.min_share = min_share

    def modules(self, layer: LayerEntry) -> list[tuple[str, nn.Module]]:
        total = layer.nbytes
        out = []
        for key, child in layer.module.children().items():
            if not isinstance(child, nn.Module):
                continue
            path = f"{layer.path}.{key}"
            nbytes = sum(t.nbytes for t in layer.sources_under(path).values())
            if nbytes and nbytes >= self.min_share * total:
                out.append((path, child))
        return out


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: ``model.layers`` (mlx-lm's convention), else the
    longest list of modules of one type anywhere in the model (``h``, ``blocks``, ...,
    the one holding the most parameters on a tie), else ``[]`` (nothing can stream: every
    weight is a non-layer weight, always resident)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (list, tuple)) and layers and all(
            isinstance(m, nn.Module) for m in layers):
        return list(layers)
    best: list[nn.Module] = []
    best_key = (0, 0)
    for _, module in model.named_modules():
        for value in module.values():
            if (isinstance(value, list) and len(value) >= 2
                    and all(isinstance(m, nn.Module) for m in value)
                    and len({type(m) for m in value}) == 1):
                key = (len(value), sum(p.size for m in value
                                       for _, p in tree_flatten(m.parameters())))
                if key > best_key:
                    best, best_key = list(value), key
    return best


#: Unit kinds by name (``StreamOptions(granularity=...)``).
UNIT_KINDS: dict[str, UnitKind] = {k.name: k for k in (WholeLayer(), Sublayers())}
GRANULARITIES = tuple(UNIT_KINDS)
