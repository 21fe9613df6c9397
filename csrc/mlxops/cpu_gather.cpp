#include "mlxops/cpu_gather.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "mlxops/cpu_common.h"

namespace pyloader::cpu_ops_detail {

GatherPlan gather_plan(const char* op, const mx::Shape& x_batch, const mx::Shape& idx) {
  const size_t nd = std::max(x_batch.size(), idx.size());
  auto padded = [nd](const mx::Shape& s) {
    mx::Shape p(nd - s.size(), 1);
    p.insert(p.end(), s.begin(), s.end());
    return p;
  };
  const mx::Shape xs = padded(x_batch), is = padded(idx);
  GatherPlan plan;
  for (size_t d = 0; d < nd; d++) {
    if (xs[d] != is[d] && xs[d] != 1 && is[d] != 1)
      shape_error(op, "x's batch shape " + shape_str(x_batch) +
                          " does not broadcast with the indices' shape " + shape_str(idx));
    plan.batch.push_back(std::max(xs[d], is[d]));
  }
  int64_t total = 1;
  for (auto d : plan.batch) total *= d;
  std::vector<int64_t> xstride(nd, 0), istride(nd, 0);
  int64_t xa = 1, ia = 1;
  for (size_t d = nd; d-- > 0;) {
    xstride[d] = xs[d] == 1 ? 0 : xa;
    istride[d] = is[d] == 1 ? 0 : ia;
    xa *= xs[d];
    ia *= is[d];
  }
  std::vector<int64_t> index(nd, 0);
  for (int64_t b = 0; b < total; b++) {
    int64_t xo = 0, io = 0;
    for (size_t d = 0; d < nd; d++) xo += index[d] * xstride[d], io += index[d] * istride[d];
    plan.x_offset.push_back(xo);
    plan.index_offset.push_back(io);
    for (size_t d = nd; d-- > 0;) {
      if (++index[d] < plan.batch[d]) break;
      index[d] = 0;
    }
  }
  return plan;
}

namespace {

int64_t index_at(const mx::array& idx, const void* data, int64_t i) {
  switch (idx.dtype()) {
    case mx::uint32:
      return static_cast<const uint32_t*>(data)[i];
    case mx::int32:
      return static_cast<const int32_t*>(data)[i];
    case mx::uint64:
      return static_cast<int64_t>(std::min<uint64_t>(static_cast<const uint64_t*>(data)[i],
                                                     INT64_MAX));
    case mx::int64:
      return static_cast<const int64_t*>(data)[i];
    default:
      return -1;
  }
}

void fill_nan(void* out, kernels::DType t, int64_t count) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < count; i++) {
    if (t == kernels::DType::F32) static_cast<float*>(out)[i] = nan;
    else static_cast<uint16_t*>(out)[i] = t == kernels::DType::F16 ? 0x7e00 : 0x7fc0;
  }
}

}  // namespace

size_t dtype_bytes(kernels::DType t) { return t == kernels::DType::F32 ? 4 : 2; }

void check_indices(const char* op, const mx::array& indices) {
  if (indices.dtype() != mx::uint32 && indices.dtype() != mx::int32 &&
      indices.dtype() != mx::uint64 && indices.dtype() != mx::int64)
    shape_error(op, "indices must be integers, got another dtype");
}

mx::Shape gathered_shape(const GatherPlan& plan, const mx::array& x, int n) {
  mx::Shape s = plan.batch;
  s.push_back(x.shape(-2));
  s.push_back(n);
  return s;
}

void run_gathered(const GatherPlan& plan, const GatheredBatch& b, const ExpertProduct& product) {
  const int64_t batch = static_cast<int64_t>(plan.x_offset.size());
  std::vector<std::pair<int64_t, int64_t>> order;  // (expert, element)
  order.reserve(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; i++) {
    const int64_t e = index_at(b.indices, b.index_data, plan.index_offset[i]);
    if (e < 0 || e >= b.experts) {
      fill_nan(b.out + i * b.o_bytes, b.ot, b.o_count);
      continue;
    }
    order.emplace_back(e, i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& l, const auto& r) { return l.first < r.first; });
  std::vector<uint8_t> block_x, block_o;
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && order[j].first == order[i].first) j++;
    const int64_t e = order[i].first, count = static_cast<int64_t>(j - i);
    const int64_t first = order[i].second;
    bool adjacent = true;
    for (size_t t = i + 1; t < j && adjacent; t++)
      adjacent = order[t].second == order[t - 1].second + 1 &&
                 plan.x_offset[order[t].second] == plan.x_offset[order[t - 1].second] + 1;
    if (adjacent) {
      product(b.x + plan.x_offset[first] * b.x_bytes, count * b.m, e,
              b.out + first * b.o_bytes);
    } else {
      block_x.resize(static_cast<size_t>(count * b.x_bytes));
      block_o.resize(static_cast<size_t>(count * b.o_bytes));
      for (int64_t t = 0; t < count; t++)
        std::memcpy(block_x.data() + t * b.x_bytes,
                    b.x + plan.x_offset[order[i + t].second] * b.x_bytes, b.x_bytes);
      product(block_x.data(), count * b.m, e, block_o.data());
      for (int64_t t = 0; t < count; t++)
        std::memcpy(b.out + order[i + t].second * b.o_bytes, block_o.data() + t * b.o_bytes,
                    b.o_bytes);
    }
    i = j;
  }
}

}  // namespace pyloader::cpu_ops_detail
