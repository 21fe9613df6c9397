"""Memory budget of a model (weights, KV, activations). See docs/memory-planning.md."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .._util.names import layer_of
from .._util.optional import require_mlx_lm
from ..io.checkpoint import MLX_DTYPES, Checkpoint
from ..io.config import check_config_values, read_config_file
from ..kv.plan import working_dtype
from ..streaming.experts import LAYER, cache_memory, cache_slots, expert_modules

#: Bytes a process holds once MLX and mlx-lm are imported and a model has run.
RUNTIME_RESERVE = 256 << 20

#: mlx-lm's generate runs a prompt in chunks of this many tokens (prefill_step_size).
DEFAULT_PREFILL_CHUNK = 2048

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp16": 2, "bf16": 2, "f16": 2,
                "f32": 4, "fp32": 4}


@dataclass(frozen=True)
class LayerCache:
    """What one layer keeps between tokens."""

    kind: str                  # "kv" (grows), "window" (capped), "state" (constant), "none"
    bytes_per_token: int = 0   # kv and window layers, at the budget's KV precision
    window: int | None = None
    state_bytes: int = 0       # constant part (linear-attention state)

    def nbytes(self, context: int) -> int:
        if self.kind == "kv":
            return self.bytes_per_token * context
        if self.kind == "window":
            return self.bytes_per_token * min(context, self.window)
        return self.state_bytes


@dataclass(frozen=True)
class MemoryTable:
    """Bytes of each part at one context length; ``total`` is the peak."""

    context: int
    weights: int
    resident_weights: int
    kv_cache: int
    activations: int
    stream_buffer: int
    runtime: int
    expert_cache: int = 0      # the expert caches (banks or mapped pages), StreamOptions(experts=)

    @property
    def total(self) -> int:
        return (self.resident_weights + self.kv_cache + self.activations + self.stream_buffer
                + self.runtime + self.expert_cache)


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts module: its experts and per-expert bytes of each stacked tensor."""

    path: str
    layer: int
    num_experts: int
    strides: tuple[int, ...]

    @property
    def expert_bytes(self) -> int:
        return sum(self.strides)


