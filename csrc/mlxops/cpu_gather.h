// The gathered products (cpu_gather_*_matmul, cpu_gather_ggml_matmul): the
// batch MLX's gather_mm/gather_qmm broadcast, and its run grouped by expert.
// Internal to csrc/mlxops.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/kernels.h"
#include "mlx/array.h"

namespace pyloader::cpu_ops_detail {

namespace mx = mlx::core;

// A gathered batch: the batch shape, and for each element the offsets of its x
// matrix and its index.
struct GatherPlan {
  mx::Shape batch;
  std::vector<int64_t> x_offset, index_offset;  // in matrices and in indices
};

// The broadcast of x's leading dimensions with the indices' shape (MLX's
// rules: trailing alignment, size 1 stretches), with each element's offsets.
GatherPlan gather_plan(const char* op, const mx::Shape& x_batch, const mx::Shape& idx);

// std::invalid_argument unless the indices are 32- or 64-bit integers.
void check_indices(const char* op, const mx::array& indices);

// The result's shape: the batch, then x's (m) rows by n outputs.
mx::Shape gathered_shape(const GatherPlan& plan, const mx::array& x, int n);

size_t dtype_bytes(kernels::DType t);

// One product: `rows` rows of activations at x times expert e's matrix, into o.
using ExpertProduct = std::function<void(const uint8_t* x, int64_t rows, int64_t e, void* o)>;

// Where a gathered batch lies: x's matrices (m rows each, x_bytes apart), the
// output's (o_bytes apart, o_count values of dtype ot each), the indices and
// how many experts there are.
struct GatheredBatch {
  const uint8_t* x;
  int64_t m, x_bytes;
  uint8_t* out;
  int64_t o_bytes, o_count;
  kernels::DType ot;
  const mx::array& indices;
  const void* index_data;
  int64_t experts;
};

// Runs every element of the batch: the elements on one expert as one product,
// so its weights are read once for all of them (and many rows take the prefill
// path). Their x matrices are used in place when adjacent in x and in the
// output (as mlx-lm's sorted SwitchGLU passes them), else gathered into one
// block and the results put back. An index outside [0, experts) gives NaN for
// that element (never a read outside the stack).
void run_gathered(const GatherPlan& plan, const GatheredBatch& b, const ExpertProduct& product);

}  // namespace pyloader::cpu_ops_detail
