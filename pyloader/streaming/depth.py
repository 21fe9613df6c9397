"""``prefetch="auto"``: how many streamed units to request ahead of the one computing,
chosen from the units' sizes, the compute they stand for and the memory budget.

One reader brings units in, one at a time, while the compute thread runs the current
one. Depth 1 hides the reads whenever reading a unit takes no longer than computing the
one before it — the case of equal units (``granularity="layer"``). With unequal units
the reader can idle: at ``granularity="sublayer"`` the unit after an MLP block is the
much smaller attention block, so with depth 1 the reader finishes it early and waits
while the MLP still computes, then has the next MLP block to read in the short
attention compute. A deeper queue keeps it busy. Compute of a decode step is close to
proportional to the weight bytes it multiplies (the cost model's ``k·b``,
:mod:`pyloader.residency.cost`), so, with no timing at load:

* :func:`wanted_depth`: the smallest depth ``d >= 1`` such that, wherever a unit
  computes, the ``d`` units requested ahead of it hold at least as many bytes as it
  (the reader has queued work for as long as any unit computes);
* :func:`fit_depth`: the deepest depth up to that which the memory allows: the
  pre-flight's anonymous need (:mod:`.preflight`: with ``pread`` every unit in flight
  is a fresh buffer, ``d + 1`` of the largest counted; with ``mmap`` only the copied,
  misaligned tensors) against the live headroom. Depth 0 only when not even depth 1
  fits (the pre-flight then names what is missing).

A deeper queue is not free with ``mmap`` under a tight limit even when it "fits": the
mapped pages of a unit read ahead can be reclaimed before it runs and are then read
again (measured: depth 2 of 103 MB layers in a 450 MB cgroup ran 1.5x slower than
depth 1, with 24x the major faults). Equal units want depth 1, so
``"auto"`` only goes deeper where the units' sizes alternate, and there the
measurement favours it (docs/streaming.md, "Prefetch depth").

Plans made before the model is built (``resident="auto"``, distributed splits,
:mod:`pyloader.residency`) count :func:`planning_depth`.
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
    """The depth a plan made before the units are known counts: ``prefetch``, or 1 for
    ``"auto"`` (whatever the sizes want, the controller then goes deeper only if that
    fits the headroom it finds)."""
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
    """The smallest depth ``d >= 1`` at which the ``d`` units after each unit (in
    execution order, the first ones again after the last) hold at least its bytes;
    at most :data:`MAX_DEPTH` and at most the number of units (1 when there are none)."""
    m = len(unit_bytes)
    top = max(1, min(MAX_DEPTH, m))
    for d in range(1, top + 1):
        if all(sum(unit_bytes[(j + s) % m] for s in range(1, d + 1)) >= b
               for j, b in enumerate(unit_bytes)):
            return d
    return top


def fit_depth(want: int, fits: Callable[[int], bool]) -> int:
    """The deepest depth in ``[0, want]`` for which ``fits(depth)``; ``min(want, 1)``
    when none does (the pre-flight then names what is missing)."""
    for d in range(want, -1, -1):
        if fits(d):
            return d
    return min(want, 1)
