// RMSNorm, RoPE and SwiGLU (pointwise.h), compiled once per SIMD level after
// matmul_impl.h (whose vector helpers they use) by matmul_<level>.cpp. The
// vectors are 16-lane float32 or 8-lane float64 (vector extensions), so each
// level computes the same operations in the same order, except that a level with
// fused multiply-adds rounds some steps once less (RoPE's float64 rotation,
// exp16's polynomial), far below the output's own rounding.

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/pointwise.h"

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {
namespace {

typedef double vd __attribute__((vector_size(64)));

// The 16 lanes of v as two float64 vectors: lanes 0..7 and 8..15.
inline void widen(vf v, vd* lo, vd* hi) {
  *lo = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), vd);
  *hi = __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), vd);
}
// Two float64 vectors rounded to float32, as one 16-lane vector.
inline vf narrow(vd lo, vd hi) {
  typedef float v8 __attribute__((vector_size(32)));
  const v8 a = __builtin_convertvector(lo, v8), b = __builtin_convertvector(hi, v8);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline double hsum(vd v) {
  double s[8];
  std::memcpy(s, &v, sizeof s);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// exp(x) in float32 lanes, within two units in the last place for results
// above 2^-126: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts so n ln2 is
// exact), exp(r) by its Taylor series to r^7, times 2^n. Below -87.3 (results
// under float32's normal range) it gives 0, above 88.72 infinity; NaN stays NaN.
// No lane comparisons: compilers split 16-lane comparisons into one per lane
// where registers are narrower, so the range checks are integer differences of
// the magnitude's bits, their sign spread by an arithmetic shift.
inline vf exp16(vf x) {
  const vu bits = reinterpret_cast<vu>(x);
  const vu mag = bits & 0x7fffffffu;
  const vi negative = reinterpret_cast<vi>(bits) >> 31;
  const vi nan = reinterpret_cast<vi>(0x7f800000u - mag) >> 31;
  const vi over = (reinterpret_cast<vi>(0x42b17218u - mag) >> 31) & ~negative;  // > 88.7228
  const vi under = (reinterpret_cast<vi>(0x42aeac4fu - mag) >> 31) & negative;  // < -87.3365
  const vf c = select(over | under | nan, splat(0.0f), x);
  // n = c / ln2 rounded to nearest: adding 1.5 * 2^23 leaves no fraction bits.
  const vf n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  vf p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n in two factors (n is in -126 .. 128 here, each half in float32's range).
  const vi ni = __builtin_convertvector(n, vi);
  const vi n1 = ni >> 1, n2 = ni - n1;
  vf e = p * reinterpret_cast<vf>((n1 + 127) << 23) * reinterpret_cast<vf>((n2 + 127) << 23);
  e = select(over, splat(std::numeric_limits<float>::infinity()), e);
  e = select(under, splat(0.0f), e);
  return select(nan, x, e);
}

// Splits `items` units of work of `cost` elements each over the kernels'
// threads, in tasks of at least kMinTaskElements (a decode step's vectors run
// on the caller alone: a thread's wake-up would cost more than the work).
constexpr int64_t kMinTaskElements = 1 << 15;

template <typename F>
void split_work(int64_t items, int64_t cost, F&& f) {
  const int64_t per = std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(1, cost));
  const int64_t tasks = (items + per - 1) / per;
  const auto run = [&](int64_t t) { f(t * per, std::min(items, (t + 1) * per)); };
  if (tasks <= 1) {
    if (items > 0) run(0);
    return;
  }
  parallel_for(tasks, run);
}

}  // namespace

void rms_norm(const RmsNorm& a) {
  if (a.rows <= 0 || a.n <= 0) return;
  const int64_t full = a.n / kLanes * kLanes;
  Vector<float> w(static_cast<size_t>(padded(a.n)), 1.0f);
  if (a.w) row_to_float(a.w, a.w_dtype, a.n, w.data());
  split_work(a.rows, a.n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const int64_t base = r * a.n;
      const void* x = element(a.x, base, a.x_dtype);
      // Each square is exact in float64; the sums run in 16 lanes.
      vd s0 = {}, s1 = {};
      for (int64_t i = 0; i < full; i += kLanes) {
        vd lo, hi;
        widen(load_row16(x, i, a.x_dtype), &lo, &hi);
        s0 += lo * lo;
        s1 += hi * hi;
      }
      double sum = hsum(s0 + s1);
      for (int64_t i = full; i < a.n; i++) {
        const double v = scalar_to_float(x, i, a.x_dtype);
        sum += v * v;
      }
      const double scale =
          1.0 / std::sqrt(sum / static_cast<double>(a.n) + static_cast<double>(a.eps));
      for (int64_t i = 0; i < full; i += kLanes) {
        vd lo, hi, wlo, whi;
        widen(load_row16(x, i, a.x_dtype), &lo, &hi);
        widen(load(w.data() + i), &wlo, &whi);
        store_row16(a.out, base + i, a.out_dtype, narrow(lo * scale * wlo, hi * scale * whi));
      }
      for (int64_t i = full; i < a.n; i++)
        store_out({a.out, a.out_dtype}, base + i,
                  static_cast<float>(scalar_to_float(x, i, a.x_dtype) * scale * w[i]));
    }
  });
}

