#include "mlxops/cpu_ops.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <vector>
#include <stdexcept>
#include <string>

#include "kernels/kernels.h"
#include "mlxops/cpu_common.h"
#include "mlxops/cpu_gather.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace pyloader {

using namespace cpu_ops_detail;

namespace {

// x flattened to (rows, k).
int64_t rows_of(const mx::array& x) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < static_cast<int>(x.ndim()); i++) rows *= x.shape(i);
  return rows;
}

// The one primitive behind every op here. inputs: x, w, [scales, [biases]]
// (quantized when bits > 0; biases in the affine mode), [indices] (with a gather
// plan: each batch element times the expert its index names, one product per
// expert; without: one product of x's rows).
class CpuMatmul : public mx::Primitive {
 public:
  CpuMatmul(mx::Stream stream, int group_size, int bits, kernels::QuantMode mode,
            std::optional<GatherPlan> plan)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        mode_(mode),
        plan_(std::move(plan)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs[0],
                 [group_size = group_size_, bits = bits_, mode = mode_, plan = plan_](
                     const std::vector<mx::array>& ins, mx::array& out) {
                   run(ins, out, group_size, bits, mode, plan);
                 });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[pyloader.kernels] pyloader's matmul kernels run on the CPU only");
  }
  const char* name() const override { return "PyloaderCpuMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && mode_ == o.mode_ &&
           plan_.has_value() == o.plan_.has_value() &&
           (!plan_ || plan_->batch == o.plan_->batch);
  }

 private:
  static void run(const std::vector<mx::array>& ins, mx::array& out, int group_size, int bits,
                  kernels::QuantMode mode, const std::optional<GatherPlan>& plan) {
    const bool quantized = bits > 0;
    const bool with_biases = quantized && mode == kernels::QuantMode::Affine;
    const mx::array &x = ins[0], &w = ins[1];
    kernels::DType xt, wt = kernels::DType::F32, ot;
    kernel_dtype(x.dtype(), &xt);
    kernel_dtype(quantized ? ins[2].dtype() : w.dtype(), &wt);  // uint8 exponents: unused
    kernel_dtype(out.dtype(), &ot);
    std::vector<uint8_t> xs, ws, ss, bs;
    const auto* xp = static_cast<const uint8_t*>(row_major(x, xs));
    const auto* wp = static_cast<const uint8_t*>(row_major(w, ws));
    const auto* sp = quantized ? static_cast<const uint8_t*>(row_major(ins[2], ss)) : nullptr;
    const auto* bp = with_biases ? static_cast<const uint8_t*>(row_major(ins[3], bs)) : nullptr;
    auto* op = static_cast<uint8_t*>(out.data<void>());
    // One product: `rows` rows of activations at xs times the matrix at wo/so.
    auto product_from = [&](const uint8_t* xs, int64_t rows, int64_t wo, int64_t so, void* o) {
      const int64_t n = w.shape(-2);
      const kernels::Activations a{xs, xt, rows, x.shape(-1)};
      if (quantized) {
        kernels::quantized_matmul(a,
                               kernels::QuantizedWeights{
                                   reinterpret_cast<const uint32_t*>(wp + wo), sp + so,
                                   bp ? bp + so : nullptr, wt, n, bits, group_size, mode},
                               kernels::Output{o, ot});
      } else {
        kernels::dense_matmul(a, kernels::DenseWeights{wp + wo, wt, n}, kernels::Output{o, ot});
      }
    };
    if (!plan) return product_from(xp, rows_of(x), 0, 0, op);
    std::vector<uint8_t> is;
    const int64_t n = w.shape(1), m = x.shape(-2);
    const int64_t w_bytes = n * w.shape(2) * static_cast<int64_t>(w.itemsize());
    const int64_t s_bytes =
        quantized ? n * ins[2].shape(2) * static_cast<int64_t>(ins[2].itemsize()) : 0;
    const mx::array& idx = ins.back();
    run_gathered(*plan,
                 {xp, m, m * x.shape(-1) * static_cast<int64_t>(dtype_bytes(xt)), op,
                  m * n * static_cast<int64_t>(dtype_bytes(ot)), m * n, ot, idx,
                  row_major(idx, is), w.shape(0)},
                 [&](const uint8_t* xs, int64_t rows, int64_t e, void* o) {
                   product_from(xs, rows, e * w_bytes, e * s_bytes, o);
                 });
  }

  int group_size_, bits_;
  kernels::QuantMode mode_;
  std::optional<GatherPlan> plan_;
};

