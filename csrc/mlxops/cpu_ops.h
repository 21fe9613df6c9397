// pyloader's CPU kernels as MLX operations: each builds an array whose
// primitive runs the kernel on MLX's CPU stream, ordered with MLX's own ops.
// The primitives have no GPU implementation: they are built on the CPU
// stream whatever the default device is.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace pyloader {

// What mx::quantized_matmul(x, w, scales, biases, transpose=true, group_size,
// bits, mode) computes, accumulated in float32: x (..., k) times the
// dequantized (n, k) matrix, transposed. mode "affine" (float scales and
// biases) or "mxfp4" (uint8 exponent scales, no biases; 4 bits, groups of 32).
// The result's dtype is MLX's: the promotion of x's and the scales' dtypes
// (x's for mxfp4). Throws std::invalid_argument for shapes, dtypes or a format
// the kernels do not cover.
mlx::core::array cpu_quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                   const mlx::core::array& scales,
                                   const std::optional<mlx::core::array>& biases,
                                   int group_size, int bits, const std::string& mode = "affine");

// x (..., k) @ w.T for a dense (n, k) float32, float16 or bfloat16 w, as
// nn.Linear computes it without its bias, accumulated in float32.
mlx::core::array cpu_dense_matmul(const mlx::core::array& x, const mlx::core::array& w);

// What mx::gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=true,
// group_size, bits, mode) computes for stacked (experts, n, k) affine
// weights: for each element of the batch shape (x's leading dimensions
// broadcast with indices' shape), x's (m, k) matrix times expert indices[b]'s
// dequantized matrix, transposed. An index outside [0, experts) gives NaN for
// that element's outputs (never a read outside the stack).
mlx::core::array cpu_gather_quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                          const mlx::core::array& scales,
                                          const std::optional<mlx::core::array>& biases,
                                          const mlx::core::array& indices, int group_size,
                                          int bits, const std::string& mode = "affine");

// The same for stacked dense (experts, n, k) weights: mx.gather_mm(x,
// w.swapaxes(-1, -2), rhs_indices=indices), as mlx-lm's SwitchLinear calls it.
mlx::core::array cpu_gather_dense_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                         const mlx::core::array& indices);

// What mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
// computes, for q (batch, q_heads, q_len, d), k (batch, kv_heads, kv_len, d) and
// v (batch, kv_heads, kv_len, dv) of one float dtype, q_heads a multiple of
// kv_heads: `causal` masks as MLX's "causal" does (query i sees keys up to
// i + kv_len - q_len); `mask` (optional; bool keeps a key, a float is added to
// the score) broadcasts to (batch, q_heads, q_len, kv_len). A dropped key scores
// the dtype's lowest finite value, as MLX's does, so a row that keeps no key is
// finite (the mean of the values) and kv_len = 0 gives zeros. Scores, softmax
// and the weighted sum in float32 (float64 for float32 inputs), rounded once to
// q's dtype. k and v are read in place when their last dimension is contiguous
// (a KV cache's views are).
mlx::core::array cpu_attention(const mlx::core::array& q, const mlx::core::array& k,
                               const mlx::core::array& v, float scale, bool causal,
                               const std::optional<mlx::core::array>& mask);

// x (..., k) float32/float16/bfloat16 times the weights of a GGUF tensor in
// ggml's block format `ggml_type` (one of ggml_block_types()), transposed:
// blocks is uint8 (n, row_bytes), row i holding output i's k values as the file
// stores them, read in place (row-contiguous; a strided view already computed
// is refused). Accumulated in float32, rounded once to x's dtype; (..., n).
mlx::core::array cpu_ggml_matmul(const mlx::core::array& x, const mlx::core::array& blocks,
                                 const std::string& ggml_type, int64_t k);

// The same for a GGUF tensor of stacked experts, blocks (experts, n,
// row_bytes), as cpu_gather_quantized_matmul gathers them: for each element of
// the batch shape (x's leading dimensions broadcast with indices' shape), x's
// (m, k) matrix times expert indices[b]'s rows; an index outside [0, experts)
// gives NaN for that element's outputs (never a read outside the stack).
mlx::core::array cpu_gather_ggml_matmul(const mlx::core::array& x, const mlx::core::array& blocks,
                                        const std::string& ggml_type, int64_t k,
                                        const mlx::core::array& indices);

// blocks (..., row_bytes) in ggml's block format as float32 (..., k), exactly
// as ggml's reference dequantization computes them.
mlx::core::array ggml_dequantize(const mlx::core::array& blocks, const std::string& ggml_type,
                                 int64_t k);

// The ggml types those two compute, by gguf's names.
std::vector<std::string> ggml_block_types();

}  // namespace pyloader
