// pyloader's CPU kernels against a float64 reference, through their C++ API only:
// built and run for another architecture by scripts/cross_kernels.py (aarch64 under
// qemu-user: the NEON build), where the Python tests cannot run. Exit status 0 when
// every product and pointwise step is within its bound, 1 otherwise; one line per
// failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/ggml_blocks.h"
#include "kernels/half.h"
#include "kernels/kernels.h"
#include "kernels/pointwise.h"

using namespace pyloader::kernels;

namespace {

uint64_t state = 0x9e3779b97f4a7c15ull;
double uniform() {  // [-1, 1)
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<double>(state >> 11) / 4503599627370496.0 - 1.0;
}

// A value of `t`, stored in `dst[i]`, returned as what the kernel will read.
double put(void* dst, int64_t i, DType t, double v) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(dst)[i] = static_cast<float>(v);
      return static_cast<float*>(dst)[i];
    case DType::F16: {
      uint16_t h = float_to_f16(static_cast<float>(v));
      static_cast<uint16_t*>(dst)[i] = h;
      return f16_to_float(h);
    }
    case DType::BF16: {
      uint16_t h = float_to_bf16(static_cast<float>(v));
      static_cast<uint16_t*>(dst)[i] = h;
      return bf16_to_float(h);
    }
  }
  return 0;
}

double get(const void* src, int64_t i, DType t) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(src)[i];
    case DType::F16:
      return f16_to_float(static_cast<const uint16_t*>(src)[i]);
    case DType::BF16:
      return bf16_to_float(static_cast<const uint16_t*>(src)[i]);
  }
  return 0;
}

const char* name(DType t) { return t == DType::F32 ? "f32" : t == DType::F16 ? "f16" : "bf16"; }

// Largest |y - y64| / sum|x w| must stay under float32 accumulation over k terms plus
// the output's own rounding.
bool check(const char* what, const std::vector<double>& ref, const std::vector<double>& mag,
           const void* out, DType ot, int64_t k) {
  const double unit = ot == DType::F32 ? 0x1p-24 : ot == DType::F16 ? 0x1p-11 : 0x1p-8;
  const double bound = (static_cast<double>(k) + 2.0) * 0x1p-24 + 2.0 * unit;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    const double err = std::fabs(get(out, static_cast<int64_t>(i), ot) - ref[i]) /
                       (mag[i] > 0 ? mag[i] : 1.0);
    if (!(err <= worst)) worst = err;
  }
  if (worst <= bound) return true;
  std::printf("FAIL %s: error %.3g > bound %.3g\n", what, worst, bound);
  return false;
}

// x (m, k) times w (n, k) transposed, in float64, and sum |x w| for each output.
void reference(const std::vector<double>& x, const std::vector<double>& w, int64_t m, int64_t n,
               int64_t k, std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign(m * n, 0.0);
  mag.assign(m * n, 0.0);
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++)
      for (int64_t kk = 0; kk < k; kk++) {
        ref[i * n + j] += x[i * k + kk] * w[j * k + kk];
        mag[i * n + j] += std::fabs(x[i * k + kk] * w[j * k + kk]);
      }
}

bool affine_case(int bits, int gs, DType xt, DType st, int64_t m, int64_t n, int64_t k) {
  std::vector<uint8_t> xbuf(m * k * 4), sbuf(n * (k / gs) * 4), bbuf(sbuf.size());
  std::vector<uint32_t> packed(n * k * bits / 32, 0);
  std::vector<double> x(m * k), w(n * k);
  for (int64_t i = 0; i < m * k; i++) x[i] = put(xbuf.data(), i, xt, uniform());
  for (int64_t r = 0; r < n; r++)
    for (int64_t g = 0; g < k / gs; g++) {
      const double s = put(sbuf.data(), r * (k / gs) + g, st, 0.05 + 0.02 * uniform());
      const double b = put(bbuf.data(), r * (k / gs) + g, st, 0.3 * uniform());
      for (int64_t j = 0; j < gs; j++) {
        const int64_t kk = g * gs + j;
        const uint32_t q = static_cast<uint32_t>((uniform() + 1.0) * 0.5 * (1u << bits)) &
                           ((1u << bits) - 1u);
        const int64_t bit = (r * k + kk) * bits;  // a little-endian bit stream per row
        auto* bytes8 = reinterpret_cast<uint8_t*>(packed.data());
        for (int t = 0; t < bits; t++)
          if (q >> t & 1u) bytes8[(bit + t) >> 3] |= static_cast<uint8_t>(1u << ((bit + t) & 7));
        w[r * k + kk] = s * q + b;
      }
    }
  const DType ot = (xt == DType::F32 || st == DType::F32 || xt != st) ? DType::F32 : xt;
  std::vector<uint8_t> out(m * n * 4);
  quantized_matmul({xbuf.data(), xt, m, k}, {packed.data(), sbuf.data(), bbuf.data(), st, n, bits, gs},
                {out.data(), ot});
  std::vector<double> ref, mag;
  reference(x, w, m, n, k, ref, mag);
  char what[160];
  std::snprintf(what, sizeof what, "affine bits=%d group=%d x=%s scales=%s m=%lld n=%lld k=%lld",
                bits, gs, name(xt), name(st), (long long)m, (long long)n, (long long)k);
  return check(what, ref, mag, out.data(), ot, k);
}

