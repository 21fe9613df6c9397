#include "mlxops/cpu_pointwise.h"

#include <string>
#include <vector>

#include "kernels/pointwise.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlxops/cpu_common.h"

namespace mx = mlx::core;

namespace pyloader {

using namespace cpu_ops_detail;

namespace {

enum class Op : uint8_t { RmsNorm, Rope, Swiglu };

// The settings of one op; a primitive captures them by value.
struct Params {
  Op op;
  float eps = 0, base = 0, scale = 0;
  int dims = 0;
  bool traditional = false, has_weight = false;
  int64_t offset = 0;
  bool operator==(const Params& o) const {
    return op == o.op && eps == o.eps && base == o.base && scale == o.scale && dims == o.dims &&
           traditional == o.traditional && has_weight == o.has_weight && offset == o.offset;
  }
};

kernels::DType dtype_of(mx::Dtype t) {
  kernels::DType out = kernels::DType::F32;
  kernel_dtype(t, &out);
  return out;
}

void run(const Params& p, const std::vector<mx::array>& ins, mx::array& out) {
  std::vector<uint8_t> s0, s1;
  switch (p.op) {
    case Op::RmsNorm: {
      const mx::array& x = ins[0];
      kernels::RmsNorm a{};
      a.x = row_major(x, s0);
      a.x_dtype = dtype_of(x.dtype());
      a.w = p.has_weight ? row_major(ins[1], s1) : nullptr;
      a.w_dtype = p.has_weight ? dtype_of(ins[1].dtype()) : a.x_dtype;
      a.out = out.data<void>();
      a.out_dtype = dtype_of(out.dtype());
      a.n = x.shape(-1);
      a.rows = a.n != 0 ? static_cast<int64_t>(x.size()) / a.n : 0;
      a.eps = p.eps;
      return kernels::rms_norm(a);
    }
    case Op::Rope: {
      const mx::array& x = ins[0];
      kernels::Rope a{};
      a.dtype = dtype_of(x.dtype());
      a.dim = x.shape(-1);
      a.len = x.shape(-2);
      // A 4-D view with a contiguous last dimension (queries and keys after
      // their transpose) is read in place; anything else as a row-major copy
      // of (1, leading dimensions, len, dim).
      if (x.ndim() == 4 && (x.strides()[3] == 1 || a.dim <= 1)) {
        a.batch = x.shape(0);
        a.heads = x.shape(1);
        a.x = x.data<void>();
        for (int d = 0; d < 3; d++) a.stride[d] = x.strides()[d];
      } else {
        a.batch = 1;
        a.heads = a.len * a.dim != 0 ? static_cast<int64_t>(x.size()) / (a.len * a.dim) : 0;
        a.x = row_major(x, s0);
        a.stride[2] = a.dim;
        a.stride[1] = a.len * a.dim;
        a.stride[0] = a.heads * a.stride[1];
      }
      a.out = out.data<void>();
      a.dims = p.dims;
      a.traditional = p.traditional;
      a.base = p.base;
      a.scale = p.scale;
      a.offset = p.offset;
      return kernels::rope(a);
    }
    case Op::Swiglu:
      return kernels::swiglu(row_major(ins[0], s0), row_major(ins[1], s1),
                             dtype_of(out.dtype()), static_cast<int64_t>(out.size()),
                             out.data<void>());
  }
}

class CpuPointwise : public mx::Primitive {
 public:
  CpuPointwise(mx::Stream stream, Params p) : mx::Primitive(stream), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs[0],
                 [p = p_](const std::vector<mx::array>& ins, mx::array& out) { run(p, ins, out); });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[pyloader.kernels] pyloader's pointwise kernels run on the CPU only");
  }
  const char* name() const override {
    switch (p_.op) {
      case Op::RmsNorm:
        return "PyloaderCpuRmsNorm";
      case Op::Rope:
        return "PyloaderCpuRope";
      default:
        return "PyloaderCpuSwiglu";
    }
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const CpuPointwise&>(other).p_;
  }

 private:
  Params p_;
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

}  // namespace

mx::array cpu_rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  const char* op = "rms_norm";
  require_dtype(op, "x", x.dtype());
  if (x.ndim() < 1) shape_error(op, "x must have at least one dimension");
  Params p{Op::RmsNorm};
  p.eps = eps;
  p.has_weight = weight.has_value();
  std::vector<mx::array> inputs{x};
  mx::Dtype out = x.dtype();
  if (weight) {
    require_dtype(op, "weight", weight->dtype());
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1))
      shape_error(op, "weight " + shape_str(weight->shape()) + " must be (" +
                          std::to_string(x.shape(-1)) + ",), x's last dimension");
    out = mx::promote_types(x.dtype(), weight->dtype());
    inputs.push_back(*weight);
  }
  return mx::array(x.shape(), out, std::make_shared<CpuPointwise>(cpu_stream(), p),
                   std::move(inputs));
}

mx::array cpu_rope(const mx::array& x, int dims, bool traditional, float base, float scale,
                   int64_t offset) {
  const char* op = "rope";
  require_dtype(op, "x", x.dtype());
  if (x.ndim() < 3) shape_error(op, "x must have at least 3 dimensions, got " + shape_str(x.shape()));
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1))
    shape_error(op, "dims=" + std::to_string(dims) + " must be even, positive and at most x's "
                    "last dimension " + std::to_string(x.shape(-1)));
  Params p{Op::Rope};
  p.dims = dims;
  p.traditional = traditional;
  p.base = base;
  p.scale = scale;
  p.offset = offset;
  return mx::array(x.shape(), x.dtype(), std::make_shared<CpuPointwise>(cpu_stream(), p), {x});
}

mx::array cpu_swiglu(const mx::array& gate, const mx::array& x) {
  const char* op = "swiglu";
  require_dtype(op, "gate", gate.dtype());
  if (x.dtype() != gate.dtype()) shape_error(op, "gate and x must have one dtype");
  if (x.shape() != gate.shape())
    shape_error(op, "gate " + shape_str(gate.shape()) + " and x " + shape_str(x.shape()) +
                        " must have one shape");
  return mx::array(x.shape(), x.dtype(), std::make_shared<CpuPointwise>(cpu_stream(), Params{Op::Swiglu}),
                   {gate, x});
}

}  // namespace pyloader
