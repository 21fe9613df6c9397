"""Which layers stay resident: the :class:`Residency` value, parsed once, and the choice of
layers it stands for (a count, a fraction, a byte budget or an explicit set)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from .._util.sizes import format_bytes, parse_bytes
from ..errors import ResidencyWarning

PLACEMENTS = ("first_n", "last_n", "interleaved")

#: How to write a resident set, for the messages that refuse an ambiguous one.
RESIDENT_FORMS = ("a fraction of the layers (0.25, 25%, 100%, all, none), a layer count "
                  "with its unit (4layers), or a byte budget (600MB)")

#: What a :class:`Residency` can be.
KINDS = ("fraction", "count", "bytes", "layers", "auto", "per_rank")


@dataclass(frozen=True)
class Residency:
    """A resident set, parsed once where it enters pyloader (:meth:`parse`,
    :meth:`from_text`).

    Attributes:
        kind: ``"fraction"`` (float in [0, 1]), ``"count"`` (int layers), ``"bytes"`` (int
            budget for all weights), ``"layers"`` (frozenset of indices), ``"auto"`` (budget
            measured at load) or ``"per_rank"`` (tuple of Residency, one per rank).
        value: As ``kind`` says (None for ``"auto"``).
        bare_one: The count was the int ``1`` (:func:`choose_resident` warns).
    """

    kind: str
    value: Any = None
    bare_one: bool = field(default=False, compare=False)  # the same layers either way

    def __post_init__(self) -> None:
        kind, v = self.kind, self.value
        ok = {"fraction": lambda: isinstance(v, float) and 0.0 <= v <= 1.0,
              "count": lambda: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "bytes": lambda: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "layers": lambda: isinstance(v, frozenset),
              "auto": lambda: v is None,
              "per_rank": lambda: (isinstance(v, tuple) and v
                                   and all(isinstance(r, Residency)
                                           and r.kind not in ("auto", "per_rank")
                                           for r in v))}.get(kind)
        if ok is None:
            raise ValueError(f"unknown Residency kind {kind!r}; expected one of {KINDS}")
        if not ok():
            raise ValueError(f"Residency({kind!r}, {v!r}): not a valid {kind} value")

    @classmethod
    def parse(cls, value: Any) -> Residency:
        """A resident set as ``load_model(resident=)`` takes it: an int count, a
        float fraction, a str (``"25%"``, ``"all"``, ``"4layers"``, ``"600MB"``, ``"auto"``; a bare
        number is refused), a set of layer indices, a per-rank list, or a Residency.

        Raises:
            TypeError: a bool or another type.
            ValueError: an ambiguous or malformed amount, saying what to write.
        """
        if isinstance(value, Residency):
            return value
        if isinstance(value, (set, frozenset)):
            bad = [i for i in value if not isinstance(i, int) or isinstance(i, bool) or i < 0]
            if bad:
                raise ValueError(f"resident layer indices {sorted(map(str, bad))} are not "
                                 "layer indices (ints >= 0)")
            return cls("layers", frozenset(value))
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, str) and v.strip().lower() == "auto" for v in value):
                raise ValueError("resident='auto' gathers every rank's headroom: pass it "
                                 "alone, not in a per-rank list")
            if not value:
                raise ValueError("resident=[]: a per-rank list needs one value per rank")
            ranks = tuple(cls.parse(v) for v in value)
            if any(r.kind == "per_rank" for r in ranks):
                raise ValueError(f"resident={list(value)!r}: a per-rank list holds one "
                                 "value per rank, not lists")
            return cls("per_rank", ranks)
        if isinstance(value, bool):
            raise TypeError(f"resident must be {RESIDENT_FORMS}, not a bool")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"resident={value} is a layer count (an int) and cannot be "
                                 "negative; a fraction is a float in [0, 1] (resident=0.5) "
                                 "or a str ('50%'), a byte budget a str ('600MB')")
            return cls("count", value, bare_one=value == 1)
        if isinstance(value, float):
            if not 0.0 <= value <= 1.0:
                hint = (f"for {int(value)} layers pass the int {int(value)} or "
                        f"'{int(value)}layers'" if value.is_integer() and value > 1
                        else "a layer count is an int (resident=4) or a str ('4layers')")
                raise ValueError(f"resident={value} is a fraction of the layers (a float) "
                                 f"and must be in [0, 1]; {hint}")
            return cls("fraction", value)
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit() and int(text) != 0:
                raise ValueError(
                    f"resident={value!r} is ambiguous: a bare number in a str is neither a "
                    f"layer count nor a byte budget; write '{text}layers' for {text} layers, "
                    f"'{text}B' (or '{text}MB') for a byte budget, or a fraction of the "
                    "layers as a float (0.5) or a percentage ('50%')")
            return _from_text(value)
        raise TypeError(f"resident must be {RESIDENT_FORMS}, or a set of layer indices; "
                        f"got {type(value).__name__}")

    @classmethod
    def from_text(cls, text: str) -> Residency:
        """A resident set from the command line's ``--resident``: as
        :meth:`parse` reads a str, except a bare integer >= 2 is a layer count and a bare ``1`` is
        refused.

        Raises:
            ValueError: ambiguous or malformed text, naming what to write instead.
        """
        t = text.strip()
        if t.isdigit() and int(t) != 0:
            if int(t) == 1:
                raise ValueError(f"resident {text!r} is ambiguous: write 1layer for one "
                                 "layer, or 100% (or all) for every layer")
            return cls("count", int(t))
        return _from_text(text)

    @classmethod
    def of_bytes(cls, n: int) -> Residency:
        """A byte budget of ``n`` bytes (at least 0)."""
        return cls("bytes", max(0, int(n)))

    @property
    def is_auto(self) -> bool:
        return self.kind == "auto"

    @property
    def keeps_all(self) -> bool:
        """Every layer, whatever the model (``1.0``, ``"all"``, ``"100%"``)."""
        return self.kind == "fraction" and self.value == 1.0

    def for_rank(self, rank: int, size: int) -> Residency:
        """This rank's value: its entry of a per-rank list, or the value itself.
        Raises ValueError when a per-rank list's length is not ``size``."""
        if self.kind != "per_rank":
            return self
        if len(self.value) != size:
            raise ValueError(f"{len(self.value)} per-rank values for a group of {size} ranks")
        return self.value[rank]

    def __str__(self) -> str:
        """As a user writes it: ``0.5``, ``4layers``, ``600000000B``, ``auto``..."""
        if self.kind == "fraction":
            return repr(self.value)
        if self.kind == "count":
            return f"{self.value}layers"
        if self.kind == "bytes":
            return f"{self.value}B"
        if self.kind == "layers":
            return "{" + ", ".join(map(str, sorted(self.value))) + "}"
        if self.kind == "per_rank":
            return "[" + ", ".join(map(str, self.value)) + "]"
        return "auto"


