"""pyloader's SIMD, multi-threaded CPU kernels in place of MLX's ops, module by module.

:func:`install` swaps a model's quantized/float linear layers, expert layers, attention,
RMSNorm, RoPE and SwiGLU for subclasses that run pyloader's kernels on the CPU; anything the
kernels do not take keeps MLX's op and is listed in the :class:`KernelReport`. Results are
not bit-identical to MLX's (float32 accumulation). See docs/kernels.md.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from dataclasses import dataclass, field

import mlx.core as mx
from mlx import nn

from ._native import core
from ._util.hooks import add_hook, get_hook, own_class, remove_hook, set_own_class

KERNELS = ("auto", "mlx")
ENV = "PYLOADER_KERNELS"


def default_choice() -> str:
    """``load_model``'s ``kernels`` when not given: ``$PYLOADER_KERNELS`` or ``"auto"``."""
    value = os.environ.get(ENV, "").strip() or "auto"
    return check_choice(value, source=ENV)


def check_choice(kernels: str, *, source: str = "kernels") -> str:
    """``kernels`` itself, or ValueError when it is not one of :data:`KERNELS`."""
    if kernels not in KERNELS:
        raise ValueError(f"{source}={kernels!r}: expected one of {KERNELS}")
    return kernels


def on_cpu() -> bool:
    """The default device is the CPU: the kernels' products run there."""
    return mx.default_device() == mx.cpu


def effective_choice(kernels: str | None = None) -> str:
    """The kernels a model loaded now with ``kernels`` (None: :func:`default_choice`)
    computes with: ``"mlx"`` when the default device is not the CPU."""
    choice = default_choice() if kernels is None else check_choice(kernels)
    return choice if on_cpu() else "mlx"


#: The quantization modes the kernels compute, and whether the mode has biases.
_MODES = {"affine": True, "mxfp4": False}
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
#: The index dtypes the gathered products take (MLX's gather ops take any integer).
_INDICES = (mx.uint32, mx.int32, mx.uint64, mx.int64)


def _mode(module) -> str:
    return getattr(module, "mode", "affine")


def _biases(module):
    """The module's biases, or None in a mode without them (mxfp4)."""
    return module["biases"] if _MODES.get(_mode(module)) else None


def _packed_k(module) -> int:
    """The input width of a quantized module's packed rows."""
    return module["weight"].shape[-1] * 32 // module.bits


# Inputs the kernels take (csrc/mlxops/cpu_ops.cpp checks the same); others go to MLX's op.
def _takes_x(x, k: int, ndim: int = 1) -> bool:
    """``x`` is activations of ``ndim`` or more dimensions and width ``k`` the
    kernels take."""
    return (isinstance(x, mx.array) and x.dtype in _FLOATS and x.ndim >= ndim
            and x.shape[-1] == k)


def _takes_indices(x, indices) -> bool:
    """``indices`` are integers the gathered kernels take, whose shape broadcasts with
    ``x``'s batch shape."""
    if not isinstance(indices, mx.array) or indices.dtype not in _INDICES:
        return False
    a, b = x.shape[:-2], indices.shape
    return all(p == q or p == 1 or q == 1 for p, q in zip(a[::-1], b[::-1]))


class CpuQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` computed by pyloader's kernel on the CPU."""

    def __call__(self, x):
        if not on_cpu() or not _takes_x(x, _packed_k(self)):
            return super().__call__(x)
        y = core.cpu_quantized_matmul(x, self["weight"], self["scales"], _biases(self),
                                   self.group_size, self.bits, _mode(self))
        if "bias" in self:
            y = y + self["bias"]
        return y


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` runs pyloader's kernel on the CPU."""

    def as_linear(self, x):
        if not on_cpu() or not _takes_x(x, _packed_k(self)):
            return super().as_linear(x)
        return core.cpu_quantized_matmul(x, self["weight"], self["scales"], _biases(self),
                                      self.group_size, self.bits, _mode(self))


class CpuLinear(nn.Linear):
    """``nn.Linear`` computed by pyloader's kernel on the CPU."""

    def __call__(self, x):
        if not on_cpu() or not _takes_x(x, self["weight"].shape[1]):
            return super().__call__(x)
        y = core.cpu_dense_matmul(x, self["weight"])
        if "bias" in self:
            y = y + self["bias"]
        return y


class CpuEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` runs pyloader's kernel on the CPU."""

    def as_linear(self, x):
        if not on_cpu() or not _takes_x(x, self["weight"].shape[1]):
            return super().as_linear(x)
        return core.cpu_dense_matmul(x, self["weight"])


class CpuRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by pyloader's kernel on the CPU."""

    def __call__(self, x):
        if not on_cpu() or not _takes_x(x, self["weight"].shape[0]):
            return super().__call__(x)
        return core.cpu_rms_norm(x, self["weight"], self.eps)


class CpuRoPE(nn.RoPE):
    """``nn.RoPE`` computed by pyloader's kernel on the CPU (for an integer offset, as
    mlx-lm's single-sequence caches give; an array of offsets keeps MLX's op)."""

    def __call__(self, x, offset: int = 0):
        if (not on_cpu() or not isinstance(offset, int) or not isinstance(x, mx.array)
                or x.dtype not in _FLOATS or x.ndim < 3 or self.dims > x.shape[-1]):
            return super().__call__(x, offset)
        return core.cpu_rope(x, self.dims, self.traditional, float(self.base),
                             float(self.scale), offset)


def _switch_classes() -> dict:
    """mlx-lm's expert layers -> pyloader's, when mlx-lm is installed (a model holding
    them was built by it, so it is)."""
    try:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    except ImportError:
        return {}
    if _SWITCH:
        return _SWITCH

    class CpuQuantizedSwitchLinear(QuantizedSwitchLinear):
        """mlx-lm's ``QuantizedSwitchLinear`` computed by pyloader's kernel on the CPU."""

        def __call__(self, x, indices, sorted_indices=False):
            if (not on_cpu() or not _takes_x(x, _packed_k(self), 2)
                    or not _takes_indices(x, indices)):
                return super().__call__(x, indices, sorted_indices)
            y = core.cpu_gather_quantized_matmul(x, self["weight"], self["scales"],
                                              _biases(self), indices, self.group_size,
                                              self.bits, _mode(self))
            if "bias" in self:
                y = y + mx.expand_dims(self["bias"][indices], -2)
            return y

    class CpuSwitchLinear(SwitchLinear):
        """mlx-lm's ``SwitchLinear`` computed by pyloader's kernel on the CPU."""

        def __call__(self, x, indices, sorted_indices=False):
            if (not on_cpu() or not _takes_x(x, self["weight"].shape[2], 2)
                    or not _takes_indices(x, indices)):
                return super().__call__(x, indices, sorted_indices)
            y = core.cpu_gather_dense_matmul(x, self["weight"], indices)
            if "bias" in self:
                y = y + mx.expand_dims(self["bias"][indices], -2)
            return y

    _SWITCH.update({QuantizedSwitchLinear: CpuQuantizedSwitchLinear,
                    SwitchLinear: CpuSwitchLinear})
    return _SWITCH


_SWITCH: dict = {}

#: The hook on a model whose kernels are installed: its attention and ``swiglu`` run ours.
ATTENTION_HOOK = "kernels"


class _Computing(threading.local):
    """How many models with pyloader's kernels are computing on this thread."""

    depth = 0


_COMPUTING = _Computing()


def _computing_hook(module, call, *args, **kwargs):
    _COMPUTING.depth += 1
    try:
        return call(*args, **kwargs)
    finally:
        _COMPUTING.depth -= 1


def _mlx_lm_function(module: str, name: str):
    """mlx-lm's own function ``mlx_lm.models.<module>.<name>`` (even where :func:`install`
    has pointed the name at its dispatch), or None without mlx-lm."""
    try:
        fn = getattr(importlib.import_module(f"mlx_lm.models.{module}"), name)
    except ImportError:
        return None
    return getattr(fn, "pyloader_original", fn)


def _attention_mask(mask, q, k):
    """``(causal, mask array or None)`` for pyloader's kernel, or None when it does not
    take this mask: a bool mask, or an additive one whose dtype promotes to ``q``'s (MLX
    refuses others), of at most 4 dimensions broadcasting to the scores' shape."""
    if mask is None:
        return False, None
    if isinstance(mask, str):
        return (True, None) if mask == "causal" else None
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return None
    # An additive mask promotes to the queries' dtype (or is 16-bit under float32 queries).
    if mask.dtype != mx.bool_ and (mask.dtype not in _FLOATS or (
            mask.dtype != q.dtype and q.dtype != mx.float32)):
        return None
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if not all(m == s or m == 1 for m, s in zip(mask.shape[::-1], scores[::-1])):
        return None
    return False, mask


def _attention_takes(q, k, v) -> bool:
    """Queries, keys and values the attention kernel takes: 4-D, of one float dtype,
    one batch size, one head size for q and k, k and v of one length and head count,
    the query heads a multiple of the key/value heads."""
    return (all(isinstance(a, mx.array) and a.ndim == 4 for a in (q, k, v))
            and q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[3] == q.shape[3]
            and v.shape[1] == k.shape[1] and v.shape[2] == k.shape[2]
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)


def _make_attention(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        """mlx-lm's attention; pyloader's CPU kernel while a model with pyloader's
        kernels computes on the CPU (and the inputs are a kind it takes)."""
        if (_COMPUTING.depth and sinks is None and not hasattr(cache, "bits") and on_cpu()
                and _attention_takes(queries, keys, values)):
            how = _attention_mask(mask, queries, keys)
            if how is not None:
                return core.cpu_attention(queries, keys, values, float(scale),
                                          causal=how[0], mask=how[1])
        return original(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention.pyloader_original = original
    return scaled_dot_product_attention


def _make_swiglu(original):
    def swiglu(gate, x):
        """mlx-lm's ``silu(gate) * x``; pyloader's CPU kernel while a model with
        pyloader's kernels computes on the CPU (gate and x of one shape and float dtype)."""
        if (_COMPUTING.depth and on_cpu() and isinstance(gate, mx.array)
                and isinstance(x, mx.array) and gate.dtype in _FLOATS
                and x.dtype == gate.dtype and x.shape == gate.shape):
            return core.cpu_swiglu(gate, x)
        return original(gate, x)

    swiglu.pyloader_original = original
    return swiglu


def _install_function(model: nn.Module, name: str, original, make) -> list[str]:
    """Points ``name`` in the model code modules that use mlx-lm's ``original`` at
    ``make(original)``, pyloader's dispatch; returns those modules' names."""
    if original is None:
        return []
    names = set()
    for _, module in model.named_modules():
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, name, None) if mod else None
        if fn is original:
            setattr(mod, name, make(original))
        elif getattr(fn, "pyloader_original", None) is not original:
            continue
        names.add(mod.__name__)
    return sorted(names)


# MLX's class -> pyloader's, for exactly these classes (a subclass keeps its own).
_REPLACES = {
    nn.QuantizedLinear: CpuQuantizedLinear,
    nn.QuantizedEmbedding: CpuQuantizedEmbedding,
    nn.Linear: CpuLinear,
    nn.Embedding: CpuEmbedding,
}
# The layers around the products (reported apart from the products).
_ELEMENTWISE = {
    nn.RMSNorm: CpuRMSNorm,
    nn.RoPE: CpuRoPE,
}


def _replacements() -> dict:
    """MLX's class -> pyloader's, for every class :func:`install` replaces."""
    return {**_REPLACES, **_switch_classes(), **_ELEMENTWISE}


def _quantized_unsupported(module, w_ndim: int) -> str | None:
    """Why the quantized kernels would refuse ``module``'s arrays (the checks of
    ``check_quantized`` in csrc/mlxops/cpu_ops.cpp), or None. ``w_ndim``: 2 for a
    linear layer, 3 for a stack of experts."""
    mode = _mode(module)
    if mode not in _MODES or _MODES[mode] != ("biases" in module):
        return f"quantization mode {mode!r}"
    if "global_scale" in module:
        return "a global scale"
    supported = (core.kernel_affine_supported if mode == "affine"
                 else core.kernel_mxfp4_supported)
    if not supported(module.bits, module.group_size):
        return f"{mode} bits={module.bits}, group_size={module.group_size}"
    w, scales = module["weight"], module["scales"]
    if w.dtype != mx.uint32 or w.ndim != w_ndim:
        return f"packed weights {tuple(w.shape)} of dtype {w.dtype}"
    if mode == "affine":
        biases = module["biases"]
        if scales.dtype not in _FLOATS:
            return f"scales of dtype {scales.dtype}"
        if biases.dtype != scales.dtype:
            return f"biases of dtype {biases.dtype} with scales of dtype {scales.dtype}"
        if biases.shape != scales.shape:
            return f"biases {tuple(biases.shape)} with scales {tuple(scales.shape)}"
    elif scales.dtype != mx.uint8:
        return f"mxfp4 scales of dtype {scales.dtype}"
    k = _packed_k(module)
    groups = (*w.shape[:-1], k // module.group_size)
    if (w.shape[-1] * 32) % module.bits or k % module.group_size or scales.shape != groups:
        return (f"scales {tuple(scales.shape)} for packed weights {tuple(w.shape)} at "
                f"bits={module.bits}, group_size={module.group_size}")
    return None


def _float_unsupported(array, what: str, ndim: int) -> str | None:
    """Why the kernels would refuse a float array of ``ndim`` dimensions, or None."""
    if array.dtype not in _FLOATS:
        return f"{what} of dtype {array.dtype}"
    if array.ndim != ndim:
        return f"{what} of shape {tuple(array.shape)}"
    return None


def _unsupported(module, base: type) -> str | None:
    """Why ``module`` (an instance of ``base``) keeps MLX's op, or None. Refuses every
    layer the kernels would refuse at call time, so a replaced module never raises."""
    if base is nn.RoPE:
        dims, base_freq = module.dims, getattr(module, "base", None)
        if not isinstance(dims, int) or dims <= 0 or dims % 2:
            return f"RoPE dims={dims!r}"
        if not isinstance(base_freq, (int, float)) or not isinstance(module.scale,
                                                                     (int, float)):
            return f"RoPE base={base_freq!r}, scale={module.scale!r}"
        return None
    if base is nn.RMSNorm:
        return _float_unsupported(module["weight"], "weight", 1)
    if "scales" in module:
        return _quantized_unsupported(module, 2 if base in _REPLACES else 3)
    return _float_unsupported(module["weight"], "weights", 2 if base in _REPLACES else 3)


@dataclass
class KernelReport:
    """What :func:`install` did to a model.

    Attributes:
        choice: ``"auto"`` or ``"mlx"``.
        isa: The SIMD level the kernels run at (``"amx"``, ``"avx512"``, ``"avx2"``, ...).
        threads: Threads the kernels use (``PYLOADER_KERNEL_THREADS``, else every CPU).
        replaced: Module paths now computed by pyloader's kernels.
        kept: Module path -> why it keeps MLX's op.
        attention: Model code modules whose attention calls can run pyloader's kernel.
        elementwise: Module paths of ``nn.RMSNorm``/``nn.RoPE`` layers now on pyloader's kernels.
        swiglu: Model code modules whose ``swiglu`` calls can run pyloader's kernel.
    """

    choice: str
    isa: str
    threads: int
    replaced: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)
    elementwise: list[str] = field(default_factory=list)
    swiglu: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for a log: how many modules use which kernels."""
        if self.choice == "mlx":
            return "kernels: MLX's own"
        text = (f"kernels: pyloader's ({self.isa}, {self.threads} threads) for "
                f"{len(self.replaced)} modules")
        extra = [f"{len(self.elementwise)} norms and RoPEs"] if self.elementwise else []
        extra += ["attention"] if self.attention else []
        extra += ["SwiGLU"] if self.swiglu else []
        if extra:
            text += ", " * (len(extra) > 1) + ", ".join(extra[:-1]) + " and " + extra[-1]
        if self.kept:
            reasons = sorted(set(self.kept.values()))
            text += f"; {len(self.kept)} keep MLX's ({', '.join(reasons)})"
        return text


def install(model: nn.Module, kernels: str = "auto") -> KernelReport:
    """Compute ``model``'s linear layers, attention, norms, RoPE and SwiGLU with
    pyloader's CPU kernels (``"auto"``) or MLX's own ops (``"mlx"``, undoing an earlier install).

    Modules change class in place (a subclass of MLX's holding the same arrays), so anything
    holding a module keeps working. Safe to call again. Returns a :class:`KernelReport`.
    """
    check_choice(kernels)
    report = KernelReport(choice=kernels, isa=core.kernel_isa(),
                          threads=int(core.kernel_threads()))
    replaces = _replacements()
    restores = {v: k for k, v in replaces.items()}
    for name, module in model.named_modules():
        # A streamed layer's modules may be hook subclasses: the kernels' class goes under them.
        cls = own_class(module)
        if kernels == "mlx":
            if cls in restores:
                set_own_class(module, restores[cls])
            continue
        base = restores.get(cls, cls)
        if base in replaces:
            why = _unsupported(module, base)
            if why is None:
                set_own_class(module, replaces[base])
                (report.elementwise if base in _ELEMENTWISE else report.replaced).append(name)
            else:
                set_own_class(module, base)
                report.kept[name] = why
    if kernels == "mlx":
        if get_hook(model, ATTENTION_HOOK) is not None:
            remove_hook(model, ATTENTION_HOOK)
        return report
    attention = "scaled_dot_product_attention"
    report.attention = _install_function(model, attention, _mlx_lm_function("base", attention),
                                         _make_attention)
    report.swiglu = _install_function(model, "swiglu",
                                      _mlx_lm_function("activations", "swiglu"), _make_swiglu)
    if (report.attention or report.swiglu) and get_hook(model, ATTENTION_HOOK) is None:
        add_hook(model, ATTENTION_HOOK, _computing_hook)
    return report


def installed(model: nn.Module) -> str:
    """``"auto"`` when :func:`install` put pyloader's kernels under some of
    ``model``'s modules and the default device is the CPU, else ``"mlx"``."""
    ours = set(_replacements().values())
    if on_cpu() and any(own_class(m) in ours for _, m in model.named_modules()):
        return "auto"
    return "mlx"


def info() -> dict:
    """The kernels' build and machine: ``{"isa", "isas", "threads"}``."""
    return {"isa": core.kernel_isa(), "isas": list(core.kernel_isas()),
            "threads": int(core.kernel_threads())}


