"""On-disk cache of calibrations, one JSON file per key under ``calibration/``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .._util.fs import cache_dir, write_atomic
from .cost import Calibration


def _calibration_file(key: str) -> Path:
    return cache_dir("calibration") / f"{key}.json"


#: How long a calibration measured under contention is reused (seconds).
CONTENDED_LIFETIME_S = 3600.0


def load_calibration(key: str, *, expired: bool = False) -> Calibration | None:
    """The calibration cached under ``key``, or None (expired contended unless ``expired``)."""
    f = _calibration_file(key)
    if not f.exists():
        return None
    try:
        cal = Calibration.from_dict(json.loads(f.read_text()))
    except (ValueError, TypeError, KeyError):
        return None
    if not expired and cal.detail.get("contended") and \
            time.time() - cal.measured_at > CONTENDED_LIFETIME_S:
        return None
    return cal


def save_calibration(cal: Calibration) -> Calibration:
    """Cache ``cal``; a contended one expires and never replaces a settled one."""
    if cal.detail.get("contended"):
        cal.detail["expires_at"] = cal.measured_at + CONTENDED_LIFETIME_S
        old = load_calibration(cal.key, expired=True)
        if old is not None and not old.detail.get("contended"):
            return cal
    write_atomic(_calibration_file(cal.key), json.dumps(cal.to_dict(), indent=1))
    return cal
