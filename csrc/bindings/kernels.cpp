// pyloader's CPU kernels as MLX operations (mlxops/cpu_ops.h), and the
// SIMD level they run at (kernels/kernels.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "kernels/kernels.h"
#include "mlxops/cpu_ops.h"
#include "mlxops/cpu_pointwise.h"

namespace mx = mlx::core;
using namespace pyloader;

void init_kernels(nb::module_& m) {
  m.def("cpu_quantized_matmul", &cpu_quantized_matmul, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"),        nb::arg("biases").none(), nb::arg("group_size"), nb::arg("bits"),
        nb::arg("mode") = "affine",
        "x @ dequantize(w).T with pyloader's CPU kernel, as mx.quantized_matmul(..., "
        "transpose=True, mode=mode) computes it (mode 'affine', or 'mxfp4' with biases "
        "None), accumulated in float32, on the CPU stream. Raises ValueError for shapes, "
        "dtypes or formats it does not cover.");
  m.def("cpu_dense_matmul", &cpu_dense_matmul, nb::arg("x"), nb::arg("w"),
        "x @ w.T for a 2-D float32/float16/bfloat16 w with pyloader's CPU kernel, "
        "accumulated in float32, on the CPU stream.");
  m.def("cpu_gather_quantized_matmul", &cpu_gather_quantized_matmul, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases").none(), nb::arg("indices"), nb::arg("group_size"),
        nb::arg("bits"), nb::arg("mode") = "affine",
        "mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, "
        "mode=mode) for stacked (experts, n, k) weights with pyloader's CPU kernel; an "
        "index outside the stack gives NaN for its outputs.");
  m.def("cpu_gather_dense_matmul", &cpu_gather_dense_matmul, nb::arg("x"), nb::arg("w"),
        nb::arg("indices"),
        "mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices) for stacked (experts, n, "
        "k) weights with pyloader's CPU kernel.");
  m.def("cpu_attention", &cpu_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("causal") = false, nb::arg("mask") = nb::none(),
        "mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=...) with "
        "pyloader's CPU kernel (causal=True for mask='causal'; `mask` a bool or additive "
        "array broadcasting to (batch, q_heads, q_len, kv_len)), in float32, rounded once.");
  m.def("cpu_rms_norm", &cpu_rms_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
        "mx.fast.rms_norm(x, weight, eps) with pyloader's CPU kernel: float64 inside, rounded "
        "once to the promotion of x's and the weight's dtypes.");
  m.def("cpu_rope", &cpu_rope, nb::arg("x"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("base"), nb::arg("scale"), nb::arg("offset"),
        "mx.fast.rope(x, dims, traditional=, base=, scale=, offset=) for an integer offset "
        "with pyloader's CPU kernel: float64 angles and rotation, rounded once.");
  m.def("cpu_swiglu", &cpu_swiglu, nb::arg("gate"), nb::arg("x"),
        "silu(gate) * x for gate and x of one shape and float dtype with pyloader's CPU "
        "kernel, rounded once.");
  m.def("cpu_ggml_matmul", &cpu_ggml_matmul, nb::arg("x"), nb::arg("blocks"),
        nb::arg("ggml_type"), nb::arg("k"),
        "x (..., k) @ dequantize(blocks).T for a GGUF tensor's bytes: blocks a uint8 (n, "
        "row_bytes) array in ggml's block format ggml_type (see ggml_block_types()), read in "
        "place, normally a view of the mapped file. Accumulated in float32, rounded once to "
        "x's dtype; on the CPU stream. Raises ValueError for a k that is not a multiple of "
        "the block, rows of the wrong size, non-uint8 or strided blocks, or an unknown type.");
  m.def("cpu_gather_ggml_matmul", &cpu_gather_ggml_matmul, nb::arg("x"), nb::arg("blocks"),
        nb::arg("ggml_type"), nb::arg("k"), nb::arg("indices"),
        "cpu_ggml_matmul for a GGUF tensor of stacked experts, blocks (experts, n, row_bytes), "
        "gathered as mx.gather_qmm(x, ..., rhs_indices=indices) gathers: each element of the "
        "batch (x's leading dimensions broadcast with indices') times the expert its index "
        "names; an index outside the stack gives NaN for that element.");
  m.def("ggml_dequantize", &ggml_dequantize, nb::arg("blocks"), nb::arg("ggml_type"),
        nb::arg("k"),
        "blocks (..., row_bytes) of ggml block format ggml_type as float32 (..., k), exactly "
        "as ggml's reference dequantization computes them; on the CPU stream.");
  m.def("ggml_block_types", &ggml_block_types,
        "The ggml tensor types cpu_ggml_matmul and ggml_dequantize compute, by gguf's names.");
  m.def("kernel_affine_supported", &kernels::affine_supported, nb::arg("bits"),
        nb::arg("group_size"),
        "Whether the CPU kernels compute MLX's affine format at these bits and group size.");
  m.def(
      "kernel_mxfp4_supported",
      [](int bits, int group_size) {
        return kernels::quantized_supported(kernels::QuantMode::Mxfp4, bits, group_size);
      },
      nb::arg("bits"), nb::arg("group_size"),
      "Whether the CPU kernels compute MLX's mxfp4 format at these bits and group size.");
  m.def("kernel_isa", [] { return std::string(kernels::isa_name(kernels::active_isa())); },
        "The SIMD level the CPU kernels run at: 'amx' (avx512 with tile products), 'avx512', "
        "'avx2' or 'baseline' (SSE2 on "
        "x86-64, NEON on aarch64); PYLOADER_KERNEL_ISA chooses another.");
  m.def(
      "kernel_isas",
      [] {
        std::vector<std::string> out;
        for (auto isa : kernels::supported_isas()) out.emplace_back(kernels::isa_name(isa));
        return out;
      },
      "The SIMD levels this build carries and this CPU runs, lowest first.");
  m.def(
      "set_kernel_isa", [](const std::string& name) { kernels::set_isa(kernels::parse_isa(name)); },
      nb::arg("name"), "Run the CPU kernels at `name` (one of kernel_isas()) from now on.");
  m.def("kernel_threads", &kernels::thread_count,
        "Threads the CPU kernels split work over, the calling one included "
        "(PYLOADER_KERNEL_THREADS, else the CPU count).");
}
