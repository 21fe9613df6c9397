"""Tests that check the operating system's own account (``/proc/self/*`` on Linux) skip,
with the reason printed (``-ra``), where that file does not exist, instead of failing
with FileNotFoundError. (``PYLOADER_NO_PROC`` hides ``/proc`` from pyloader, not from
these checks: they verify pyloader against the kernel.)"""

from __future__ import annotations

import os

import pytest


def proc_reason(*paths: str) -> str | None:
    """Why a check that reads ``paths`` cannot run here, or None when it can."""
    missing = [p for p in paths if not os.path.exists(p)]
    if not missing:
        return None
    return (f"reads {', '.join(missing)}, which this platform does not have "
            "(Linux /proc; pyloader's own figures there come from pyloader._util.host)")


def require_proc(*paths: str) -> None:
    """Skip the calling test when a file it reads under ``/proc`` is missing."""
    reason = proc_reason(*paths)
    if reason is not None:
        pytest.skip(reason)
