"""Byte sizes as text, both ways."""

from __future__ import annotations

import re

_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
               "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10,
               "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"600MB"`` → 600000000, ``"1.5GiB"``, ``"2G"``, ``"4096"``: decimal (kB/MB/GB/TB, k/M/G/T)
    and binary (KiB/MiB/GiB/TiB) units, case-insensitive."""
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
    """A byte budget as ``resident=`` text, rounded down (never up) to the coarsest unit keeping
    three digits and not below ``floor``: ``1234567890`` → ``"1234MB"``."""
    n = max(0, int(n))
    for unit, size in (("MB", 10**6), ("kB", 10**3)):
        if n >= 100 * size and n // size * size >= floor:
            return f"{n // size}{unit}"
    return f"{n}B"


def format_size(n: int) -> str:
    """An exact binary size as a short name: ``1073741824`` → ``"1GiB"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def parse_amount(text: str):
    """A command-line amount as ``StreamOptions.experts`` takes it: ``"3"`` → 3 (a count),
    ``"0.25"`` → 0.25 (a fraction), anything else (``"600MB"``, ``"layer"``) → the text."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text
