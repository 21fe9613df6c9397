// ggml's block formats as MLX operations: the bytes of a GGUF tensor (a uint8
// array, normally a view of the mapped file) multiplied or dequantized where
// they lie by the kernels (kernels/ggml_impl.h).
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/ggml_blocks.h"
#include "kernels/kernels.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlxops/cpu_common.h"
#include "mlxops/cpu_gather.h"
#include "mlxops/cpu_ops.h"

namespace mx = mlx::core;

namespace pyloader {

using namespace cpu_ops_detail;

namespace {

// inputs: x and blocks (matmul), x, stacked blocks and indices (a gathered
// matmul, with its plan), or blocks (dequantize).
class CpuGgml : public mx::Primitive {
 public:
  CpuGgml(mx::Stream stream, kernels::GgmlType type, int64_t k, bool matmul,
          std::optional<GatherPlan> plan = std::nullopt)
      : mx::Primitive(stream), type_(type), k_(k), matmul_(matmul), plan_(std::move(plan)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs[0],
                 [type = type_, k = k_, matmul = matmul_, plan = plan_](
                     const std::vector<mx::array>& ins, mx::array& out) {
                   run(ins, out, type, k, matmul, plan);
                 });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[pyloader.kernels] pyloader's ggml kernels run on the CPU only");
  }
  const char* name() const override {
    return plan_ ? "PyloaderCpuGgmlGatherMatmul"
                 : matmul_ ? "PyloaderCpuGgmlMatmul" : "PyloaderCpuGgmlDequantize";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuGgml&>(other);
    return type_ == o.type_ && k_ == o.k_ && matmul_ == o.matmul_ &&
           plan_.has_value() == o.plan_.has_value() && (!plan_ || plan_->batch == o.plan_->batch);
  }

 private:
  static void run(const std::vector<mx::array>& ins, mx::array& out, kernels::GgmlType type,
                  int64_t k, bool matmul, const std::optional<GatherPlan>& plan) {
    const mx::array& blocks = ins[matmul ? 1 : 0];
    // Row-contiguous blocks (checked when built if already computed) are read in
    // place; a lazy input that turned out strided is gathered.
    std::vector<uint8_t> bs, xs;
    const auto* bp = static_cast<const uint8_t*>(row_major(blocks, bs));
    const int64_t row_bytes = blocks.shape(-1);
    const int64_t n = row_bytes ? static_cast<int64_t>(blocks.size()) / row_bytes : 0;
    if (!matmul) return kernels::ggml_dequantize({bp, type, n, row_bytes}, k, out.data<float>());
    const mx::array& x = ins[0];
    kernels::DType xt;
    kernel_dtype(x.dtype(), &xt);
    const auto* xp = static_cast<const uint8_t*>(row_major(x, xs));
    auto* op = static_cast<uint8_t*>(out.data<void>());
    if (!plan) {
      const int64_t rows = k ? static_cast<int64_t>(x.size()) / k : 0;
      return kernels::ggml_matmul({xp, xt, rows, k}, {bp, type, n, row_bytes}, {op, xt});
    }
    // Stacked (experts, n, row_bytes): expert e's rows follow e * n rows in.
    std::vector<uint8_t> is;
    const int64_t experts = blocks.shape(0), expert_n = blocks.shape(1), m = x.shape(-2);
    const int64_t item = static_cast<int64_t>(dtype_bytes(xt));
    const mx::array& idx = ins[2];
    run_gathered(*plan,
                 {xp, m, m * k * item, op, m * expert_n * item, m * expert_n, xt, idx,
                  row_major(idx, is), experts},
                 [&](const uint8_t* x_rows, int64_t rows, int64_t e, void* o) {
                   kernels::ggml_matmul({x_rows, xt, rows, k},
                                        {bp + e * expert_n * row_bytes, type, expert_n, row_bytes},
                                        {o, xt});
                 });
  }

