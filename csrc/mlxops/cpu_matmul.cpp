#include "mlxops/cpu_matmul.h"

#include <cstring>
#include <sstream>
#include <vector>
#include <stdexcept>
#include <string>

#include "kernels/kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace pyloader {

namespace {

bool kernel_dtype(mx::Dtype t, kernels::DType* out) {
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

kernels::DType require_dtype(const char* op, const char* what, mx::Dtype t) {
  kernels::DType out;
  if (!kernel_dtype(t, &out)) {
    std::ostringstream msg;
    msg << "[pyloader.kernels." << op << "] " << what << " has dtype " << t
        << "; the kernels take float32, float16 or bfloat16";
    throw std::invalid_argument(msg.str());
  }
  return out;
}

std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); i++) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

[[noreturn]] void shape_error(const char* op, const std::string& detail) {
  throw std::invalid_argument(std::string("[pyloader.kernels.") + op + "] " + detail);
}

// An input's bytes in row-major order, inside the dispatched task: the array's
// own memory when it is row-contiguous (MLX's views of a mapped file are), else
// a gathered copy held in `scratch`. (mx::contiguous would copy any view of a
// much larger buffer, which is every weight pyloader maps.)
const void* row_major(const mx::array& a, std::vector<uint8_t>& scratch) {
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

// x flattened to (rows, k).
int64_t rows_of(const mx::array& x) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); i++) rows *= x.shape(i);
  return rows;
}

class CpuAffineMatmul : public mx::Primitive {
 public:
  CpuAffineMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    // Pointers are taken inside the task, when the inputs are computed.
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      w = mx::array::unsafe_weak_copy(inputs[1]),
                      scales = mx::array::unsafe_weak_copy(inputs[2]),
                      biases = mx::array::unsafe_weak_copy(inputs[3]),
                      out = mx::array::unsafe_weak_copy(out), group_size = group_size_,
                      bits = bits_]() mutable {
      kernels::DType xt, st, ot;
      kernel_dtype(x.dtype(), &xt);
      kernel_dtype(scales.dtype(), &st);
      kernel_dtype(out.dtype(), &ot);
      std::vector<uint8_t> xs, ws, ss, bs;
      const kernels::Activations a{row_major(x, xs), xt, rows_of(x), x.shape(-1)};
      const kernels::AffineWeights q{static_cast<const uint32_t*>(row_major(w, ws)),
                                     row_major(scales, ss), row_major(biases, bs), st,
                                     w.shape(0), bits, group_size};
      kernels::affine_matmul(a, q, kernels::Output{out.data<void>(), ot});
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[pyloader.kernels] the affine matmul kernel runs on the CPU only");
  }
  const char* name() const override { return "PyloaderAffineMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuAffineMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_, bits_;
};

class CpuDenseMatmul : public mx::Primitive {
 public:
  explicit CpuDenseMatmul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      w = mx::array::unsafe_weak_copy(inputs[1]),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
      kernels::DType xt, wt, ot;
      kernel_dtype(x.dtype(), &xt);
      kernel_dtype(w.dtype(), &wt);
      kernel_dtype(out.dtype(), &ot);
      std::vector<uint8_t> xs, ws;
      const kernels::Activations a{row_major(x, xs), xt, rows_of(x), x.shape(-1)};
      kernels::dense_matmul(a, kernels::DenseWeights{row_major(w, ws), wt, w.shape(0)},
                            kernels::Output{out.data<void>(), ot});
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[pyloader.kernels] the dense matmul kernel runs on the CPU only");
  }
  const char* name() const override { return "PyloaderDenseMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::Shape out_shape(const mx::array& x, int n) {
  mx::Shape s = x.shape();
  s.back() = n;
  return s;
}

}  // namespace

mx::array cpu_affine_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                            const mx::array& biases, int group_size, int bits) {
  const char* op = "affine_matmul";
  require_dtype(op, "x", x.dtype());
  require_dtype(op, "scales", scales.dtype());
  if (biases.dtype() != scales.dtype())
    shape_error(op, "biases and scales must have one dtype");
  if (!kernels::affine_supported(bits, group_size))
    shape_error(op, "bits=" + std::to_string(bits) + ", group_size=" + std::to_string(group_size) +
                        " is not an affine format the kernels compute");
  if (w.dtype() != mx::uint32 || w.ndim() != 2)
    shape_error(op, "w must be a 2-D uint32 array, got " + shape_str(w.shape()));
  if (x.ndim() < 1) shape_error(op, "x must have at least one dimension");
  const int64_t n = w.shape(0), k = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  const int64_t groups = k / group_size;
  if (x.shape(-1) != k)
    shape_error(op, "x's last dimension is " + std::to_string(x.shape(-1)) + " but w " +
                        shape_str(w.shape()) + " holds rows of " + std::to_string(k) +
                        " values at " + std::to_string(bits) + " bits");
  if (k % group_size != 0 || scales.shape() != mx::Shape{static_cast<int>(n), static_cast<int>(groups)} ||
      biases.shape() != scales.shape())
    shape_error(op, "scales " + shape_str(scales.shape()) + " and biases " +
                        shape_str(biases.shape()) + " must be (" + std::to_string(n) + ", " +
                        std::to_string(groups) + ") for w " + shape_str(w.shape()) +
                        " with group_size=" + std::to_string(group_size));
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  const mx::Dtype dtype = mx::promote_types(x.dtype(), scales.dtype());
  return mx::array(out_shape(x, static_cast<int>(n)), dtype,
                   std::make_shared<CpuAffineMatmul>(s, group_size, bits),
                   {x, w, scales, biases});
}

mx::array cpu_dense_matmul(const mx::array& x, const mx::array& w) {
  const char* op = "dense_matmul";
  require_dtype(op, "x", x.dtype());
  require_dtype(op, "w", w.dtype());
  if (w.ndim() != 2) shape_error(op, "w must be 2-D, got " + shape_str(w.shape()));
  if (x.ndim() < 1) shape_error(op, "x must have at least one dimension");
  if (x.shape(-1) != w.shape(1))
    shape_error(op, "x's last dimension is " + std::to_string(x.shape(-1)) + " but w is " +
                        shape_str(w.shape()));
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  const mx::Dtype dtype = mx::promote_types(x.dtype(), w.dtype());
  return mx::array(out_shape(x, w.shape(0)), dtype, std::make_shared<CpuDenseMatmul>(s),
                   {x, w});
}

}  // namespace pyloader
