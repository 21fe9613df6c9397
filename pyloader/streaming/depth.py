"""``prefetch="auto"``: how many streamed units to request ahead of the one computing.

:func:`wanted_depth` is the smallest depth whose units in flight hold at least the bytes
of the unit computing (compute is taken as proportional to weight bytes); :func:`fit_depth`
lowers it to what the memory allows. Plans made before the model is built count
:func:`planning_depth`. See docs/streaming.md, "Prefetch depth".
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

#: ``prefetch="auto"``.
AUTO = "auto"
#: The deepest queue ``"auto"`` chooses.
MAX_DEPTH = 4


def check_prefetch(prefetch) -> None:
    """``ValueError`` unless ``prefetch`` is ``"auto"`` or an int >= 0."""
    if prefetch == AUTO:
        return
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be 'auto' or an int >= 0, got {prefetch!r}")


def planning_depth(prefetch) -> int:
    """The depth a plan made before the units are known counts: ``prefetch``, or 1
    for ``"auto"``."""
    return 1 if prefetch == AUTO else prefetch


def prefetch_arg(text: str):
    """An ``argparse`` type for ``--prefetch``: ``"auto"`` or an int >= 0."""
    value = int(text) if text.isdigit() else text
    try:
        check_prefetch(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def wanted_depth(unit_bytes: Sequence[int]) -> int:
    """The smallest ``d >= 1`` at which the ``d`` units after each unit (cyclically,
    in execution order) hold at least its bytes; at most :data:`MAX_DEPTH` and the unit count
    (1 when there are none)."""
    m = len(unit_bytes)
    top = max(1, min(MAX_DEPTH, m))
    for d in range(1, top + 1):
        if all(sum(unit_bytes[(j + s) % m] for s in range(1, d + 1)) >= b
               for j, b in enumerate(unit_bytes)):
            return d
    return top


def fit_depth(want: int, fits: Callable[[int], bool]) -> int:
    """The deepest depth in ``[0, want]`` for which ``fits(depth)``; ``min(want, 1)``
    when none does."""
    return next((d for d in range(want, -1, -1) if fits(d)), min(want, 1))
