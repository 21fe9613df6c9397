"""pyloader's CPU kernels called directly on MLX arrays, and the SIMD level they run at.

:mod:`pyloader.kernels` installs them under a model's modules; these are the same
functions one by one, for measuring them (the source tree's ``bench/``) against MLX's
ops and against each other at every level this CPU has (``kernel_isas()``;
``set_kernel_isa(level)`` switches, ``kernel_isa()`` reads the current one).

``cpu_ggml_matmul``, ``cpu_gather_ggml_matmul`` (a stack of experts) and ``ggml_dequantize``
compute a GGUF tensor's ggml block formats (``ggml_block_types()``) from its bytes as the
file stores them, read in place.
"""

from ._core import (
    cpu_attention,
    cpu_dense_matmul,
    cpu_gather_ggml_matmul,
    cpu_ggml_matmul,
    cpu_quantized_matmul,
    cpu_rms_norm,
    cpu_rope,
    cpu_swiglu,
    ggml_block_types,
    ggml_dequantize,
    kernel_isa,
    kernel_isas,
    set_kernel_isa,
)

__all__ = ["cpu_attention", "cpu_dense_matmul", "cpu_gather_ggml_matmul", "cpu_ggml_matmul",
           "cpu_quantized_matmul", "cpu_rms_norm", "cpu_rope", "cpu_swiglu", "ggml_block_types",
           "ggml_dequantize", "kernel_isa", "kernel_isas", "set_kernel_isa"]