// The mode's name as MLX spells it; std::invalid_argument for one the kernels
// do not compute.
kernels::QuantMode quant_mode(const char* op, const std::string& mode) {
  if (mode == "affine") return kernels::QuantMode::Affine;
  if (mode == "mxfp4") return kernels::QuantMode::Mxfp4;
  shape_error(op, "quantization mode '" + mode + "' is not one the kernels compute "
                  "(affine, mxfp4)");
}

// Checks a quantized product's scales (and biases) against the mode: the inputs
// the primitive takes after x and w, and the result's dtype.
std::vector<mx::array> scale_inputs(const char* op, const mx::array& x, const mx::array& scales,
                                    const std::optional<mx::array>& biases,
                                    kernels::QuantMode mode, mx::Dtype* dtype) {
  if (mode == kernels::QuantMode::Mxfp4) {
    if (scales.dtype() != mx::uint8)
      shape_error(op, "mxfp4 scales must be uint8 exponents");
    if (biases) shape_error(op, "mxfp4 has no biases: pass None");
    *dtype = x.dtype();
    return {scales};
  }
  require_dtype(op, "scales", scales.dtype());
  if (!biases) shape_error(op, "the affine mode needs biases");
  if (biases->dtype() != scales.dtype())
    shape_error(op, "biases and scales must have one dtype");
  if (biases->shape() != scales.shape())
    shape_error(op, "biases " + shape_str(biases->shape()) + " and scales " +
                        shape_str(scales.shape()) + " must have one shape");
  *dtype = mx::promote_types(x.dtype(), scales.dtype());
  return {scales, *biases};
}

mx::Shape out_shape(const mx::array& x, int n) {
  mx::Shape s = x.shape();
  s.back() = n;
  return s;
}

// What both quantized ops check and derive: w packs (..., n, k) of `bits` bits
// in uint32 words (`w_ndim` dimensions), scales are w's leading shape by k's
// groups; the primitive's inputs and the result's dtype.
struct QuantizedCall {
  kernels::QuantMode mode;
  mx::Dtype dtype;
  std::vector<mx::array> inputs;
};

QuantizedCall check_quantized(const char* op, const mx::array& x, const mx::array& w,
                              const mx::array& scales, const std::optional<mx::array>& biases,
                              int group_size, int bits, const std::string& mode_name,
                              int w_ndim) {
  require_dtype(op, "x", x.dtype());
  QuantizedCall call{quant_mode(op, mode_name), x.dtype(), {x, w}};
  for (auto& a : scale_inputs(op, x, scales, biases, call.mode, &call.dtype))
    call.inputs.push_back(a);
  if (!kernels::quantized_supported(call.mode, bits, group_size))
    shape_error(op, "bits=" + std::to_string(bits) + ", group_size=" + std::to_string(group_size) +
                        " is not an " + mode_name + " format the kernels compute");
  if (w.dtype() != mx::uint32 || static_cast<int>(w.ndim()) != w_ndim)
    shape_error(op, "w must be a " + std::to_string(w_ndim) + "-D uint32 array" +
                        (w_ndim == 3 ? " (experts, n, packed k)" : "") + ", got " +
                        shape_str(w.shape()));
  if (static_cast<int>(x.ndim()) < w_ndim - 1)
    shape_error(op, "x must have at least " +
                        std::string(w_ndim == 3 ? "two dimensions" : "one dimension"));
  const int64_t k = static_cast<int64_t>(w.shape(-1)) * 32 / bits;
  if (x.shape(-1) != k)
    shape_error(op, "x's last dimension is " + std::to_string(x.shape(-1)) + " but w " +
                        shape_str(w.shape()) + " holds rows of " + std::to_string(k) +
                        " values at " + std::to_string(bits) + " bits");
  mx::Shape expect(w.shape().begin(), w.shape().end() - 1);
  expect.push_back(static_cast<int>(k / group_size));
  if (k % group_size != 0 || scales.shape() != expect)
    shape_error(op, "scales " + shape_str(scales.shape()) + " must be " + shape_str(expect) +
                        " for w " + shape_str(w.shape()) +
                        " with group_size=" + std::to_string(group_size));
  return call;
}

}  // namespace