  kernels::GgmlType type_;
  int64_t k_;
  bool matmul_;
  std::optional<GatherPlan> plan_;
};

// The checks both ops make on the blocks: uint8, whole rows in place, rows of
// the bytes k values of the type take. The type.
kernels::GgmlType check_blocks(const char* op, const mx::array& blocks,
                               const std::string& ggml_type, int64_t k, int min_ndim) {
  const kernels::GgmlType type = kernels::parse_ggml_type(ggml_type);
  const kernels::GgmlFormat& f = kernels::ggml_format(type);
  if (blocks.dtype() != mx::uint8)
    shape_error(op, "blocks must be uint8 (the tensor's bytes as the file stores them)");
  if (static_cast<int>(blocks.ndim()) < min_ndim)
    shape_error(op, "blocks must be " + std::string(min_ndim == 2 ? "2-D (n, row_bytes)" :
                                                    "at least 1-D (..., row_bytes)") +
                        ", got " + shape_str(blocks.shape()));
  if (k < 0 || k % f.block_elems != 0)
    shape_error(op, "k=" + std::to_string(k) + " is not a multiple of " + f.name +
                        "'s block of " + std::to_string(f.block_elems) + " values");
  const int64_t expect = k / f.block_elems * f.block_bytes;
  if (blocks.shape(-1) != expect)
    shape_error(op, "blocks " + shape_str(blocks.shape()) + " have rows of " +
                        std::to_string(blocks.shape(-1)) + " bytes, but k=" + std::to_string(k) +
                        " values of " + f.name + " take " + std::to_string(expect) + " bytes (" +
                        std::to_string(k / f.block_elems) + " blocks of " +
                        std::to_string(f.block_bytes) + ")");
  if (blocks.status() != mx::array::Status::unscheduled && !blocks.flags().row_contiguous)
    shape_error(op, "blocks must be row-contiguous (whole rows as the file stores them), "
                    "got a strided view");
  return type;
}

}  // namespace

mx::array cpu_ggml_matmul(const mx::array& x, const mx::array& blocks,
                          const std::string& ggml_type, int64_t k) {
  const char* op = "ggml_matmul";
  const kernels::GgmlType type = check_blocks(op, blocks, ggml_type, k, 2);
  require_dtype(op, "x", x.dtype());
  if (blocks.ndim() != 2) shape_error(op, "blocks must be 2-D (n, row_bytes), got " +
                                              shape_str(blocks.shape()));
  if (x.ndim() < 1 || x.shape(-1) != k)
    shape_error(op, "x " + shape_str(x.shape()) + " must be (..., k) with k=" +
                        std::to_string(k));
  mx::Shape shape = x.shape();
  shape.back() = blocks.shape(0);
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, x.dtype(), std::make_shared<CpuGgml>(s, type, k, true), {x, blocks});
}

mx::array cpu_gather_ggml_matmul(const mx::array& x, const mx::array& blocks,
                                 const std::string& ggml_type, int64_t k,
                                 const mx::array& indices) {
  const char* op = "gather_ggml_matmul";
  if (blocks.ndim() != 3)
    shape_error(op, "blocks must be 3-D (experts, n, row_bytes), got " +
                        shape_str(blocks.shape()));
  const kernels::GgmlType type = check_blocks(op, blocks, ggml_type, k, 1);
  require_dtype(op, "x", x.dtype());
  check_indices(op, indices);
  if (x.ndim() < 2 || x.shape(-1) != k)
    shape_error(op, "x " + shape_str(x.shape()) + " must be (..., m, k) with k=" +
                        std::to_string(k));
  GatherPlan plan = gather_plan(op, mx::Shape(x.shape().begin(), x.shape().end() - 2),
                                indices.shape());
  const mx::Shape shape = gathered_shape(plan, x, blocks.shape(1));
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, x.dtype(),
                   std::make_shared<CpuGgml>(s, type, k, true, std::move(plan)),
                   {x, blocks, indices});
}

mx::array ggml_dequantize(const mx::array& blocks, const std::string& ggml_type, int64_t k) {
  const kernels::GgmlType type = check_blocks("ggml_dequantize", blocks, ggml_type, k, 1);
  mx::Shape shape = blocks.shape();
  shape.back() = static_cast<int>(k);
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<CpuGgml>(s, type, k, false), {blocks});
}

std::vector<std::string> ggml_block_types() {
  std::vector<std::string> out;
  for (auto t : kernels::ggml_types()) out.emplace_back(kernels::ggml_type_name(t));
  return out;
}

}  // namespace pyloader
