"""What streams: a model's decoder layers (or the block lists a pattern names), and the
units each is cut into.

*Which* modules are the streamed layers is :func:`select_units`'s choice: by default the
model's decoder layers (:func:`decoder_layers`), or the modules a pattern over module paths
names (``"decoder.blocks.*"``; several patterns give several lists, concatenated).

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
from typing import Any, ClassVar

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


def check_patterns(units: Any) -> tuple[str, ...] | None:
    """``units`` as :func:`select_units` takes it (None, a pattern, or a sequence of
    patterns), normalized to None or a tuple of patterns. ``ValueError`` names a pattern
    that cannot match any module path (empty, an empty component, spaces), ``TypeError``
    a value that is not a pattern."""
    if units is None:
        return None
    patterns = (units,) if isinstance(units, str) else units
    if not isinstance(patterns, (list, tuple)) or not patterns:
        raise TypeError(f"units must be None, a pattern (str) or a non-empty sequence of "
                        f"patterns; got {units!r}")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"units: pattern {pattern!r} is not a str")
        if not pattern or any(not c or c != c.strip() or " " in c
                              for c in pattern.split(".")):
            raise ValueError(f"units: pattern {pattern!r} is not a module path pattern "
                             "(dot-separated components, '*' for any one component, "
                             "no empty components or spaces)")
    return tuple(patterns)


def _matches(pattern: list[str], path: list[str]) -> bool:
    return len(pattern) == len(path) and all(p in ("*", c) for p, c in zip(pattern, path))


def _path_key(path: str) -> tuple:
    # Block indices compare as numbers: "blocks.10" comes after "blocks.9".
    return tuple((0, int(c), "") if c.isdigit() else (1, 0, c) for c in path.split("."))


def select_units(model: nn.Module, units: Any = None) -> list[nn.Module]:
    """The modules of ``model`` that stream, in order (each becomes one layer of the
    controller's layout).

    Args:
        units: None: :func:`decoder_layers` (``model.layers``, else the longest list of
            same-type modules). A pattern over module paths, ``*`` standing for any one
            path component (``"decoder.blocks.*"``): the modules it matches, in index
            order. A sequence of patterns (``["encoder.blocks.*", "decoder.blocks.*"]``):
            each pattern's modules, the lists concatenated in the order given.

    Raises:
        ValueError: a pattern matches no module, or a matched module contains (or is)
            another matched module (a weight would belong to two units); the message
            names the pattern and the rule.
    """
    patterns = check_patterns(units)
    if patterns is None:
        return decoder_layers(model)
    modules = [(path, m) for path, m in model.named_modules() if path]
    chosen: list[tuple[str, str, nn.Module]] = []  # (pattern, path, module)
    for pattern in patterns:
        parts = pattern.split(".")
        found = sorted(((p, m) for p, m in modules if _matches(parts, p.split("."))),
                       key=lambda pm: _path_key(pm[0]))
        if not found:
            raise ValueError(f"units: pattern {pattern!r} matches no module of "
                             f"{type(model).__name__} (each pattern must match at least one)")
        chosen.extend((pattern, p, m) for p, m in found)
    seen: dict[str, str] = {}
    for pattern, path, _ in chosen:
        for other, by in seen.items():
            if path == other or path.startswith(other + ".") or other.startswith(path + "."):
                raise ValueError(
                    f"units: pattern {pattern!r} matches {path!r}, which "
                    f"{'is' if path == other else 'nests in or contains'} {other!r} "
                    f"(matched by {by!r}); streamed modules must not nest in each other")
        seen[path] = pattern
    return [m for _, _, m in chosen]


def block_patterns(model: nn.Module) -> list[str]:
    """A pattern (``"<path>.*"``) for every list of blocks in ``model``: a list of two or
    more modules of one type, each with modules of its own (blocks, not single linear
    layers) and parameters, not inside another such list. In the order the model holds
    them: the natural units of a model with several stacks (an encoder and a decoder, a
    vision tower and a language model)."""
    out: list[str] = []
    for path, module in _in_attribute_order(model):
        for key, value in module.items():
            if not (isinstance(value, list) and len(value) >= 2
                    and all(isinstance(m, nn.Module) for m in value)
                    and len({type(m) for m in value}) == 1):
                continue
            if not value[0].children() or not any(
                    tree_flatten(m.parameters()) for m in value):
                continue
            list_path = f"{path}.{key}" if path else key
            out.append(list_path)
    outer = [p for p in out if not any(p.startswith(o + ".") for o in out)]
    return [f"{p}.*" for p in outer]


def _in_attribute_order(module: nn.Module, prefix: str = ""):
    # named_modules() walks a stack (last attribute first); the order a model's
    # __init__ assigns its parts is usually the order they run in.
    yield prefix, module
    for key, value in module.items():
        items = (enumerate(value) if isinstance(value, (list, tuple))
                 else [(None, value)])
        for i, child in items:
            if isinstance(child, nn.Module):
                path = key if i is None else f"{key}.{i}"
                yield from _in_attribute_order(child, f"{prefix}.{path}" if prefix else path)


#: Unit kinds by name (``StreamOptions(granularity=...)``).
UNIT_KINDS: dict[str, UnitKind] = {k.name: k for k in (WholeLayer(), Sublayers())}
GRANULARITIES = tuple(UNIT_KINDS)