mx::array cpu_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                               const std::optional<mx::array>& biases, int group_size, int bits,
                               const std::string& mode_name) {
  QuantizedCall call =
      check_quantized("quantized_matmul", x, w, scales, biases, group_size, bits, mode_name, 2);
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape(x, w.shape(0)), call.dtype,
                   std::make_shared<CpuMatmul>(s, group_size, bits, call.mode, std::nullopt),
                   std::move(call.inputs));
}

mx::array cpu_gather_quantized_matmul(const mx::array& x, const mx::array& w,
                                      const mx::array& scales,
                                      const std::optional<mx::array>& biases,
                                      const mx::array& indices, int group_size, int bits,
                                      const std::string& mode_name) {
  const char* op = "gather_quantized_matmul";
  check_indices(op, indices);
  QuantizedCall call =
      check_quantized(op, x, w, scales, biases, group_size, bits, mode_name, 3);
  GatherPlan plan = gather_plan(op, mx::Shape(x.shape().begin(), x.shape().end() - 2),
                                indices.shape());
  const mx::Shape shape = gathered_shape(plan, x, w.shape(1));
  call.inputs.push_back(indices);
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, call.dtype,
                   std::make_shared<CpuMatmul>(s, group_size, bits, call.mode, std::move(plan)),
                   std::move(call.inputs));
}

mx::array cpu_gather_dense_matmul(const mx::array& x, const mx::array& w,
                                  const mx::array& indices) {
  const char* op = "gather_dense_matmul";
  require_dtype(op, "x", x.dtype());
  require_dtype(op, "w", w.dtype());
  check_indices(op, indices);
  if (w.ndim() != 3) shape_error(op, "w must be 3-D (experts, n, k), got " + shape_str(w.shape()));
  if (x.ndim() < 2) shape_error(op, "x must have at least two dimensions");
  if (x.shape(-1) != w.shape(2))
    shape_error(op, "x's last dimension is " + std::to_string(x.shape(-1)) + " but w is " +
                        shape_str(w.shape()));
  GatherPlan plan = gather_plan(op, mx::Shape(x.shape().begin(), x.shape().end() - 2),
                                indices.shape());
  const mx::Shape shape = gathered_shape(plan, x, w.shape(1));
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::promote_types(x.dtype(), w.dtype()),
                   std::make_shared<CpuMatmul>(s, 0, 0, kernels::QuantMode::Affine,
                                               std::move(plan)),
                   {x, w, indices});
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
  return mx::array(out_shape(x, w.shape(0)), dtype,
                   std::make_shared<CpuMatmul>(s, 0, 0, kernels::QuantMode::Affine, std::nullopt),
                   {x, w});
}

namespace {

// Attention over strided views: the kernel reads q, k, v and the mask where
// they lie (inside the dispatched task, when they are computed).
class CpuAttention : public mx::Primitive {
 public:
  CpuAttention(mx::Stream stream, float scale, bool causal, bool has_mask)
      : mx::Primitive(stream), scale_(scale), causal_(causal), has_mask_(has_mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs[0],
                 [scale = scale_, causal = causal_, has_mask = has_mask_](
                     const std::vector<mx::array>& ins, mx::array& out) {
                   run(ins, out, scale, causal, has_mask);
                 });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[pyloader.kernels] pyloader's attention kernel runs on the CPU only");
  }
  const char* name() const override { return "PyloaderCpuAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_;
  }

