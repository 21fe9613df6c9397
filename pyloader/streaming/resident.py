"""Which layers stay resident: a count, a fraction, a byte budget or an explicit set."""

from __future__ import annotations

import warnings

from .._util.sizes import RESIDENT_FORMS, format_bytes, parse_bytes, parse_resident
from ..errors import ResidencyWarning

PLACEMENTS = ("first_n", "last_n", "interleaved")


def choose_resident(layer_bytes: list[int], resident, placement: str,
                    fixed_bytes: int = 0, stream_buffer: int = 0) -> set[int]:
    """Indices of the layers to keep resident.

    Args:
        layer_bytes: Bytes of each layer's weights, in order.
        resident: An int (a layer count: ``1`` keeps one layer, and warns
            (:class:`pyloader.ResidencyWarning`) that every layer is ``1.0`` or
            ``"all"``; ``"1layer"`` says one layer without the warning), a float in
            [0, 1] (a fraction of the layers), a str as
            :func:`pyloader._util.sizes.parse_resident` reads it (``"25%"``,
            ``"4layers"``, ``"all"``), a byte budget (a str with its unit: ``"600MB"``,
            ``"4096B"``) for all weights in memory at once — ``fixed_bytes`` (non-layer
            weights, always resident) is spent first, then, unless every layer fits,
            ``stream_buffer`` (the streamed units in flight), then resident layers — or
            an explicit set (or list/tuple) of layer indices
            (as chosen by :func:`pyloader.residency.plan`; ``placement`` is then unused).
            A bare number in a str (``"3"``: layers or bytes?) is refused; ``"0"`` is
            none. A byte budget smaller than the weights that are always in memory
            (``fixed_bytes`` + ``stream_buffer``) keeps no layer and warns
            (:class:`pyloader.ResidencyWarning`) that it cannot be honoured.
        placement: ``"first_n"``, ``"last_n"`` or ``"interleaved"``.
    """
    n_layers = len(layer_bytes)
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    order = list(range(n_layers))
    if placement == "last_n":
        order.reverse()
    elif placement == "interleaved":
        order = interleaved_order(n_layers)

    if isinstance(resident, (set, frozenset, list, tuple)):
        chosen = set(resident)
        bad = [i for i in chosen if not isinstance(i, int) or not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"resident layer indices {sorted(map(str, bad))} are not in "
                             f"range({n_layers})")
        return chosen
    if isinstance(resident, bool):
        raise TypeError(f"resident must be {RESIDENT_FORMS}, not a bool")
    counted = False  # a count written with its unit ("1layer"): no warning about the int 1
    if isinstance(resident, str):
        text = resident.strip()
        if text.isdigit() and int(text) != 0:
            raise ValueError(
                f"resident={resident!r} is ambiguous: a bare number in a str is neither a "
                f"layer count nor a byte budget; write '{text}layers' for {text} layers, "
                f"'{text}B' (or '{text}MB') for a byte budget, or a fraction of the layers "
                "as a float (0.5) or a percentage ('50%')")
        amount = parse_resident(text)
        if not isinstance(amount, str):
            counted = isinstance(amount, int)
            resident = amount
    if isinstance(resident, int):
        if not 0 <= resident <= n_layers:
            raise ValueError(f"resident={resident} is a layer count (an int), but the model "
                             f"has {n_layers} layers; a fraction is a float in [0, 1] "
                             "(resident=0.5) or a str ('50%'), a byte budget a str ('600MB')")
        if resident == 1 and n_layers > 1 and not counted:
            warnings.warn(ResidencyWarning(
                f"resident=1 (the int) keeps one layer of {n_layers} in memory and streams "
                "the rest; every layer is resident=1.0 or 'all' (pass '1layer' for one "
                "layer without this warning)"), stacklevel=4)
        count = resident
    elif isinstance(resident, float):
        if not 0.0 <= resident <= 1.0:
            hint = (f"for {int(resident)} layers pass the int {int(resident)} or "
                    f"'{int(resident)}layers'" if resident.is_integer() and resident > 1
                    else "a layer count is an int (resident=4) or a str ('4layers')")
            raise ValueError(f"resident={resident} is a fraction of the layers (a float) and "
                             f"must be in [0, 1]; {hint}")
        count = round(resident * n_layers)
    elif isinstance(resident, str):
        asked = parse_bytes(resident)
        budget = asked - fixed_bytes
        if sum(layer_bytes) > budget:
            budget -= stream_buffer  # something streams: its buffers come first
        if budget < 0:
            warnings.warn(ResidencyWarning(
                f"the weight budget of {format_bytes(asked)} cannot be honoured: the "
                "weights outside the layers "
                f"(embeddings, final norm, head: {format_bytes(fixed_bytes)}) are always in "
                f"memory and the streamed layers need {format_bytes(stream_buffer)} of "
                f"buffers, {format_bytes(fixed_bytes + stream_buffer)} in all; every layer is "
                "streamed and that much stays in memory"), stacklevel=4)
        count = 0
        for i in order:
            if budget < layer_bytes[i]:
                break
            budget -= layer_bytes[i]
            count += 1
    else:
        raise TypeError(f"resident must be {RESIDENT_FORMS}, or a set of layer indices; "
                        f"got {type(resident).__name__}")
    return set(order[:count])


def interleaved_order(n: int) -> list[int]:
    """An order whose every prefix of length k is spread evenly over range(n)."""
    order: list[int] = []
    seen: set[int] = set()
    k = 1
    while len(order) < n:
        for j in range(k):
            i = min(n - 1, (2 * j + 1) * n // (2 * k))
            if i not in seen:
                seen.add(i)
                order.append(i)
        k *= 2
    return order
