"""What a model's matrix products compute in: a machine calibration's key."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._util.names import layer_of
from ..io.checkpoint import Checkpoint
from ..kernels import effective_choice
from .budget import ModelBudget

FLOATS = ("float16", "bfloat16", "float32")


#: The machine probe's largest streamed unit (its probe file holds four).
MAX_UNIT_MIB = 128


@dataclass(frozen=True)
class ComputeFormat:
    """The matrix products of a model's decode and prefill steps.

    Attributes:
        weights, activation: Dtypes of the weights (or scales) and of the activations.
        bits, group_size, mode: The quantization (None: dense weights).
        shapes: ``(out, in)`` of the matrices the probe multiplies.
        unit_bytes, unit_tensors: Size of one streamed unit (MiB-rounded) and its ranges.
        kernels: ``"auto"``, ``"mlx"``, or None (:func:`pyloader.kernels.effective_choice`).
    """

    weights: str
    activation: str
    bits: int | None = None
    group_size: int | None = None
    mode: str = "affine"
    shapes: tuple[tuple[int, int], ...] = ((4096, 4096),)
    unit_bytes: int = 32 << 20
    unit_tensors: int = 1
    kernels: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "kernels", effective_choice(self.kernels))
        for what, dt in (("weights", self.weights), ("activation", self.activation)):
            if dt not in FLOATS:
                raise ValueError(f"{what} dtype must be one of {FLOATS}, got {dt!r}")
        if (self.bits is None) != (self.group_size is None):
            raise ValueError("bits and group_size go together")
        if not self.shapes or any(o < 1 or i < 1 for o, i in self.shapes):
            raise ValueError(f"shapes must be (out, in) pairs of positive sizes: {self.shapes}")
        if self.unit_bytes < 1 << 20 or self.unit_tensors < 1:
            raise ValueError(f"a unit is at least 1 MiB in at least one tensor, got "
                             f"{self.unit_bytes} bytes in {self.unit_tensors}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def key(self) -> str:
        """A name for the cache entry: different formats never share one."""
        mode = "" if self.mode == "affine" else self.mode
        q = f"q{self.bits}g{self.group_size}{mode}-" if self.quantized else ""
        shapes = "_".join(f"{o}x{i}" for o, i in self.shapes)
        unit = f"u{self.unit_bytes >> 20}m{self.unit_tensors}t"
        # MLX's products keep their pre-kernels cache key.
        kernels = "-kpyloader" if self.kernels == "auto" else ""
        return f"{q}w{self.weights}-a{self.activation}-{shapes}-{unit}{kernels}"

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "activation": self.activation, "bits": self.bits,
                "group_size": self.group_size, "mode": self.mode,
                "shapes": [list(s) for s in self.shapes], "unit_bytes": self.unit_bytes,
                "unit_tensors": self.unit_tensors, "kernels": self.kernels}


def promote(dtypes) -> str | None:
    """MLX's promotion of float dtypes (float16 with bfloat16 gives float32)."""
    seen = {d for d in dtypes if d in FLOATS}
    if len(seen) > 1:
        return "float32"
    return seen.pop() if seen else None


def model_shapes(budget: ModelBudget) -> tuple[tuple[int, int], ...]:
    """The MLP up/down and attention output projections, as ``(out, in)``."""
    h = budget.hidden_size or 4096
    i = budget.intermediate_size or 4 * h
    return ((i, h), (h, i), (h, h))


_SAFETENSORS_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def _checkpoint_dtypes(ckpt: Checkpoint) -> tuple[str | None, str | None]:
    """(weights, activation) dtypes from a checkpoint's tensors."""
    quantized = {n[: -len(".scales")] for n in ckpt if n.endswith(".scales")}
    by_bytes: dict[str, int] = {}
    met = []
    for t in ckpt.tensors():
        dt, n = _SAFETENSORS_FLOATS.get(t.dtype), t.name
        weight = n.endswith(".weight")
        if dt is None or (weight and n.rsplit(".", 1)[0] in quantized):
            continue  # not floating point, or packed
        norm = weight and "norm" in n.lower()
        if n.endswith(".scales") or (weight and not norm and len(t.shape) >= 2):
            by_bytes[dt] = by_bytes.get(dt, 0) + t.nbytes
        elif not norm:
            continue
        met.append(dt)
    return (max(by_bytes, key=by_bytes.get) if by_bytes else None), promote(met)


def compute_format(budget: ModelBudget, path_or_config: Any = None,
                   kernels: str | None = None) -> ComputeFormat:
    """The :class:`ComputeFormat` of a model, from its checkpoint or else its config."""
    weights = activation = budget.weights_dtype
    q = budget.quantization or {}
    # Without a checkpoint: seven matrices (with scales/biases when quantized), two norms.
    tensors = 7 * (3 if q else 1) + 2
    if isinstance(path_or_config, (str, os.PathLike)):
        p = Path(path_or_config)
        if p.is_dir() and any(p.glob("*.safetensors")):
            ckpt = Checkpoint(p)
            w, a = _checkpoint_dtypes(ckpt)
            weights, activation = w or weights, a or w or activation
            counts = collections.Counter(layer_of(t.name) for t in ckpt.tensors())
            counts.pop(None, None)
            if counts:
                tensors = sorted(counts.values())[len(counts) // 2]
    layers = sorted(b for b in budget.layer_bytes if b > 0)
    layer = layers[len(layers) // 2] if layers else 32 << 20
    unit = max(1, min(MAX_UNIT_MIB, round(layer / 2**20))) << 20
    tensors = max(1, round(tensors * unit / layer))
    return ComputeFormat(weights=weights, activation=activation, bits=q.get("bits"),
                         group_size=q.get("group_size"), mode=q.get("mode", "affine"),
                         shapes=model_shapes(budget), unit_bytes=unit,
                         unit_tensors=tensors, kernels=kernels)
