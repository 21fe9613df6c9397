"""Residency planning, speed prediction, pressure monitor. See docs/memory-planning.md."""

from .._util.memory import MemorySnapshot, read_memory
from .._util.sizes import format_bytes, parse_bytes
from .budget import (
    DEFAULT_PREFILL_CHUNK,
    RUNTIME_RESERVE,
    LayerCache,
    MemoryTable,
    ModelBudget,
    model_budget,
)
from .calibration import (
    Calibration,
    cached_calibration,
    calibrate,
    calibrate_loaded,
    calibrate_model,
    decode_steps,
    format_of,
    prefill_time,
)
from .calibration_cache import load_calibration
from .cost import pass_time, predict
from .formats import ComputeFormat, compute_format
from .machine import calibrate_machine, conditions, contention
from .monitor import (
    DEFAULT_HIGH_WATER,
    DEFAULT_LOW_WATER,
    PressureEvent,
    PressureMonitor,
    PressureSettings,
    admit_layers,
    resident_layers,
    shed_layers,
)
from .planner import (
    PRIORITIES,
    Headroom,
    KVSpec,
    Plan,
    choose_layers,
    format_ranges,
    load_planned,
    plan,
    read_strategy,
)

__all__ = [
    "Calibration",
    "ComputeFormat",
    "DEFAULT_HIGH_WATER",
    "DEFAULT_LOW_WATER",
    "DEFAULT_PREFILL_CHUNK",
    "Headroom",
    "KVSpec",
    "LayerCache",
    "MemorySnapshot",
    "MemoryTable",
    "ModelBudget",
    "PRIORITIES",
    "Plan",
    "PressureEvent",
    "PressureMonitor",
    "PressureSettings",
    "RUNTIME_RESERVE",
    "admit_layers",
    "cached_calibration",
    "calibrate",
    "calibrate_loaded",
    "calibrate_machine",
    "calibrate_model",
    "choose_layers",
    "compute_format",
    "conditions",
    "contention",
    "decode_steps",
    "format_bytes",
    "format_of",
    "format_ranges",
    "load_calibration",
    "load_planned",
    "model_budget",
    "parse_bytes",
    "pass_time",
    "plan",
    "predict",
    "prefill_time",
    "read_memory",
    "resident_layers",
    "shed_layers",
    "read_strategy",
]
