"""The tests' memory cgroups: :mod:`benchlib.cgroup` (bench/), and the interpreter to run
children with."""

from __future__ import annotations

import sys

from benchlib.cgroup import MemoryCgroup, unavailable_reason

__all__ = ["PYTHON", "MemoryCgroup", "unavailable_reason"]

PYTHON = sys.executable