@dataclass
class ModelBudget:
    """The memory numbers of one model at one weight and KV precision."""

    source: str                    # "checkpoint" (bytes from the index) or "config"
    name: str
    model_type: str
    weights_dtype: str
    quantization: dict | None
    kv_bits: int | None
    kv_dtype: str
    nonlayer_bytes: int
    layer_bytes: list[int]
    caches: list[LayerCache]
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    max_position_embeddings: int | None
    compute_bytes: int = 0         # weight bytes a decode step multiplies (layers + lm_head)
    extra: dict = field(default_factory=dict)
    #: The model's MoE modules (empty for a dense model).
    expert_layers: list[ExpertLayer] = field(default_factory=list)
    #: ``StreamOptions(experts=...)``: with ``"layer"`` experts count in ``layer_bytes``.
    experts: Any = "layer"
    expert_source: str = "bank"
    #: What it was made from (the ``path_or_config`` of :func:`model_budget`).
    location: Any = field(default=None, repr=False, compare=False)

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def weights_bytes(self) -> int:
        return self.nonlayer_bytes + sum(self.layer_bytes)

    def expert_cache_slots(self) -> list[int]:
        """Slots of each MoE module's cache (empty with ``experts="layer"``)."""
        if self.experts == LAYER or not self.expert_layers:
            return []
        return cache_slots(self.experts, [(e.num_experts, e.strides)
                                          for e in self.expert_layers], self.expert_source)

    @property
    def expert_slots(self) -> int:
        """Largest per-module expert-cache slot count (0 with ``experts="layer"``)."""
        return max(self.expert_cache_slots(), default=0)

    @property
    def expert_cache_bytes(self) -> int:
        """Memory of every expert cache together (exactly what loading allocates)."""
        return sum(cache_memory(self.expert_source, e.strides, n)
                   for e, n in zip(self.expert_layers, self.expert_cache_slots()))

    @property
    def kv_bytes_per_token(self) -> int:
        """Per token, over the layers that keep keys and values (growing or windowed)."""
        return sum(c.bytes_per_token for c in self.caches if c.kind in ("kv", "window"))

    @property
    def kv_layers(self) -> int:
        return sum(1 for c in self.caches if c.kind in ("kv", "window"))

    def kv_bytes(self, context: int) -> int:
        """The whole cache after ``context`` tokens (windows capped, states constant)."""
        return sum(c.nbytes(context) for c in self.caches)

    def activation_bytes(self, context: int, phase: str = "peak",
                         prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
        """Estimated transient bytes of one pass; ``phase``: "decode", "prefill" or "peak"."""
        w = 4 if self.weights_dtype == "float32" else 2
        h, i, v, nh = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_heads
        decode = w * (8 * h + 3 * i) + 4 * nh * max(context, 1) + 8 * v
        p = max(1, min(prefill_chunk, context))
        prefill = p * w * (8 * h + 3 * i) + 4 * nh * p * max(context, 1) + 8 * v
        return {"decode": decode, "prefill": prefill}.get(phase, max(decode, prefill))

    def table(self, context: int, resident: Sequence[int] | None = None,
              runtime: int = RUNTIME_RESERVE, prefetch: int = 1) -> MemoryTable:
        """The memory table at ``context`` tokens with ``resident`` layers (default all)."""
        res = set(range(self.n_layers)) if resident is None else set(resident)
        streamed = [self.layer_bytes[i] for i in range(self.n_layers) if i not in res]
        buf = (prefetch + 1) * max(streamed) if streamed else 0
        return MemoryTable(
            context=context, weights=self.weights_bytes,
            resident_weights=self.nonlayer_bytes + sum(self.layer_bytes[i] for i in res),
            kv_cache=self.kv_bytes(context), activations=self.activation_bytes(context),
            stream_buffer=buf, runtime=runtime, expert_cache=self.expert_cache_bytes)

    def fits(self, budget: int, context: int, resident: Sequence[int] | None = None,
             runtime: int = RUNTIME_RESERVE) -> bool:
        return self.table(context, resident, runtime).total <= budget

    def max_context(self, budget: int, resident: Sequence[int] | None = None,
                    runtime: int = RUNTIME_RESERVE, limit: int | None = None) -> int:
        """The longest context that fits in ``budget`` (0 if none), up to ``limit``."""
        hi = limit or self.max_position_embeddings or (1 << 24)
        # the contexts that fit are 1..answer (memory grows with the context)
        return bisect.bisect_right(range(1, hi + 1), False,
                                   key=lambda c: not self.fits(budget, c, resident, runtime))

    def resident_layer_count(self, budget: int, context: int,
                             runtime: int = RUNTIME_RESERVE) -> int:
        """How many layers can stay resident (smallest first) with the rest streamed."""
        order = sorted(range(self.n_layers), key=lambda i: self.layer_bytes[i])
        fails = (k for k in range(self.n_layers + 1)
                 if not self.fits(budget, context, order[:k], runtime))
        return max(0, next(fails, self.n_layers + 1) - 1)

    def to_dict(self, context: int | None = None) -> dict:
        d = {
            "source": self.source, "name": self.name, "model_type": self.model_type,
            "weights_dtype": self.weights_dtype, "quantization": self.quantization,
            "kv_bits": self.kv_bits, "kv_dtype": self.kv_dtype,
            "weights_bytes": self.weights_bytes, "nonlayer_bytes": self.nonlayer_bytes,
            "layer_bytes": list(self.layer_bytes), "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_layers": self.kv_layers,
            "layer_caches": [c.kind for c in self.caches],
            "max_position_embeddings": self.max_position_embeddings,
            "experts": self.experts, "expert_source": self.expert_source,
            "expert_layers": len(self.expert_layers),
            "expert_slots": self.expert_slots, "expert_cache_bytes": self.expert_cache_bytes,
        }
        if context is not None:
            d["kv_bytes"] = self.kv_bytes(context)
            d["activation_bytes"] = {
                "decode": self.activation_bytes(context, "decode"),
                "prefill_chunk": self.activation_bytes(context, "prefill")}
        return d


def _read_config(path_or_config) -> tuple[dict, Path | None, str]:
    """(config, checkpoint directory or None, name)."""
    if isinstance(path_or_config, dict):
        config = dict(path_or_config)
        check_config_values(config, None)
        return config, None, path_or_config.get("_name_or_path", "config")
    p = Path(path_or_config)
    if p.is_dir():
        cfg, name = p / "config.json", p.name
        if not cfg.exists():
            raise FileNotFoundError(f"{p}: no config.json in the model directory")
        ckpt_dir = p if any(p.glob("*.safetensors")) else None
    elif p.suffix == ".json" or p.name == "config.json":
        cfg, ckpt_dir, name = p, None, p.parent.name or p.stem
    else:
        raise ValueError(f"{p}: expected a model directory or a config.json")
    config = read_config_file(cfg)
    check_config_values(config, str(cfg))
    return config, ckpt_dir, name


def _config_dtype(config: dict) -> str:
    text = config.get("text_config") or {}
    dt = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or \
        text.get("dtype") or "bfloat16"
    dt = str(dt).replace("torch.", "")
    return dt if dt in ("float16", "bfloat16", "float32") else "bfloat16"


def _lazy_model(config: dict, dtype: str, quantization: dict | None):
    """The mlx-lm model a config describes, with lazy (never evaluated) parameters."""
    utils = require_mlx_lm("pyloader.residency.model_budget", "mlx_lm.utils")
    model_cls, args_cls = utils._get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    dt = getattr(mx, dtype)
    model.update(tree_map(lambda p: p.astype(dt) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    if quantization:
        gs, bits = quantization["group_size"], quantization["bits"]
        predicate = getattr(model, "quant_predicate", None)

        def class_predicate(path, module):
            override = quantization.get(path)
            if isinstance(override, (dict, bool)):
                return override
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % gs:
                return False
            return predicate is None or predicate(path, module)

        nn.quantize(model, group_size=gs, bits=bits, mode=quantization.get("mode", "affine"),
                    class_predicate=class_predicate)
    return model, dict(tree_flatten(model.parameters()))


def _kv_slot_bytes(heads: int, kdim: int, vdim: int, dtype_bytes: int,
                   kv_bits: int | None, group_size: int) -> int:
    """Bytes per token of one layer's keys and values (the arena layout of pyloader.kv)."""
    if kv_bits is None:
        return heads * (kdim + vdim) * dtype_bytes
    # packed uint32 values, then scales and biases
    return sum(heads * (d * kv_bits // 32) * 4 + 2 * heads * (d // group_size) * dtype_bytes
               for d in (kdim, vdim))


def _cache_layout(model, kv_bits, kv_dtype_bytes, group_size) -> list[LayerCache]:
    """Each layer's cache from a lazy one-token forward pass (nothing evaluated)."""
    from mlx_lm.models import cache as mc

    caches = model.make_cache() if hasattr(model, "make_cache") else [
        mc.KVCache() for _ in model.layers]
    model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)

    def describe(c) -> LayerCache:
        if isinstance(c, mc.CacheList):
            parts = [describe(s) for s in c.caches]
            kinds = {p.kind for p in parts}
            kind = "kv" if "kv" in kinds else ("window" if "window" in kinds else "state")
            window = max((p.window or 0 for p in parts), default=0) or None
            return LayerCache(kind, sum(p.bytes_per_token for p in parts), window,
                              sum(p.state_bytes for p in parts))
        if isinstance(c, (mc.KVCache, mc.RotatingKVCache)) and c.keys is not None:
            _, h, _, dk = c.keys.shape
            per = _kv_slot_bytes(h, dk, c.values.shape[-1], kv_dtype_bytes or c.keys.dtype.size,
                                 kv_bits, group_size)
            if isinstance(c, mc.RotatingKVCache):
                return LayerCache("window", per, c.max_size)
            return LayerCache("kv", per)
        state = [a for _, a in tree_flatten(getattr(c, "state", [])) if isinstance(a, mx.array)]
        if state:
            return LayerCache("state", state_bytes=sum(a.nbytes for a in state))
        return LayerCache("none")

    return [describe(c) for c in caches]


def model_budget(path_or_config, *, kv_bits: int | None = None,
                 kv_dtype: str | None = None, kv_group_size: int = 64,
                 dtype: str | None = None, quantization: dict | None = None,
                 experts: Any = "layer", expert_source: str = "bank") -> ModelBudget:
    """The memory budget of a model.

    Args:
        path_or_config: model directory, directory/path with a ``config.json``, or a dict.
        kv_bits, kv_dtype: KV quantization (None, 8, 4) and float dtype (default: working).
        dtype, quantization: config only: weight dtype and e.g. ``{"bits": 4}``.
        experts, expert_source: as :func:`pyloader.load_model`'s.

    Raises:
        pyloader.ConfigError: the config holds an impossible size.
    """
    if kv_bits not in (None, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"kv_bits must be None, 8, 4 (or 2, 3, 5, 6); got {kv_bits!r}")
    config, ckpt_dir, name = _read_config(path_or_config)
    if "model_type" not in config:
        raise ValueError(f"{name}: config has no model_type")
    wdtype = dtype or _config_dtype(config)
    if wdtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {wdtype!r}")
    quant = quantization if quantization is not None else (
        config.get("quantization") or config.get("quantization_config"))
    if quant is not None and not {"bits", "group_size"} <= set(quant):
        quant = None  # a foreign quantization_config (e.g. GPTQ) the lazy model cannot express
    structure_cfg = {k: v for k, v in config.items()
                     if k not in ("quantization", "quantization_config")}
    model, params = _lazy_model(structure_cfg, wdtype, quant)
    layers = model.layers
    path_of: dict[int, str] = {}
    for pname, mod in model.named_modules():
        path_of.setdefault(id(mod), pname)

    head = [n for n in params if n.startswith("lm_head.") or ".lm_head." in n]
    lm_head_bytes = sum(params[n].nbytes for n in head)
    if not head:  # tied: the embedding serves as the output projection
        lm_head_bytes = sum(a.nbytes for n, a in params.items() if "embed_tokens" in n)

    n = len(layers)
    ckpt = Checkpoint(ckpt_dir) if ckpt_dir is not None else None

    def nbytes(param: str) -> int:
        return ckpt[param].nbytes if ckpt is not None and param in ckpt else params[param].nbytes

    expert_layers = []
    for i, layer in enumerate(layers):
        for path, module in expert_modules(layer, path_of[id(layer)]):
            names = [f"{path}.{p}" for p, _ in tree_flatten(module.parameters())]
            count = params[names[0]].shape[0]
            expert_layers.append(ExpertLayer(path, i, count,
                                             tuple(nbytes(p) // count for p in names)))
    if experts != LAYER and not expert_layers:
        raise ValueError(f"experts={experts!r}: {name} has no mixture-of-experts modules")
    if ckpt is None:
        source = "config"
        layer_bytes = [sum(a.nbytes for _, a in tree_flatten(layer.parameters()))
                       for layer in layers]
        nonlayer = sum(a.nbytes for a in params.values()) - sum(layer_bytes)
    else:
        source = "checkpoint"
        layer_bytes = [0] * n
        nonlayer = 0
        for t in ckpt.tensors():
            i = layer_of(t.name)
            if i is not None and i < n:
                layer_bytes[i] += t.nbytes
            else:
                nonlayer += t.nbytes
        # the checkpoint's own dtypes (e.g. float32 norms beside f16 scales)
        model.update(tree_unflatten([
            (p, a.astype(MLX_DTYPES[ckpt[p].dtype])) for p, a in params.items()
            if p in ckpt and ckpt[p].dtype in MLX_DTYPES and tuple(ckpt[p].shape) == a.shape]))
    # The dtype make_kv_cache gives the cache: the model's working precision.
    kvd = kv_dtype or str(working_dtype(model)).rsplit(".", 1)[-1]
    if kvd not in _DTYPE_BYTES:
        raise ValueError(f"kv_dtype must be float16, bfloat16 or float32, got {kvd!r}")
    if experts != LAYER:  # the caches hold the experts, outside the layers' bytes
        for e in expert_layers:
            layer_bytes[e.layer] -= e.expert_bytes * e.num_experts
    caches = _cache_layout(model, kv_bits, _DTYPE_BYTES[kvd], kv_group_size)
    args = getattr(model, "args", None)
    text = config.get("text_config") or {}

    def get(key, default=0):
        return next((src[key] for src in (config, text, vars(args) if args is not None else {})
                     if src.get(key) is not None), default)

    return ModelBudget(
        source=source, name=name, model_type=config["model_type"], weights_dtype=wdtype,
        quantization=({"bits": quant["bits"], "group_size": quant["group_size"],
                       **({"mode": quant["mode"]} if quant.get("mode", "affine") != "affine"
                          else {})}
                      if quant else None),
        kv_bits=kv_bits, kv_dtype=kvd if kv_bits is None else f"{kv_bits}-bit",
        nonlayer_bytes=nonlayer, layer_bytes=layer_bytes, caches=caches,
        hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
        vocab_size=get("vocab_size"), num_heads=get("num_attention_heads"),
        max_position_embeddings=get("max_position_embeddings", None),
        compute_bytes=sum(layer_bytes) + lm_head_bytes, expert_layers=expert_layers,
        experts=experts, expert_source=expert_source, location=path_or_config)
