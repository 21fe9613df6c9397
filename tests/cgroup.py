"""The tests' memory cgroups: :mod:`pyloader.bench.cgroup`, and the interpreter to run
children with."""

from __future__ import annotations

import sys

from pyloader.bench.cgroup import MemoryCgroup, unavailable_reason

__all__ = ["PYTHON", "MemoryCgroup", "unavailable_reason"]

PYTHON = sys.executable