bool dense_case(DType t, int64_t m, int64_t n, int64_t k) {
  std::vector<uint8_t> xbuf(m * k * 4 + 4), wbuf(n * k * 4 + 4), out(m * n * 4);
  std::vector<double> x(m * k), w(n * k);
  for (int64_t i = 0; i < m * k; i++) x[i] = put(xbuf.data(), i, t, uniform());
  for (int64_t i = 0; i < n * k; i++) w[i] = put(wbuf.data(), i, t, uniform());
  dense_matmul({xbuf.data(), t, m, k}, {wbuf.data(), t, n}, {out.data(), t});
  std::vector<double> ref, mag;
  reference(x, w, m, n, k, ref, mag);
  char what[96];
  std::snprintf(what, sizeof what, "dense %s m=%lld n=%lld k=%lld", name(t), (long long)m,
                (long long)n, (long long)k);
  return check(what, ref, mag, out.data(), t, k);
}

// Each output of a pointwise step against its float64 value: within a few units of
// float32's roundoff of `size` plus the output's own rounding (of at least its dtype's
// smallest normal number: below it the spacing no longer shrinks).
bool check_each(const char* what, const std::vector<double>& ref, const std::vector<double>& size,
                const void* out, DType ot) {
  const double unit = ot == DType::F32 ? 0x1p-24 : ot == DType::F16 ? 0x1p-11 : 0x1p-8;
  const double tiny = ot == DType::F16 ? 0x1p-14 : 0x1p-126;
  for (size_t i = 0; i < ref.size(); i++) {
    const double got = get(out, static_cast<int64_t>(i), ot);
    const double err = std::fabs(got - ref[i]);
    const double bound = (8 * 0x1p-24 + unit) * std::fmax(size[i], tiny);
    if (!(err <= bound)) {
      std::printf("FAIL %s: output %zu is %.9g, float64 %.9g\n", what, i, got, ref[i]);
      return false;
    }
  }
  return true;
}

// SwiGLU over `count` values (gates spread over +-60), RMSNorm of 3 rows of `count`
// with a weight, RoPE of 5 heads at one position (dims = the row, halves paired).
bool pointwise_case(DType t, int64_t count) {
  char what[96];
  std::vector<uint8_t> gbuf(count * 4), xbuf(count * 4), out(5 * count * 4), wbuf(count * 4);
  std::vector<double> g(count), x(count), ref(count), size(count);
  for (int64_t i = 0; i < count; i++) {
    g[i] = put(gbuf.data(), i, t, 60 * uniform());
    x[i] = put(xbuf.data(), i, t, uniform());
    ref[i] = g[i] / (1 + std::exp(-g[i])) * x[i];
    size[i] = std::fabs(ref[i]);
  }
  swiglu(gbuf.data(), xbuf.data(), t, count, out.data());
  std::snprintf(what, sizeof what, "swiglu %s count=%lld", name(t), (long long)count);
  bool ok = check_each(what, ref, size, out.data(), t);

  std::vector<uint8_t> rbuf(3 * count * 4);
  std::vector<double> r(3 * count), w(count);
  for (int64_t i = 0; i < 3 * count; i++) r[i] = put(rbuf.data(), i, t, 3 * uniform());
  for (int64_t i = 0; i < count; i++) w[i] = put(wbuf.data(), i, t, uniform());
  rms_norm({rbuf.data(), t, wbuf.data(), t, out.data(), t, 3, count, 1e-5f});
  ref.assign(3 * count, 0.0);
  for (int64_t row = 0; row < 3; row++) {
    double sum = 0;
    for (int64_t i = 0; i < count; i++) sum += r[row * count + i] * r[row * count + i];
    const double scale = 1 / std::sqrt(sum / static_cast<double>(count) + double{1e-5f});
    for (int64_t i = 0; i < count; i++) ref[row * count + i] = r[row * count + i] * scale * w[i];
  }
  size.assign(ref.size(), 0.0);
  for (size_t i = 0; i < ref.size(); i++) size[i] = std::fabs(ref[i]);
  std::snprintf(what, sizeof what, "rms_norm %s n=%lld", name(t), (long long)count);
  ok = check_each(what, ref, size, out.data(), t) && ok;

  if (count % 2 == 0) {
    const int64_t heads = 5, half = count / 2, offset = 37;
    std::vector<uint8_t> qbuf(heads * count * 4);
    std::vector<double> q(heads * count);
    for (int64_t i = 0; i < heads * count; i++) q[i] = put(qbuf.data(), i, t, uniform());
    Rope a{t, 1, heads, 1, count, qbuf.data(), {heads * count, count, count}, out.data(),
           static_cast<int>(count), false, 10000.0f, 1.0f, offset};
    rope(a);
    ref.assign(heads * count, 0.0);
    size.assign(heads * count, 0.0);
    for (int64_t h = 0; h < heads; h++)
      for (int64_t i = 0; i < half; i++) {
        const double theta = offset * std::pow(10000.0, -static_cast<double>(i) / half);
        const double x1 = q[h * count + i], x2 = q[h * count + i + half];
        ref[h * count + i] = x1 * std::cos(theta) - x2 * std::sin(theta);
        ref[h * count + i + half] = x1 * std::sin(theta) + x2 * std::cos(theta);
        size[h * count + i] = size[h * count + i + half] = std::fabs(x1) + std::fabs(x2);
      }
    std::snprintf(what, sizeof what, "rope %s dims=%lld", name(t), (long long)count);
    ok = check_each(what, ref, size, out.data(), t) && ok;
  }
  return ok;
}

