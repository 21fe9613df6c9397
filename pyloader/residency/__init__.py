"""Residency planning, throughput prediction and the memory-pressure monitor.

* :mod:`.budget`: a model's memory numbers (weights per layer, KV per token,
  activations, runtime reserve) from its checkpoint index or its config;
* :mod:`.cost`: the cost model of one streamed forward pass (a simulation of the
  controller's schedule);
* :mod:`.formats`: what a model's matrix products compute in (activation dtype,
  quantization, shapes): the key of a machine calibration;
* :mod:`.calibration`: the cost model's measured constants on a checkpoint, or from
  :mod:`.machine`'s probes without one; cached on disk by :mod:`.calibration_cache`
  (never when measured under contention);
* :mod:`.planner`: :func:`plan` (the resident set for a budget and a KV cache
  (:class:`KVSpec`), with its memory table and predicted tok/s) and :func:`load_planned`;
* :mod:`.monitor`: :class:`PressureMonitor` (sheds and re-admits layers under memory
  pressure) and :func:`shed_layers` / :func:`admit_layers`.

The memory probes (MemAvailable, the process's cgroup, PSI) are
:func:`pyloader._util.memory.read_memory`, re-exported here as :func:`read_memory`.
"""

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
