// Attention, compiled once per SIMD level after matmul_impl.h (whose vector
// helpers it uses) by matmul_<level>.cpp. One task per (batch, key/value head,
// block of queries), over every query head that shares the key/value head: the
// scores of each query against every key it sees, the softmax, and the
// weighted sum of the values, in float32 for half-type inputs and float64 for
// float32 ones, rounded once.
//
// A key the causal mask or a bool mask drops scores the lowest finite value of
// the inputs' dtype, as in MLX (which fills with finfo(dtype).min), not -inf:
// where a row keeps a key its dropped keys weigh exp(lowest - top) = 0, and a
// row that keeps none (a padded query, a query before the first key) is the
// mean of every value, as MLX gives, never NaN. NaN stays where MLX has it: a
// row whose every score is -inf through an additive mask.

#include <cmath>
#include <limits>

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {
namespace {

// Queries of each head a task takes (at most).
constexpr int64_t kAttentionQueries = 16;

const void* at(const AttentionView& v, DType t, int64_t b, int64_t h, int64_t i) {
  return element(v.data, b * v.stride[0] + h * v.stride[1] + i * v.stride[2], t);
}

// Keys query i sees: all of them, or with the causal mask those up to
// i + kv_len - q_len.
int64_t keys_seen(const Attention& a, int64_t i) {
  return a.causal ? std::min(a.kv_len, std::max<int64_t>(0, i + a.kv_len - a.q_len + 1))
                  : a.kv_len;
}

// The mask's row for (batch b, query head h, query i); null without a mask.
const char* mask_row(const Attention& a, int64_t b, int64_t h, int64_t i) {
  if (a.mask == Mask::None) return nullptr;
  const int64_t item = a.mask == Mask::Bool ? 1 : (a.mask_dtype == DType::F32 ? 4 : 2);
  return static_cast<const char*>(a.mask_data) +
         (b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2]) * item;
}

// The score of a dropped key: the lowest finite value of the inputs' dtype.
float dropped_score(DType t) {
  switch (t) {
    case DType::F16:
      return -65504.0f;
    case DType::BF16:
      return -0x1.fep127f;  // bfloat16's lowest: 8 significant bits
    default:
      return std::numeric_limits<float>::lowest();
  }
}

// Score s of key j with the mask's row applied: `fill` where a bool mask drops
// the key, plus the value of an additive one.
template <typename T>
T masked(const Attention& a, const char* row, int64_t j, T s, T fill) {
  if (a.mask == Mask::Bool) return row[j * a.mask_stride[3]] ? s : fill;
  if (a.mask == Mask::Additive) return s + scalar_to_float(row, j * a.mask_stride[3], a.mask_dtype);
  return s;
}

// The sum of value rows j0 .. kv_len - 1 of (batch b, key/value head kv), each
// times `weight`, added to acc (value_dim entries; T float or double): the keys
// past a row's causal limit, in the rare row where their weight is not 0.
template <typename T>
void add_values_from(const Attention& a, int64_t b, int64_t kv, int64_t j0, T weight, T* acc) {
  thread_local Vector<float> row;
  row.resize(static_cast<size_t>(padded(a.value_dim)));  // row_to_float pads with zeros
  for (int64_t j = j0; j < a.kv_len; j++) {
    row_to_float(at(a.v, a.dtype, b, kv, j), a.dtype, a.value_dim, row.data());
    for (int64_t d = 0; d < a.value_dim; d++) acc[d] += weight * static_cast<T>(row[d]);
  }
}

// kLanes scores of one query row: q[d] times the transposed keys, summed over d
// in blocks of kLanes, the blocks then added (fewer roundings in a row than one
// running sum), times the scale.
vf scores_f32(const float* q, const float* keys_t, int64_t d_len, float scale) {
  vf sum = {};
  for (int64_t d0 = 0; d0 < d_len; d0 += kLanes) {
    vf part = {};
    const int64_t d1 = std::min<int64_t>(d_len, d0 + kLanes);
    if (d1 - d0 == kLanes) {  // a fixed count, so that the sum stays in registers
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; i++) part += splat(q[d0 + i]) * load(&keys_t[(d0 + i) * kLanes]);
    } else {
      for (int64_t d = d0; d < d1; d++) part += splat(q[d]) * load(&keys_t[d * kLanes]);
    }
    sum += part;
  }
  return sum * scale;
}