// ggml's reference dequantization of one block, written from the formats'
// layouts (ggml_blocks.h) as plain loops. Each product the reference rounds
// before a sum is its own statement: compilers contract within an expression.
float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

void reference_block(GgmlType t, const uint8_t* b, float* y) {
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1: {
      const bool one = t == GgmlType::Q4_1;
      const float d = half_at(b), m = one ? half_at(b + 2) : 0.0f;
      const uint8_t* qs = b + (one ? 4 : 2);
      for (int j = 0; j < 16; j++) {
        const float lo = static_cast<float>((qs[j] & 15) - (one ? 0 : 8)) * d;
        const float hi = static_cast<float>((qs[j] >> 4) - (one ? 0 : 8)) * d;
        y[j] = one ? lo + m : lo;
        y[j + 16] = one ? hi + m : hi;
      }
      return;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool one = t == GgmlType::Q5_1;
      const float d = half_at(b), m = one ? half_at(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int j = 0; j < 16; j++) {
        const int x0 = (qs[j] & 15) | static_cast<int>((qh >> j) & 1) << 4;
        const int x1 = (qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
        const float lo = static_cast<float>(x0 - (one ? 0 : 16)) * d;
        const float hi = static_cast<float>(x1 - (one ? 0 : 16)) * d;
        y[j] = one ? lo + m : lo;
        y[j + 16] = one ? hi + m : hi;
      }
      return;
    }
    case GgmlType::Q8_0: {
      const float d = half_at(b);
      for (int j = 0; j < 32; j++) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      return;
    }
    case GgmlType::Q2_K: {
      const float d = half_at(b + 80), dmin = half_at(b + 82);
      const uint8_t* q = b + 16;
      int is = 0;
      for (int half = 0; half < 2; half++, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
          for (int part = 0; part < 2; part++) {
            const uint8_t sc = b[is++];
            const float dl = d * static_cast<float>(sc & 15);
            const float ml = dmin * static_cast<float>(sc >> 4);
            for (int l = 0; l < 16; l++) {
              const float p = dl * static_cast<float>((q[l + 16 * part] >> shift) & 3);
              *y++ = p - ml;
            }
          }
      return;
    }
    case GgmlType::Q3_K: {
      const uint8_t *hm = b, *q = b + 32, *sb = b + 96;
      const float d = half_at(b + 108);
      int8_t scales[16];
      for (int i = 0; i < 16; i++) {
        const int low = i < 8 ? sb[i] & 15 : sb[i - 8] >> 4;
        const int high = (sb[8 + i % 4] >> (2 * (i / 4))) & 3;
        scales[i] = static_cast<int8_t>((low | high << 4) - 32);
      }
      int is = 0;
      uint8_t bit = 1;
      for (int half = 0; half < 2; half++, q += 32)
        for (int shift = 0; shift < 8; shift += 2, bit <<= 1)
          for (int part = 0; part < 2; part++) {
            const float dl = d * static_cast<float>(scales[is++]);
            for (int l = 0; l < 16; l++) {
              const int v = ((q[l + 16 * part] >> shift) & 3) - ((hm[l + 16 * part] & bit) ? 0 : 4);
              *y++ = dl * static_cast<float>(v);
            }
          }
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = t == GgmlType::Q5_K;
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t *sc = b + 4, *qh = b + 16, *q = b + (five ? 48 : 16);
      for (int j = 0; j < 8; j++) {
        int s, m;
        if (j < 4) {
          s = sc[j] & 63;
          m = sc[j + 4] & 63;
        } else {
          s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
          m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        const float d1 = d * static_cast<float>(s), m1 = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; l++) {
          const uint8_t byte = q[32 * (j / 2) + l];
          int v = j % 2 ? byte >> 4 : byte & 15;
          if (five && (qh[l] >> j & 1)) v += 16;
          const float p = d1 * static_cast<float>(v);
          *y++ = p - m1;
        }
      }
      return;
    }
    case GgmlType::Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128)
        for (int l = 0; l < 32; l++) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 15) | ((qh[l] >> 0 & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 15) | ((qh[l] >> 2 & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4 & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4)) - 32;
          y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
          y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
          y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
          y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
        }
      return;
    }
    default:
      return;
  }
}

