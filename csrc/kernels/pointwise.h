// The row-wise and element-wise steps of a transformer layer around its
// products: RMS normalization, rotary position embedding and the SiLU-gated
// product of a SwiGLU feed-forward. Pure compute over raw pointers, like the
// products (kernels.h), and like them compiled once per SIMD level
// (pointwise_impl.h) and run at the level dispatch.cpp picks.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace pyloader::kernels {

// out[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps) * w[i] (w optional),
// as mx.fast.rms_norm defines it. The sum of squares, the scale and the
// products are float64; each output is rounded once. x, out: rows x n,
// contiguous.
struct RmsNorm {
  const void* x;
  DType x_dtype;
  const void* w;  // n values, or null for none
  DType w_dtype;
  void* out;
  DType out_dtype;
  int64_t rows, n;
  float eps;
};
void rms_norm(const RmsNorm& a);

// Rotary position embedding as mx.fast.rope(x, dims, traditional, base,
// scale, offset) defines it, over a (batch, heads, len, dim) view whose last
// dimension is contiguous: position t of the len axis is rotated by angles
// (offset + t) * scale * base^(-2i / dims), i < dims / 2, pairing element i
// with i + dims / 2 (or 2i with 2i + 1 when traditional); elements past dims
// are copied. Angles, sines, cosines and the rotation are float64, each
// output rounded once. out: (batch, heads, len, dim), contiguous, of x's dtype.
struct Rope {
  DType dtype;
  int64_t batch, heads, len, dim;
  const void* x;
  int64_t stride[3];  // elements, of the first three dimensions
  void* out;
  int dims;
  bool traditional;
  float base, scale;
  int64_t offset;
};
void rope(const Rope& a);

// out[i] = silu(gate[i]) * x[i] = gate[i] * sigmoid(gate[i]) * x[i] over
// `count` contiguous elements of one dtype, as mlx-lm's swiglu computes it
// (NaN where gate is -inf, as MLX's silu gives), rounded once: in float32 for
// 16-bit dtypes, in float64 for float32.
void swiglu(const void* gate, const void* x, DType dtype, int64_t count, void* out);

}  // namespace pyloader::kernels
