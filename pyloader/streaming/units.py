"""What streams: a model's decoder layers (or the block lists a pattern names), and
the units each is cut into (:class:`UnitKind`: ``"layer"`` or ``"sublayer"``).
See docs/streaming.md."""

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
    """One decoder layer of the model (``decoder_layers(model)[index]``), with the
    checkpoint tensor of each of its parameters (``sources``, by full path)."""

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
        sources: Parameter path relative to the module -> the checkpoint tensor.
        copied: Parameters read into fresh buffers at each use (misaligned, mmap).
        order: Position in the controller's execution order.
        stats: Its counters.
        stand_ins: Parameter path -> the stand-in it holds while out.
        holders: The modules below ``module`` holding its parameters (None until found).
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


def _is_block_list(value: Any) -> bool:
    """A list of two or more modules of one type."""
    return (isinstance(value, list) and len(value) >= 2
            and all(isinstance(m, nn.Module) for m in value) and len({type(m) for m in value}) == 1)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: ``model.layers``, else the longest list of
    same-type modules (most parameters on a tie), else ``[]``."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (list, tuple)) and layers and all(
            isinstance(m, nn.Module) for m in layers):
        return list(layers)
    best: list[nn.Module] = []
    best_key = (0, 0)
    for _, module in model.named_modules():
        for value in module.values():
            if _is_block_list(value):
                key = (len(value), sum(p.size for m in value
                                       for _, p in tree_flatten(m.parameters())))
                if key > best_key:
                    best, best_key = list(value), key
    return best


def check_patterns(units: Any) -> tuple[str, ...] | None:
    """``units`` normalized to None or a tuple of patterns. ``ValueError`` for a
    pattern that cannot match any path, ``TypeError`` for a non-pattern."""
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
    """The modules of ``model`` that stream, in order.

    Args:
        units: None: :func:`decoder_layers`. A pattern over module paths, ``*`` matching one
            component (``"decoder.blocks.*"``), or a sequence of patterns whose lists are
            concatenated in order.

    Raises:
        ValueError: a pattern matches no module, or a matched module contains another
            (naming the pattern and the rule).
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
    """A ``"<path>.*"`` pattern for every list of two or more same-type blocks
    with parameters, not nested in another such list, in the order the model holds them."""
    out: list[str] = []
    for path, module in _in_attribute_order(model):
        for key, value in module.items():
            if _is_block_list(value) and value[0].children() and any(
                    tree_flatten(m.parameters()) for m in value):
                out.append(f"{path}.{key}" if path else key)
    outer = [p for p in out if not any(p.startswith(o + ".") for o in out)]
    return [f"{p}.*" for p in outer]


def _in_attribute_order(module: nn.Module, prefix: str = ""):
    # The order __init__ assigns parts is usually the order they run in.
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
