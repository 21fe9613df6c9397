// Attention, compiled once per SIMD level after matmul_impl.h (whose vector
// helpers it uses) by matmul_<level>.cpp. One task per (batch, query head,
// block of queries): the scores of a query against every key it sees, a
// float32 softmax, and the weighted sum of the values, rounded once.

#include <cmath>
#include <limits>

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {
namespace {

// Queries of one head a task takes.
constexpr int64_t kAttentionQueries = 16;

// A row of `n` values of dtype t at p, as float32 into dst (n rounded up to the
// vector width with zeros).
void row_to_float(const void* p, DType t, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_row16(p, i, t));
  for (; i < n; i++) dst[i] = scalar_to_float(p, i, t);
  for (; i < padded(n); i++) dst[i] = 0.0f;
}

const void* at(const AttentionView& v, DType t, int64_t b, int64_t h, int64_t i) {
  const int64_t off = b * v.stride[0] + h * v.stride[1] + i * v.stride[2];
  return static_cast<const char*>(v.data) + off * (t == DType::F32 ? 4 : 2);
}

float dot_row(const float* q, const void* k, DType t, int64_t d) {
  vf acc = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc += load(q + i) * load_row16(k, i, t);
  float sum = hsum(acc);
  for (; i < d; i++) sum += q[i] * scalar_to_float(k, i, t);
  return sum;
}

void attend(const Attention& a, int64_t b, int64_t h, int64_t i0, int64_t i1) {
  thread_local std::vector<float> q, scores, acc;
  q.resize(static_cast<size_t>(padded(a.head_dim)));
  scores.resize(static_cast<size_t>(std::max<int64_t>(a.kv_len, 1)));
  acc.resize(static_cast<size_t>(padded(a.value_dim)));
  const int64_t kv_head = h / (a.q_heads / a.kv_heads);
  const int64_t mask_item = a.mask_dtype == DType::F32 ? 4 : 2;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i = i0; i < i1; i++) {
    row_to_float(at(a.q, a.dtype, b, h, i), a.dtype, a.head_dim, q.data());
    const int64_t seen = a.causal ? std::min(a.kv_len, std::max<int64_t>(0, i + a.kv_len - a.q_len + 1))
                                  : a.kv_len;
    const char* mrow = static_cast<const char*>(a.mask_data);
    if (a.mask != Mask::None)
      mrow += (b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2]) *
              (a.mask == Mask::Bool ? 1 : mask_item);
    float top = -inf;
    for (int64_t j = 0; j < seen; j++) {
      float s = a.scale * dot_row(q.data(), at(a.k, a.dtype, b, kv_head, j), a.dtype, a.head_dim);
      if (a.mask == Mask::Bool) {
        if (!mrow[j * a.mask_stride[3]]) s = -inf;
      } else if (a.mask == Mask::Additive) {
        s += scalar_to_float(mrow, j * a.mask_stride[3], a.mask_dtype);
      }
      scores[j] = s;
      top = std::max(top, s);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    const int64_t full = a.value_dim / kLanes * kLanes;
    for (int64_t j = 0; j < seen; j++) {
      // Every score -inf: exp(-inf - -inf) is NaN, and so is the row.
      const float p = std::exp(scores[j] - top);
      if (p == 0.0f) continue;
      total += p;
      const void* vrow = at(a.v, a.dtype, b, kv_head, j);
      const vf pv = splat(p);
      int64_t d = 0;
      for (; d < full; d += kLanes) store(acc.data() + d, load(acc.data() + d) + pv * load_row16(vrow, d, a.dtype));
      for (; d < a.value_dim; d++) acc[d] += p * scalar_to_float(vrow, d, a.dtype);
    }
    if (seen == 0 || top == -inf) total = std::numeric_limits<float>::quiet_NaN();
    const Output out{a.out, a.dtype};
    const int64_t base = ((b * a.q_heads + h) * a.q_len + i) * a.value_dim;
    for (int64_t d = 0; d < a.value_dim; d++) store_out(out, base + d, acc[d] / total);
  }
}

}  // namespace

void attention(const Attention& a) {
  const int64_t blocks = (a.q_len + kAttentionQueries - 1) / kAttentionQueries;
  parallel_for(a.batch * a.q_heads * blocks, [&](int64_t t) {
    const int64_t blk = t % blocks, bh = t / blocks;
    const int64_t i0 = blk * kAttentionQueries;
    attend(a, bh / a.q_heads, bh % a.q_heads, i0, std::min(a.q_len, i0 + kAttentionQueries));
  });
}

}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