ALL = Residency("fraction", 1.0)


def _from_text(text: str) -> Residency:
    """A non-bare-number str: a fraction, a count, a byte budget or ``"auto"``."""
    t = text.strip().lower()
    if t in ("all", "100%"):
        return ALL
    if t in ("none", "0", "0%", "0.0"):
        return Residency("fraction", 0.0)
    if t == "auto":
        return Residency("auto")
    m = re.fullmatch(r"(?:layers?\s*=\s*([0-9]+)|([0-9]+)\s*layers?)", t)
    if m:
        return Residency("count", int(m.group(1) or m.group(2)))
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", t)
    if m:
        pct = float(m.group(1))
        if pct > 100:
            raise ValueError(f"resident {text!r}: a percentage of the layers is at most 100%")
        return Residency("fraction", pct / 100)
    if re.fullmatch(r"[0-9]*\.[0-9]*", t) and t != ".":
        value = float(t)
        if value > 1.0:
            n = int(value) if value.is_integer() else None
            hint = f"{n}layers for {n} layers" if n is not None else "a count like 4layers"
            raise ValueError(f"resident {text!r}: a fraction of the layers is at most 1.0; "
                             f"write {hint}, or a byte budget such as 600MB")
        return Residency("fraction", value)
    try:
        n = parse_bytes(text)
    except ValueError:
        raise ValueError(f"resident {text!r} is not an amount: write {RESIDENT_FORMS}") from None
    return Residency("bytes", n)


def choose_resident(layer_bytes: list[int], resident: Residency | Any, placement: str,
                    fixed_bytes: int = 0, stream_buffer: int = 0) -> set[int]:
    """Indices of the layers to keep resident.

    Args:
        layer_bytes: Bytes of each layer's weights, in order.
        resident: A :class:`Residency` (else parsed). The bare int ``1`` warns
            (:class:`pyloader.ResidencyWarning`) when the model has more layers. A byte
            budget pays ``fixed_bytes`` first, then ``stream_buffer`` unless every layer
            fits, then layers; too small a budget keeps no layer and warns. A set of indices
            ignores ``placement``. ``"auto"`` and per-rank values are refused here.
        placement: ``"first_n"``, ``"last_n"`` or ``"interleaved"``.
    """
    resident = Residency.parse(resident)
    n_layers = len(layer_bytes)
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    order = list(range(n_layers))
    if placement == "last_n":
        order.reverse()
    elif placement == "interleaved":
        order = interleaved_order(n_layers)

    kind, value = resident.kind, resident.value
    if kind == "layers":
        bad = [i for i in value if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"resident layer indices {sorted(map(str, bad))} are not in "
                             f"range({n_layers})")
        return set(value)
    if kind == "count":
        if value > n_layers:
            raise ValueError(f"resident={value} is a layer count (an int), but the model "
                             f"has {n_layers} layers; a fraction is a float in [0, 1] "
                             "(resident=0.5) or a str ('50%'), a byte budget a str ('600MB')")
        if resident.bare_one and n_layers > 1:
            warnings.warn(ResidencyWarning(
                f"resident=1 (the int) keeps one layer of {n_layers} in memory and streams "
                "the rest; every layer is resident=1.0 or 'all' (pass '1layer' for one "
                "layer without this warning)"), stacklevel=4)
        count = value
    elif kind == "fraction":
        count = round(value * n_layers)
    elif kind == "bytes":
        budget = value - fixed_bytes
        if sum(layer_bytes) > budget:
            budget -= stream_buffer  # something streams: its buffers come first
        if budget < 0:
            warnings.warn(ResidencyWarning(
                f"the weight budget of {format_bytes(value)} cannot be honoured: the "
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
        raise ValueError(f"resident={resident} must be resolved before layers are chosen: "
                         "'auto' is measured by load_model, a per-rank list needs group=")
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
