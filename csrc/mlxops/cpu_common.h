// Helpers the CPU primitives share (cpu_ops.cpp, cpu_pointwise.cpp): dtype
// mapping, argument errors, row-major access and the dispatch onto MLX's CPU
// stream. Internal to csrc/mlxops.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace pyloader::cpu_ops_detail {

namespace mx = mlx::core;

inline bool kernel_dtype(mx::Dtype t, kernels::DType* out) {
  if (t == mx::float32) {
    *out = kernels::DType::F32;
  } else if (t == mx::float16) {
    *out = kernels::DType::F16;
  } else if (t == mx::bfloat16) {
    *out = kernels::DType::BF16;
  } else {
    return false;
  }
  return true;
}

inline kernels::DType require_dtype(const char* op, const char* what, mx::Dtype t) {
  kernels::DType out;
  if (!kernel_dtype(t, &out)) {
    std::ostringstream msg;
    msg << "[pyloader.kernels." << op << "] " << what << " has dtype " << t
        << "; the kernels take float32, float16 or bfloat16";
    throw std::invalid_argument(msg.str());
  }
  return out;
}

inline std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); i++) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

[[noreturn]] inline void shape_error(const char* op, const std::string& detail) {
  throw std::invalid_argument(std::string("[pyloader.kernels.") + op + "] " + detail);
}

// An input's bytes in row-major order, inside the dispatched task: the array's
// own memory when it is row-contiguous (MLX's views of a mapped file are), else
// a gathered copy held in `scratch`. (mx::contiguous would copy any view of a
// much larger buffer, which is every weight pyloader maps.)
inline const void* row_major(const mx::array& a, std::vector<uint8_t>& scratch) {
  if (a.flags().row_contiguous) return a.data<void>();
  const size_t item = a.itemsize();
  scratch.resize(a.size() * item);
  const int nd = a.ndim();
  std::vector<int64_t> index(static_cast<size_t>(nd), 0);
  const uint8_t* base = a.data<uint8_t>();
  for (size_t i = 0; i < a.size(); i++) {
    int64_t off = 0;
    for (int d = 0; d < nd; d++) off += index[d] * a.strides()[d];
    std::memcpy(scratch.data() + i * item, base + off * static_cast<int64_t>(item), item);
    for (int d = nd - 1; d >= 0; d--) {
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
  return scratch.data();
}

// A primitive's eval_cpu: allocates the output, registers the arrays with MLX's
// CPU command encoder and dispatches task(inputs, output) on its stream. The
// task holds weak copies and takes pointers when it runs (the inputs are
// computed by then); it captures the primitive's settings by value, as the
// primitive may be gone by then.
template <typename Task>
void dispatch_cpu(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out,
                  Task task) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<mx::array> ins;
  for (const auto& in : inputs) ins.push_back(mx::array::unsafe_weak_copy(in));
  encoder.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out),
                    task = std::move(task)]() mutable { task(ins, out); });
}

}  // namespace pyloader::cpu_ops_detail