void rope(const Rope& a) {
  if (a.batch <= 0 || a.heads <= 0 || a.len <= 0 || a.dim <= 0) return;
  const int64_t half = a.dims / 2;
  // base^(-i / half), as exp(-i * log(base) / half) in float64.
  Vector<double> inv_freq(static_cast<size_t>(half));
  const double log_base = std::log(static_cast<double>(a.base));
  for (int64_t i = 0; i < half; i++)
    inv_freq[i] = std::exp(-static_cast<double>(i) * log_base / static_cast<double>(half));
  const Output out_view{a.out, a.dtype};
  // Pairs i, i + half a vector at a time (halves of whole vectors, not traditional).
  const bool vector = !a.traditional && half % kLanes == 0;
  // Each task takes a stretch of positions: their angles once, then every
  // (batch, head) row at those positions.
  split_work(a.len, a.batch * a.heads * a.dim, [&](int64_t t0, int64_t t1) {
    // [position][cos 0 .. half, sin 0 .. half]
    Vector<double> cs(static_cast<size_t>((t1 - t0) * half * 2));
    for (int64_t t = t0; t < t1; t++) {
      const double pos = static_cast<double>(a.offset + t) * static_cast<double>(a.scale);
      double* c = cs.data() + (t - t0) * half * 2;
      for (int64_t i = 0; i < half; i++) {
        const double theta = pos * inv_freq[i];
        c[i] = std::cos(theta);
        c[half + i] = std::sin(theta);
      }
    }
    for (int64_t b = 0; b < a.batch; b++)
      for (int64_t h = 0; h < a.heads; h++)
        for (int64_t t = t0; t < t1; t++) {
          const int64_t in = b * a.stride[0] + h * a.stride[1] + t * a.stride[2];
          const int64_t out = ((b * a.heads + h) * a.len + t) * a.dim;
          const double* cos = cs.data() + (t - t0) * half * 2;
          const double* sin = cos + half;
          const void* x = element(a.x, in, a.dtype);
          int64_t i = 0;
          if (vector) {
            for (; i < half; i += kLanes) {
              vd x1l, x1h, x2l, x2h, cl, ch, sl, sh;
              widen(load_row16(x, i, a.dtype), &x1l, &x1h);
              widen(load_row16(x, i + half, a.dtype), &x2l, &x2h);
              std::memcpy(&cl, cos + i, sizeof cl);
              std::memcpy(&ch, cos + i + 8, sizeof ch);
              std::memcpy(&sl, sin + i, sizeof sl);
              std::memcpy(&sh, sin + i + 8, sizeof sh);
              store_row16(a.out, out + i, a.dtype,
                          narrow(x1l * cl - x2l * sl, x1h * ch - x2h * sh));
              store_row16(a.out, out + i + half, a.dtype,
                          narrow(x1l * sl + x2l * cl, x1h * sh + x2h * ch));
            }
          }
          for (; i < half; i++) {
            const int64_t i1 = a.traditional ? 2 * i : i;
            const int64_t i2 = a.traditional ? 2 * i + 1 : i + half;
            const double x1 = scalar_to_float(x, i1, a.dtype), x2 = scalar_to_float(x, i2, a.dtype);
            store_out(out_view, out + i1, static_cast<float>(x1 * cos[i] - x2 * sin[i]));
            store_out(out_view, out + i2, static_cast<float>(x1 * sin[i] + x2 * cos[i]));
          }
          const int64_t item = a.dtype == DType::F32 ? 4 : 2;
          if (2 * half < a.dim)
            std::memcpy(static_cast<char*>(a.out) + (out + 2 * half) * item,
                        static_cast<const char*>(a.x) + (in + 2 * half) * item,
                        static_cast<size_t>((a.dim - 2 * half) * item));
        }
  });
}

void swiglu(const void* gate, const void* x, DType dtype, int64_t count, void* out) {
  if (count <= 0) return;
  const Output out_view{out, dtype};
  split_work(count, 1, [&](int64_t i0, int64_t i1) {
    if (dtype == DType::F32) {
      // A float32 result needs float64 for its own error to stay below its roundoff.
      const auto* g = static_cast<const float*>(gate);
      const auto* v = static_cast<const float*>(x);
      for (int64_t i = i0; i < i1; i++) {
        const double gi = g[i];
        static_cast<float*>(out)[i] = static_cast<float>(gi * (1.0 / (1.0 + std::exp(-gi))) * v[i]);
      }
      return;
    }
    // A 16-bit result is rounded once from float32, whose own error (a few
    // units of 2^-24) is far below the 16-bit roundoff.
    int64_t i = i0;
    for (; i + kLanes <= i1; i += kLanes) {
      const vf g = load_row16(gate, i, dtype);
      const vf sigmoid = 1.0f / (1.0f + exp16(-g));
      store_row16(out, i, dtype, g * sigmoid * load_row16(x, i, dtype));
    }
    for (; i < i1; i++) {
      const float g = scalar_to_float(gate, i, dtype);
      store_out(out_view, i, g * (1.0f / (1.0f + std::exp(-g))) * scalar_to_float(x, i, dtype));
    }
  });
}

}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
