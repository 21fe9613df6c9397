#include "kernels/pointwise.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/half.h"
#include "kernels/levels.h"

namespace pyloader::kernels {

namespace {

template <DType T>
inline float get(const void* p, int64_t i) {
  if constexpr (T == DType::F32) return static_cast<const float*>(p)[i];
  if constexpr (T == DType::F16) return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

template <DType T>
inline void put(void* p, int64_t i, double v) {
  if constexpr (T == DType::F32) static_cast<float*>(p)[i] = static_cast<float>(v);
  if constexpr (T == DType::F16) static_cast<uint16_t*>(p)[i] = float_to_f16(static_cast<float>(v));
  if constexpr (T == DType::BF16)
    static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v));
}

// f<T>() with the dtype known only at run time.
template <typename F>
decltype(auto) with_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F16:
      return f(std::integral_constant<DType, DType::F16>{});
    case DType::BF16:
      return f(std::integral_constant<DType, DType::BF16>{});
    default:
      return f(std::integral_constant<DType, DType::F32>{});
  }
}

// Splits `items` units of work of `cost` elements each over the kernels'
// threads, in tasks of at least kMinTaskElements (a decode step's vectors run
// on the caller alone: a thread's wake-up would cost more than the work).
constexpr int64_t kMinTaskElements = 1 << 15;

template <typename F>
void split(int64_t items, int64_t cost, F&& f) {
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
  std::vector<float> w(static_cast<size_t>(a.n), 1.0f);
  if (a.w)
    with_dtype(a.w_dtype, [&](auto wt) {
      for (int64_t i = 0; i < a.n; i++) w[i] = get<decltype(wt)::value>(a.w, i);
    });
  with_dtype(a.x_dtype, [&](auto xt) {
    with_dtype(a.out_dtype, [&](auto ot) {
      constexpr DType XT = decltype(xt)::value, OT = decltype(ot)::value;
      split(a.rows, a.n, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
          const int64_t base = r * a.n;
          double sum = 0;
          for (int64_t i = 0; i < a.n; i++) {
            const double v = get<XT>(a.x, base + i);
            sum += v * v;
          }
          const double scale =
              1.0 / std::sqrt(sum / static_cast<double>(a.n) + static_cast<double>(a.eps));
          for (int64_t i = 0; i < a.n; i++)
            put<OT>(a.out, base + i, get<XT>(a.x, base + i) * scale * w[i]);
        }
      });
    });
  });
}

void rope(const Rope& a) {
  if (a.batch <= 0 || a.heads <= 0 || a.len <= 0 || a.dim <= 0) return;
  const int64_t half = a.dims / 2;
  // base^(-i / half), as exp(-i * log(base) / half) in float64.
  std::vector<double> inv_freq(static_cast<size_t>(half));
  const double log_base = std::log(static_cast<double>(a.base));
  for (int64_t i = 0; i < half; i++)
    inv_freq[i] = std::exp(-static_cast<double>(i) * log_base / static_cast<double>(half));
  with_dtype(a.dtype, [&](auto dt) {
    constexpr DType T = decltype(dt)::value;
    // Each task takes a stretch of positions: their angles once, then every
    // (batch, head) row at those positions.
    split(a.len, a.batch * a.heads * a.dim, [&](int64_t t0, int64_t t1) {
      std::vector<double> cs(static_cast<size_t>((t1 - t0) * half * 2));
      for (int64_t t = t0; t < t1; t++) {
        const double pos = static_cast<double>(a.offset + t) * static_cast<double>(a.scale);
        for (int64_t i = 0; i < half; i++) {
          const double theta = pos * inv_freq[i];
          cs[((t - t0) * half + i) * 2] = std::cos(theta);
          cs[((t - t0) * half + i) * 2 + 1] = std::sin(theta);
        }
      }
      for (int64_t b = 0; b < a.batch; b++)
        for (int64_t h = 0; h < a.heads; h++)
          for (int64_t t = t0; t < t1; t++) {
            const int64_t in = b * a.stride[0] + h * a.stride[1] + t * a.stride[2];
            const int64_t out = ((b * a.heads + h) * a.len + t) * a.dim;
            const double* c = cs.data() + (t - t0) * half * 2;
            for (int64_t i = 0; i < half; i++) {
              const int64_t i1 = a.traditional ? 2 * i : i;
              const int64_t i2 = a.traditional ? 2 * i + 1 : i + half;
              const double x1 = get<T>(a.x, in + i1), x2 = get<T>(a.x, in + i2);
              const double cos = c[2 * i], sin = c[2 * i + 1];
              put<T>(a.out, out + i1, x1 * cos - x2 * sin);
              put<T>(a.out, out + i2, x1 * sin + x2 * cos);
            }
            for (int64_t i = 2 * half; i < a.dim; i++) {
              if constexpr (T == DType::F32)
                static_cast<float*>(a.out)[out + i] = static_cast<const float*>(a.x)[in + i];
              else
                static_cast<uint16_t*>(a.out)[out + i] = static_cast<const uint16_t*>(a.x)[in + i];
            }
          }
    });
  });
}

void swiglu(const void* gate, const void* x, DType dtype, int64_t count, void* out) {
  if (count <= 0) return;
  with_dtype(dtype, [&](auto dt) {
    constexpr DType T = decltype(dt)::value;
    // A 16-bit result is rounded once from float32, whose own error is a
    // few units of 2^-24: far below the 16-bit roundoff. A float32 result
    // needs float64 for the same.
    using Acc = std::conditional_t<T == DType::F32, double, float>;
    split(count, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {
        const Acc g = get<T>(gate, i);
        const Acc sigmoid = Acc(1) / (Acc(1) + std::exp(-g));
        put<T>(out, i, g * sigmoid * static_cast<Acc>(get<T>(x, i)));
      }
    });
  });
}

}  // namespace pyloader::kernels