// The byte offsets of a block's float16 scales (d, m, dmin), given finite values.
std::vector<int> half_offsets(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
      return {0, 2};
    case GgmlType::Q2_K:
      return {80, 82};
    case GgmlType::Q3_K:
      return {108};
    case GgmlType::Q6_K:
      return {208};
    default:
      return {0};
  }
}

// A block-quantized type: random codes and packed scales, finite float16 scales.
// ggml_dequantize must equal the reference bit for bit; ggml_matmul must be within
// the products' bound of the float64 product with those weights.
bool ggml_case(GgmlType t, DType xt, int64_t m, int64_t n, int64_t blocks) {
  const GgmlFormat& f = ggml_format(t);
  const int64_t k = blocks * f.block_elems, row_bytes = blocks * f.block_bytes;
  std::vector<uint8_t> bytes(n * row_bytes);
  for (auto& v : bytes) v = static_cast<uint8_t>((uniform() + 1.0) * 128.0);
  for (int64_t blk = 0; blk < n * blocks; blk++)
    for (int off : half_offsets(t)) {
      const uint16_t h = float_to_f16(static_cast<float>(0.02 * uniform()));
      std::memcpy(&bytes[blk * f.block_bytes + off], &h, 2);
    }
  std::vector<float> ref_w(n * k), got_w(n * k);
  for (int64_t blk = 0; blk < n * blocks; blk++)
    reference_block(t, &bytes[blk * f.block_bytes], &ref_w[blk * f.block_elems]);
  const BlockWeights w{bytes.data(), t, n, row_bytes};
  ggml_dequantize(w, k, got_w.data());
  char what[128];
  std::snprintf(what, sizeof what, "ggml %s x=%s m=%lld n=%lld k=%lld", f.name, name(xt),
                (long long)m, (long long)n, (long long)k);
  if (std::memcmp(ref_w.data(), got_w.data(), ref_w.size() * 4) != 0) {
    std::printf("FAIL %s: dequantized weights differ from the reference\n", what);
    return false;
  }
  std::vector<uint8_t> xbuf(m * k * 4), out(m * n * 4);
  std::vector<double> x(m * k), wd(ref_w.begin(), ref_w.end());
  for (int64_t i = 0; i < m * k; i++) x[i] = put(xbuf.data(), i, xt, uniform());
  ggml_matmul({xbuf.data(), xt, m, k}, w, {out.data(), xt});
  std::vector<double> ref, mag;
  reference(x, wd, m, n, k, ref, mag);
  return check(what, ref, mag, out.data(), xt, k);
}

}  // namespace

int main() {
  const DType types[] = {DType::F32, DType::F16, DType::BF16};
  int failures = 0, cases = 0;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (int bits : {1, 2, 3, 4, 5, 6, 8})
      for (int gs : {32, 64, 128})
        for (int c = 0; c < 3; c++) {
          const int64_t m = c == 0 ? 1 : c == 1 ? 3 : 9, k = gs * (c + 1), n = 13 + 2 * c;
          failures += !affine_case(bits, gs, types[c], types[(c + bits) % 3], m, n, k);
          cases++;
        }
    for (DType t : types)
      for (int64_t k : {1, 17, 64, 130}) {
        failures += !dense_case(t, k % 3 + 1, 11, k);
        failures += !dense_case(t, 7, 5, k);
        cases += 2;
      }
    for (DType t : types)
      for (int64_t count : {7, 64, 200, 5632}) {
        failures += !pointwise_case(t, count);
        cases++;
      }
    for (GgmlType t : ggml_types()) {
      if (ggml_format(t).block_elems == 1) continue;  // dense rows: dense_case covers them
      const int64_t blocks = ggml_format(t).block_elems == 32 ? 5 : 2;
      for (int c = 0; c < 3; c++) {
        failures += !ggml_case(t, types[c], c == 0 ? 1 : c == 1 ? 3 : 9, 13 + 24 * c, blocks);
        cases++;
      }
    }
    std::printf("%s: %d cases\n", isa_name(isa), cases);
  }
  std::printf("kernels_selftest: %d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
