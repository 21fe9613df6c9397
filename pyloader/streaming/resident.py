"""Which layers stay resident: a count, a fraction, a byte budget or an explicit set."""

from __future__ import annotations

from .._util.sizes import parse_bytes

PLACEMENTS = ("first_n", "last_n", "interleaved")


def choose_resident(layer_bytes: list[int], resident, placement: str,
                    fixed_bytes: int = 0, stream_buffer: int = 0) -> set[int]:
    """Indices of the layers to keep resident.

    Args:
        layer_bytes: Bytes of each layer's weights, in order.
        resident: An int (layer count), a float in [0, 1] (fraction of the
            layers), a byte budget (a str like ``"600MB"``) for all weights in
            memory at once — ``fixed_bytes`` (non-layer weights, always resident)
            is spent first, then, unless every layer fits, ``stream_buffer`` (the
            streamed units in flight), then resident layers — or an explicit set
            (or list/tuple) of layer indices
            (as chosen by :func:`pyloader.residency.plan`; ``placement`` is then unused).
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
        raise TypeError("resident must be an int, a float in [0, 1] or a byte budget string")
    if isinstance(resident, int):
        if not 0 <= resident <= n_layers:
            raise ValueError(f"resident={resident} layers, but the model has {n_layers}")
        count = resident
    elif isinstance(resident, float):
        if not 0.0 <= resident <= 1.0:
            raise ValueError(f"resident fraction must be in [0, 1], got {resident}")
        count = round(resident * n_layers)
    elif isinstance(resident, str):
        budget = parse_bytes(resident) - fixed_bytes
        if sum(layer_bytes) > budget:
            budget -= stream_buffer  # something streams: its buffers come first
        count = 0
        for i in order:
            if budget < layer_bytes[i]:
                break
            budget -= layer_bytes[i]
            count += 1
    else:
        raise TypeError("resident must be an int, a float in [0, 1] or a byte budget string")
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