// std::max over the lanes, in order: as in the scalar loop a NaN never becomes
// the largest (a row with a NaN score is NaN through its weight anyway).
inline float hmax(vf v) {
  float s[kLanes];
  std::memcpy(s, &v, sizeof s);
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < kLanes; i++) m = std::max(m, s[i]);
  return m;
}

#if defined(__AVX512F__)
// Transposes 16 rows of 16 lanes in place: at each step (s = 1, 2, 4, 8) rows
// a and a + s (a's bit s clear) swap their off-diagonal s x s blocks.
inline void transpose16(vf* m) {
  for (int a = 0; a < kLanes; a += 2) {
    const vf x = m[a], y = m[a + 1];
    m[a] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    m[a + 1] =
        __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int a = 0; a < kLanes; a += (a % 4 == 1) ? 3 : 1) {
    const vf x = m[a], y = m[a + 2];
    m[a] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    m[a + 2] =
        __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int a = 0; a < kLanes; a += (a % 8 == 3) ? 5 : 1) {
    const vf x = m[a], y = m[a + 4];
    m[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    m[a + 4] =
        __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int a = 0; a < kLanes / 2; a++) {
    const vf x = m[a], y = m[a + 8];
    m[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    m[a + 8] = __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                       29, 30, 31);
  }
}
#endif

// Half-type inputs: the rows of one task, queries i0 .. i1 of every query head
// sharing key/value head `kv`. Each key and value row is converted to float32
// once for all of them.
void attend(const Attention& a, int64_t b, int64_t kv, int64_t i0, int64_t i1) {
  const int64_t group = a.q_heads / a.kv_heads, queries = i1 - i0, rows = group * queries;
  const int64_t dq = padded(a.head_dim), dv = padded(a.value_dim);
  thread_local Vector<float> q, key, keys_t, values, scores, acc, top, total;
  thread_local Vector<int64_t> seen;
  q.resize(static_cast<size_t>(rows * dq));
  scores.resize(static_cast<size_t>(rows * std::max<int64_t>(a.kv_len, 1)));
  acc.assign(static_cast<size_t>(rows * dv), 0.0f);
  top.assign(static_cast<size_t>(rows), -std::numeric_limits<float>::infinity());
  total.assign(static_cast<size_t>(rows), 0.0f);
  seen.resize(static_cast<size_t>(rows));
  int64_t last = 0;  // keys any row sees
  for (int64_t g = 0; g < group; g++)
    for (int64_t i = i0; i < i1; i++) {
      const int64_t r = g * queries + (i - i0);
      row_to_float(at(a.q, a.dtype, b, kv * group + g, i), a.dtype, a.head_dim, &q[r * dq]);
      seen[r] = keys_seen(a, i);
      last = std::max(last, seen[r]);
    }
  const float inf = std::numeric_limits<float>::infinity();
  const float fill = dropped_score(a.dtype);
  // Scores of kLanes keys at a time: the keys transposed (lane = key), so each
  // row's scores are a sum over d of its q[d] times a vector, with no
  // horizontal sums.
  keys_t.resize(static_cast<size_t>(dq * kLanes));
  key.resize(static_cast<size_t>(kLanes * dq));
  for (int64_t j0 = 0; j0 < last; j0 += kLanes) {
    const int64_t nj = std::min<int64_t>(kLanes, last - j0);
    for (int64_t jj = 0; jj < kLanes; jj++) {
      if (jj < nj)
        row_to_float(at(a.k, a.dtype, b, kv, j0 + jj), a.dtype, a.head_dim, &key[jj * dq]);
      else
        std::fill(key.begin() + jj * dq, key.begin() + (jj + 1) * dq, 0.0f);
    }
#if defined(__AVX512F__)
    for (int64_t d0 = 0; d0 < dq; d0 += kLanes) {
      vf block[kLanes];
      for (int64_t jj = 0; jj < kLanes; jj++) block[jj] = load(&key[jj * dq + d0]);
      transpose16(block);
      for (int64_t d = 0; d < kLanes; d++) store(&keys_t[(d0 + d) * kLanes], block[d]);
    }
#else  // narrower registers make the two-vector shuffles element moves: copy directly
    for (int64_t jj = 0; jj < kLanes; jj++)
      for (int64_t d = 0; d < dq; d++) keys_t[d * kLanes + jj] = key[jj * dq + d];
#endif
    for (int64_t r = 0; r < rows; r++) {
      if (j0 >= seen[r]) continue;
      const float* qr = &q[r * dq];
      const vf sum = scores_f32(qr, keys_t.data(), a.head_dim, a.scale);
      const int64_t end = std::min(nj, seen[r] - j0);
      if (end == kLanes && a.mask == Mask::None) {  // a whole block, unmasked
        store(&scores[r * a.kv_len + j0], sum);
        top[r] = std::max(top[r], hmax(sum));
        continue;
      }
      // (Lanes read from memory: subscripting the vector keeps it there at
      // every step of its sums where registers are narrower than 16 lanes.)
      float lanes[kLanes];
      store(lanes, sum);
      const char* mrow = mask_row(a, b, kv * group + r / queries, i0 + r % queries);
      for (int64_t jj = 0; jj < end; jj++) {
        const int64_t j = j0 + jj;
        const float s = masked(a, mrow, j, lanes[jj], fill);
        scores[r * a.kv_len + j] = s;
        top[r] = std::max(top[r], s);
      }
    }
  }
  // Keys past the causal limit score `fill` too.
  for (int64_t r = 0; r < rows; r++)
    if (seen[r] < a.kv_len) top[r] = std::max(top[r], fill);
  // The weights and the weighted values are summed a block of kLanes keys at a
  // time, the blocks then added (fewer roundings in a row than one running sum).
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j0 = 0; j0 < seen[r]; j0 += kLanes) {
      float* w = &scores[r * a.kv_len + j0];
      if (j0 + kLanes <= seen[r]) {  // a whole block: exp16 (pointwise_impl.h)
        const vf e = exp16(load(w) - top[r]);
        store(w, e);
        total[r] += hsum(e);
        continue;
      }
      float part = 0.0f;
      for (int64_t j = 0; j < seen[r] - j0; j++) {
        w[j] = std::exp(w[j] - top[r]);
        part += w[j];
      }
      total[r] += part;
    }
  values.resize(static_cast<size_t>(kLanes * dv));
  for (int64_t j0 = 0; j0 < last; j0 += kLanes) {
    const int64_t nj = std::min<int64_t>(kLanes, last - j0);
    for (int64_t jj = 0; jj < nj; jj++)
      row_to_float(at(a.v, a.dtype, b, kv, j0 + jj), a.dtype, a.value_dim, &values[jj * dv]);
    for (int64_t r = 0; r < rows; r++) {
      const int64_t end = std::min(nj, seen[r] - j0);
      if (end <= 0) continue;
      const float* w = &scores[r * a.kv_len + j0];
      float* out = &acc[r * dv];
      for (int64_t d = 0; d < dv; d += kLanes) {
        vf part = {};
        if (end == kLanes) {  // as in scores_f32
#pragma GCC unroll 16
          for (int jj = 0; jj < kLanes; jj++) part += splat(w[jj]) * load(&values[jj * dv + d]);
        } else {
          for (int64_t jj = 0; jj < end; jj++) part += splat(w[jj]) * load(&values[jj * dv + d]);
        }
        store(out + d, load(out + d) + part);
      }
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    const float e = std::exp(fill - top[r]);
    if (seen[r] == a.kv_len || e == 0.0f) continue;
    total[r] += static_cast<float>(a.kv_len - seen[r]) * e;
    add_values_from(a, b, kv, seen[r], e, &acc[r * dv]);
  }
  const Output out{a.out, a.dtype};
  for (int64_t r = 0; r < rows; r++) {
    const int64_t g = r / queries, i = i0 + r % queries;
    // No key at all: the empty sum, 0. Every score -inf: NaN, as MLX's softmax gives.
    const float t = a.kv_len == 0     ? 1.0f
                    : top[r] == -inf ? std::numeric_limits<float>::quiet_NaN()
                                     : total[r];
    const int64_t base = ((b * a.q_heads + kv * group + g) * a.q_len + i) * a.value_dim;
    for (int64_t d = 0; d < a.value_dim; d++) store_out(out, base + d, acc[r * dv + d] / t);
  }
}

// Float32 inputs: every step in float64, rounded once. In float32 the scores'
// rounding would be the largest error of the result (a score off by e moves
// its weight by a factor of e^e, and the output's own rounding is as small),
// where in the half types the inputs' rounding dwarfs it.
void attend_f64(const Attention& a, int64_t b, int64_t kv, int64_t i0, int64_t i1) {
  const int64_t group = a.q_heads / a.kv_heads;
  thread_local Vector<double> w, acc;
  w.resize(static_cast<size_t>(std::max<int64_t>(a.kv_len, 1)));
  acc.resize(static_cast<size_t>(a.value_dim));
  const double inf = std::numeric_limits<double>::infinity();
  const double fill = dropped_score(a.dtype);
  for (int64_t g = 0; g < group; g++) {
    const int64_t h = kv * group + g;
    for (int64_t i = i0; i < i1; i++) {
      const auto* q = static_cast<const float*>(at(a.q, a.dtype, b, h, i));
      const int64_t seen = keys_seen(a, i);
      const char* mrow = mask_row(a, b, h, i);
      double top = -inf;
      for (int64_t j = 0; j < seen; j++) {
        const auto* k = static_cast<const float*>(at(a.k, a.dtype, b, kv, j));
        double s = 0.0;
        for (int64_t d = 0; d < a.head_dim; d++) s += static_cast<double>(q[d]) * k[d];
        w[j] = masked(a, mrow, j, s * a.scale, fill);
        top = std::max(top, w[j]);
      }
      if (seen < a.kv_len) top = std::max(top, fill);
      double total = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < seen; j++) {
        const double p = std::exp(w[j] - top);
        total += p;
        const auto* v = static_cast<const float*>(at(a.v, a.dtype, b, kv, j));
        for (int64_t d = 0; d < a.value_dim; d++) acc[d] += p * v[d];
      }
      const double e = std::exp(fill - top);
      if (seen < a.kv_len && e != 0.0) {
        total += static_cast<double>(a.kv_len - seen) * e;
        add_values_from(a, b, kv, seen, e, acc.data());
      }
      if (a.kv_len == 0)
        total = 1.0;
      else if (top == -inf)
        total = std::numeric_limits<double>::quiet_NaN();
      auto* out = static_cast<float*>(a.out) + ((b * a.q_heads + h) * a.q_len + i) * a.value_dim;
      for (int64_t d = 0; d < a.value_dim; d++) out[d] = static_cast<float>(acc[d] / total);
    }
  }
}

}  // namespace

void attention(const Attention& a) {
  // Queries per task: up to kAttentionQueries, fewer where the scores of a task's
  // rows (every query head of the group) would pass ~4 MB.
  const int64_t group = a.q_heads / a.kv_heads;
  const int64_t fit = (int64_t{1} << 20) / std::max<int64_t>(1, group * a.kv_len);
  const int64_t per = std::clamp<int64_t>(fit, 1, kAttentionQueries);
  const int64_t blocks = (a.q_len + per - 1) / per;
  parallel_for(a.batch * a.kv_heads * blocks, [&](int64_t t) {
    const int64_t blk = t % blocks, bk = t / blocks, i0 = blk * per;
    const int64_t i1 = std::min(a.q_len, i0 + per);
    if (a.dtype == DType::F32)
      attend_f64(a, bk / a.kv_heads, bk % a.kv_heads, i0, i1);
    else
      attend(a, bk / a.kv_heads, bk % a.kv_heads, i0, i1);
  });
}

}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
