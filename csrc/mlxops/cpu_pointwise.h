// pyloader's row-wise and element-wise CPU kernels (kernels/pointwise.h) as
// MLX operations on the CPU stream: the steps of a layer around its products,
// which MLX's CPU backend computes as several ops each, converting 16-bit
// floats element by element.
#pragma once

#include <cstdint>
#include <optional>

#include "mlx/array.h"

namespace pyloader {

// mx.fast.rms_norm(x, weight, eps) for float32, float16 or bfloat16 x and
// weight (1-D, x's last dimension): float64 inside, rounded once to the
// result's dtype (the promotion of x's and the weight's, as MLX's).
mlx::core::array cpu_rms_norm(const mlx::core::array& x,
                              const std::optional<mlx::core::array>& weight, float eps);

// mx.fast.rope(x, dims, traditional=, base=, scale=, offset=) for a float32,
// float16 or bfloat16 x of at least 3 dimensions (positions along the
// second-to-last): float64 angles and rotation, rounded once to x's dtype.
mlx::core::array cpu_rope(const mlx::core::array& x, int dims, bool traditional, float base,
                          float scale, int64_t offset);

// silu(gate) * x (mlx-lm's swiglu) for gate and x of one shape and one
// float dtype, rounded once.
mlx::core::array cpu_swiglu(const mlx::core::array& gate, const mlx::core::array& x);

}  // namespace pyloader
