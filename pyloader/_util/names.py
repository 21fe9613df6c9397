"""Which decoder layer a tensor or parameter belongs to, from its name."""

from __future__ import annotations

import re

LAYER_RE = re.compile(r"(?:^|\.)(layers|h|blocks|block)\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer ``name`` belongs to, or None for a non-layer tensor."""
    m = LAYER_RE.search(name)
    return int(m.group(2)) if m else None


def layer_prefix(name: str) -> tuple[str, int | None]:
    """``("model.layers", 7)`` for ``model.layers.7.mlp...``; ``("", None)`` otherwise."""
    m = LAYER_RE.search(name)
    return (name[:m.end(1)], int(m.group(2))) if m else ("", None)


def layer_order(name: str) -> tuple:
    """Sort key: inputs first, then layer by layer, then norm, lm_head and the rest."""
    i = layer_of(name)
    if i is not None:
        return (1, i, name)
    return (0 if "embed" in name else 2, 0, name)


def count_layers(names) -> int:
    """Decoder layers among tensor names (highest layer index + 1)."""
    idx = [i for i in map(layer_of, names) if i is not None]
    return max(idx) + 1 if idx else 0
