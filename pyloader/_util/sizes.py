"""Byte sizes as text, both ways."""

from __future__ import annotations

import re

_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
               "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10,
               "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"600MB"`` → 600000000, ``"1.5GiB"``, ``"2G"``, ``"4096"``: decimal (kB/MB/GB/TB,
    k/M/G/T) and binary (KiB/MiB/GiB/TiB) units, case-insensitive. ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+|[0-9]+\.)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _BYTE_UNITS:
        raise ValueError(f"cannot parse byte size {text!r} (examples: 600MB, 1.5GiB, 2G)")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def format_bytes(n: float) -> str:
    """``1.5e9`` → ``"1.50 GB"`` (decimal units, as the plan tables print)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def budget_text(n: int, floor: int = 0) -> str:
    """A byte budget as ``resident=`` text, rounded down (never up, so a budget that
    fits still fits) to the coarsest of MB, kB and B that keeps at least three digits
    and does not drop below ``floor`` (what the budget must cover): ``1234567890`` →
    ``"1234MB"``, ``213630`` → ``"213kB"``, with ``floor=213500`` → ``"213630B"``."""
    n = max(0, int(n))
    for unit, size in (("MB", 10**6), ("kB", 10**3)):
        if n >= 100 * size and n // size * size >= floor:
            return f"{n // size}{unit}"
    return f"{n}B"


def format_size(n: int) -> str:
    """An exact binary size as a short name: ``1073741824`` → ``"1GiB"``, ``1500000`` →
    ``"1500000B"`` (for file names)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


#: How to write a resident set, for the messages that refuse an ambiguous one.
RESIDENT_FORMS = ("a fraction of the layers (0.25, 25%, 100%, all, none), a layer count "
                  "with its unit (4layers), or a byte budget (600MB)")


def parse_resident(text: str) -> int | float | str:
    """A resident set as text, as ``--resident`` and ``load_model(resident=)`` take it.

    ``"25%"``, ``"0.25"``, ``"1.0"``, ``"all"`` (1.0), ``"none"``/``"0"`` (0.0): a
    fraction of the layers; ``"4layers"``, ``"4 layers"``, ``"layers=4"``, ``"1layer"``:
    a count (int); ``"600MB"``, ``"1.5GiB"``, ``"4096B"``: a byte budget (returned as the
    text, which ``load_model`` parses); ``"auto"`` as itself. On the command line a bare
    integer of 2 or more is a count (no fraction is larger than 1); ``load_model``
    refuses a bare number in a str before it gets here (layers or bytes?:
    :func:`pyloader.streaming.resident.choose_resident`).

    Raises:
        ValueError: the text is ambiguous or malformed, naming what to write instead:
            ``"1"`` (one layer, or all of them as 1.0?), a decimal above 1 (``"4.0"``:
            a fraction is at most 1), a percentage above 100.
    """
    t = text.strip().lower()
    if t in ("all", "100%"):
        return 1.0
    if t in ("none", "0", "0%", "0.0"):
        return 0.0
    if t == "auto":
        return t
    m = re.fullmatch(r"(?:layers?\s*=\s*([0-9]+)|([0-9]+)\s*layers?)", t)
    if m:
        return int(m.group(1) or m.group(2))
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", t)
    if m:
        pct = float(m.group(1))
        if pct > 100:
            raise ValueError(f"resident {text!r}: a percentage of the layers is at most 100%")
        return pct / 100
    if t.isdigit():
        if int(t) == 1:
            raise ValueError(f"resident {text!r} is ambiguous: write 1layer for one layer, "
                             "or 100% (or all) for every layer")
        return int(t)
    if re.fullmatch(r"[0-9]*\.[0-9]*", t) and t != ".":
        value = float(t)
        if value > 1.0:
            n = int(value) if value.is_integer() else None
            hint = f"{n}layers for {n} layers" if n is not None else "a count like 4layers"
            raise ValueError(f"resident {text!r}: a fraction of the layers is at most 1.0; "
                             f"write {hint}, or a byte budget such as 600MB")
        return value
    try:
        parse_bytes(text)
    except ValueError:
        raise ValueError(f"resident {text!r} is not an amount: write {RESIDENT_FORMS}") from None
    return text.strip()


def parse_amount(text: str):
    """A command-line amount as ``load_model`` takes it: ``"3"`` → 3 (a count), ``"0.25"``
    → 0.25 (a fraction), anything else (``"600MB"``, ``"layer"``) → the text itself."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text