 private:
  // a's data and element strides of its 4 dimensions: in place when its last
  // dimension is contiguous (or of one element), else a row-major copy in scratch.
  static const void* strided(const mx::array& a, std::vector<uint8_t>& scratch, int64_t st[4]) {
    if (a.strides()[3] == 1 || a.shape(3) <= 1) {
      for (int d = 0; d < 4; d++) st[d] = a.strides()[d];
      return a.data<void>();
    }
    const void* data = row_major(a, scratch);
    st[3] = 1;
    for (int d = 3; d-- > 0;) st[d] = st[d + 1] * a.shape(d + 1);
    return data;
  }
  static kernels::AttentionView view(const mx::array& a, std::vector<uint8_t>& scratch) {
    int64_t st[4];
    const void* data = strided(a, scratch, st);
    return {data, {st[0], st[1], st[2]}};
  }

  static void run(const std::vector<mx::array>& ins, mx::array& out, float scale, bool causal,
                  bool has_mask) {
    const mx::array &q = ins[0], &k = ins[1], &v = ins[2];
    std::vector<uint8_t> qs, ks, vs, ms;
    kernels::Attention a{};
    kernel_dtype(q.dtype(), &a.dtype);
    a.batch = q.shape(0);
    a.q_heads = q.shape(1);
    a.q_len = q.shape(2);
    a.head_dim = q.shape(3);
    a.kv_heads = k.shape(1);
    a.kv_len = k.shape(2);
    a.value_dim = v.shape(3);
    a.q = view(q, qs);
    a.k = view(k, ks);
    a.v = view(v, vs);
    a.scale = scale;
    a.causal = causal;
    a.mask = kernels::Mask::None;
    if (has_mask) {
      const mx::array& m = ins[3];
      a.mask = m.dtype() == mx::bool_ ? kernels::Mask::Bool : kernels::Mask::Additive;
      if (m.dtype() != mx::bool_) kernel_dtype(m.dtype(), &a.mask_dtype);
      a.mask_data = strided(m, ms, a.mask_stride);
    }
    a.out = out.data<void>();
    kernels::attention(a);
  }

  float scale_;
  bool causal_, has_mask_;
};

}  // namespace

mx::array cpu_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                        bool causal, const std::optional<mx::array>& mask) {
  const char* op = "attention";
  require_dtype(op, "q", q.dtype());
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype())
    shape_error(op, "q, k and v must have one dtype");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    shape_error(op, "q, k and v must be 4-D (batch, heads, length, dim)");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0))
    shape_error(op, "q " + shape_str(q.shape()) + ", k " + shape_str(k.shape()) + " and v " +
                        shape_str(v.shape()) + " must have one batch size");
  if (k.shape(3) != q.shape(3) || v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2))
    shape_error(op, "k " + shape_str(k.shape()) + " must match q " + shape_str(q.shape()) +
                        " in its last dimension and v " + shape_str(v.shape()) +
                        " in heads and length");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    shape_error(op, "q's " + std::to_string(q.shape(1)) + " heads must be a multiple of k's " +
                        std::to_string(k.shape(1)));
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    if (mask->dtype() != mx::bool_) require_dtype(op, "mask", mask->dtype());
    const mx::Shape full{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    if (mask->ndim() > 4) shape_error(op, "mask has more than 4 dimensions");
    mx::array m = mask->ndim() < 4 ? mx::reshape(*mask, [&] {
      mx::Shape sh(4 - mask->ndim(), 1);
      sh.insert(sh.end(), mask->shape().begin(), mask->shape().end());
      return sh;
    }(), s) : *mask;
    for (int d = 0; d < 4; d++)
      if (m.shape(d) != full[d] && m.shape(d) != 1)
        shape_error(op, "mask " + shape_str(mask->shape()) + " does not broadcast to " +
                            shape_str(full));
    inputs.push_back(mx::broadcast_to(m, full, s));
  }
  mx::Shape out_shape{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  return mx::array(out_shape, q.dtype(),
                   std::make_shared<CpuAttention>(s, scale, causal, mask.has_value()),
                   std::move(inputs));
}

}  // namespace pyloader
