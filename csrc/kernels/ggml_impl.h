// Products over ggml's block formats (ggml_blocks.h) read where they lie, the
// bytes of a GGUF file: compiled once per SIMD level, as matmul_impl.h is, and
// built from its helpers (included after it, in the same level namespace).
//
// Each format has one decoder here, Decode<T>::each, which turns a block into
// its float32 values 16 at a time, exactly as ggml's reference dequantization
// computes them: the same float32 operations in the same order. Every product
// that the reference rounds before adding passes through rounded(), so the
// compiler cannot contract it into a fused multiply-add (which would round
// once and give another value). The decoder serves all three uses, so the
// weights a product multiplies are bit for bit the ones ggml_dequantize returns:
//   - dequantize: the values stored in rows of float32;
//   - decode (up to kFusedRows activation rows): each block decoded in
//     registers and multiplied into every row, the weights streamed once;
//   - prefill: a panel of kPanelRows weight rows decoded into float32 once,
//     then the register-tiled product of matmul_impl.h's Panel.
// F32, F16 and BF16 rows are dense rows: the dense product and conversion.

#ifndef PYLOADER_KERNEL_LEVEL
#error "define PYLOADER_KERNEL_LEVEL before including ggml_impl.h"
#endif

#include <cmath>
#include <optional>

#include "kernels/ggml_blocks.h"

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {
namespace {

// v unchanged, but opaque to the optimizer: a product passed through here is
// rounded to float32 before anything is added to it.
inline vf rounded(vf v) {
#if defined(__AVX512F__)
  __m512 r;
  std::memcpy(&r, &v, sizeof r);
  __asm__("" : "+v"(r));
  std::memcpy(&v, &r, sizeof v);
#elif defined(__FMA__)
  __m256 h[2];
  std::memcpy(h, &v, sizeof h);
  __asm__("" : "+x"(h[0]), "+x"(h[1]));
  std::memcpy(&v, h, sizeof v);
#elif defined(__x86_64__) || defined(_M_X64)
  // SSE2 has no fused multiply-add to contract into.
#elif defined(__aarch64__)
  typedef float f4 __attribute__((vector_size(16)));
  f4 q[4];
  std::memcpy(q, &v, sizeof q);
  __asm__("" : "+w"(q[0]), "+w"(q[1]), "+w"(q[2]), "+w"(q[3]));
  std::memcpy(&v, q, sizeof v);
#else
  __asm__("" : "+m"(v));
#endif
  return v;
}

// The float16 at p. Without F16C, half.h's f16_to_float written out here: called
// from many places it would be emitted out of line, a symbol any level could
// bind to (cmake/check_level_symbols.py).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, NaN
  } else if (exp == 0) {
    const float v = static_cast<float>(man) * 0x1p-24f;  // zero, subnormal: exact
    return sign ? -v : v;
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline vi lane_index() { return vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// 16 signed bytes, sign-extended to 32-bit lanes.
inline vi signed_bytes_to_lanes(const uint8_t* p) { return (bytes_to_lanes(p) << 24) >> 24; }

// Decode<T>::each(block, f) calls f(c, v) for c = 0 .. block_elems / 16 - 1,
// v the block's values 16c .. 16c + 15.
template <GgmlType T>
struct Decode;

template <>
struct Decode<GgmlType::Q4_0> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const vf d = splat(half_at(b));
    const vi q = bytes_to_lanes(b + 2);
    f(0, to_float((q & 15) - 8) * d);
    f(1, to_float((q >> 4) - 8) * d);
  }
};

template <>
struct Decode<GgmlType::Q4_1> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const vf d = splat(half_at(b)), m = splat(half_at(b + 2));
    const vi q = bytes_to_lanes(b + 4);
    f(0, rounded(to_float(q & 15) * d) + m);
    f(1, rounded(to_float(q >> 4) * d) + m);
  }
};

// Bit j of the 32 high bits (little-endian at p) is bit 4 of value j.
inline void fifth_bits(const uint8_t* p, vi& low, vi& high) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  const vu bits = vu{} + h, lane = reinterpret_cast<vu>(lane_index());
  low = reinterpret_cast<vi>(((bits >> lane) & 1u) << 4);
  high = reinterpret_cast<vi>(((bits >> (lane + 16u)) & 1u) << 4);
}

template <>
struct Decode<GgmlType::Q5_0> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const vf d = splat(half_at(b));
    vi h0, h1;
    fifth_bits(b + 2, h0, h1);
    const vi q = bytes_to_lanes(b + 6);
    f(0, to_float(((q & 15) | h0) - 16) * d);
    f(1, to_float(((q >> 4) | h1) - 16) * d);
  }
};

template <>
struct Decode<GgmlType::Q5_1> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const vf d = splat(half_at(b)), m = splat(half_at(b + 2));
    vi h0, h1;
    fifth_bits(b + 4, h0, h1);
    const vi q = bytes_to_lanes(b + 8);
    f(0, rounded(to_float((q & 15) | h0) * d) + m);
    f(1, rounded(to_float((q >> 4) | h1) * d) + m);
  }
};

template <>
struct Decode<GgmlType::Q8_0> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const vf d = splat(half_at(b));
    f(0, to_float(signed_bytes_to_lanes(b + 2)) * d);
    f(1, to_float(signed_bytes_to_lanes(b + 18)) * d);
  }
};

// The K-quants' 256 values are 16 runs of 16 (Q4_K, Q5_K: 8 of 32), each with
// its own scale. Q2_K and Q3_K: run s takes 2-bit codes from bytes
// 32 (s / 8) + 16 (s % 2) .. + 15 of the codes, shifted by 2 ((s % 8) / 2).
inline vi crumbs(const uint8_t* codes, int s) {
  return (bytes_to_lanes(codes + 32 * (s / 8) + 16 * (s % 2)) >> (2 * ((s % 8) / 2))) & 3;
}

template <>
struct Decode<GgmlType::Q2_K> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
      const vf dl = splat(d * static_cast<float>(b[s] & 15));
      const vf ml = rounded(splat(dmin * static_cast<float>(b[s] >> 4)));
      f(s, rounded(to_float(crumbs(b + 16, s)) * dl) - ml);
    }
  }
};

template <>
struct Decode<GgmlType::Q3_K> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const uint8_t* sc = b + 96;
    const float d = half_at(b + 108);
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
      // Sixteen 6-bit scales: low nibbles in bytes 0..7 (low halves first),
      // the high two bits in bytes 8..11.
      const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
      const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
      const vf dl = splat(d * static_cast<float>((low | high << 4) - 32));
      // A clear high bit subtracts 4.
      const vi hm = (bytes_to_lanes(b + 16 * (s % 2)) >> (s / 2)) & 1;
      f(s, to_float(crumbs(b + 32, s) - ((hm ^ 1) << 2)) * dl);
    }
  }
};

// Q4_K and Q5_K: the 8 scales and 8 mins (6 bits each) packed in the 12 bytes
// at q, as byte j of `sc` and `m`. Scale and min j < 4 are the low 6 bits of
// bytes j and j + 4; j >= 4 the low and high nibbles of byte j + 4, with the top
// 2 bits of bytes j - 4 and j above them. Unpacked from the three little-endian
// words at once.
struct ScalesMins {
  uint64_t sc, m;
  int scale(int j) const { return static_cast<int>((sc >> (8 * j)) & 255); }
  int min(int j) const { return static_cast<int>((m >> (8 * j)) & 255); }
};

inline ScalesMins scales_mins(const uint8_t* q) {
  auto word = [q](int i) {
    return static_cast<uint32_t>(q[4 * i]) | static_cast<uint32_t>(q[4 * i + 1]) << 8 |
           static_cast<uint32_t>(q[4 * i + 2]) << 16 | static_cast<uint32_t>(q[4 * i + 3]) << 24;
  };
  const uint32_t w0 = word(0), w1 = word(1), w2 = word(2);
  const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
  const uint32_t sc_high = (w2 & four) | (((w0 >> 6) & two) << 4);
  const uint32_t m_high = ((w2 >> 4) & four) | (((w1 >> 6) & two) << 4);
  return {(w0 & six) | static_cast<uint64_t>(sc_high) << 32,
          (w1 & six) | static_cast<uint64_t>(m_high) << 32};
}

// Q4_K (FIVE false) and Q5_K (true): run j of 32 values takes the low (j even)
// or high nibbles of bytes 32 (j / 2) .. + 31, and for Q5_K bit j of the high
// bytes as bit 4.
template <bool FIVE>
struct DecodeK {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* high = b + 16;
    const uint8_t* codes = b + (FIVE ? 48 : 16);
    const ScalesMins sm = scales_mins(b + 4);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
      const vf d1 = splat(d * static_cast<float>(sm.scale(j)));
      const vf m1 = rounded(splat(dmin * static_cast<float>(sm.min(j))));
#pragma GCC unroll 2
      for (int u = 0; u < 2; u++) {
        const vi q = bytes_to_lanes(codes + 32 * (j / 2) + 16 * u);
        vi v = j % 2 ? q >> 4 : q & 15;
        if constexpr (FIVE) v |= ((bytes_to_lanes(high + 16 * u) >> j) & 1) << 4;
        f(2 * j + u, rounded(to_float(v) * d1) - m1);
      }
    }
  }
};

template <>
struct Decode<GgmlType::Q4_K> : DecodeK<false> {};
template <>
struct Decode<GgmlType::Q5_K> : DecodeK<true> {};

template <>
struct Decode<GgmlType::Q6_K> {
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    const float d = half_at(b + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
      // Run s = 8h + 2t + u: nibbles of the low bytes 64h + 32 (t % 2) + 16u
      // (the high ones for t >= 2), bits 2t of the high bytes 128 + 32h + 16u.
      const int h = s / 8, t = (s % 8) / 2, u = s % 2;
      const vi ql = bytes_to_lanes(b + 64 * h + 32 * (t % 2) + 16 * u);
      const vi qh = bytes_to_lanes(b + 128 + 32 * h + 16 * u);
      const vi q = ((t >= 2 ? ql >> 4 : ql & 15) | (((qh >> (2 * t)) & 3) << 4)) - 32;
      f(s, to_float(q) * splat(d * static_cast<float>(scales[s])));
    }
  }
};

// Calls f(std::integral_constant<GgmlType, T>) for a block-quantized T; false
// for the float types.
template <typename F>
bool with_block_type(GgmlType t, F&& f) {
  using std::integral_constant;
  switch (t) {
    case GgmlType::Q4_0:
      return f(integral_constant<GgmlType, GgmlType::Q4_0>{}), true;
    case GgmlType::Q4_1:
      return f(integral_constant<GgmlType, GgmlType::Q4_1>{}), true;
    case GgmlType::Q5_0:
      return f(integral_constant<GgmlType, GgmlType::Q5_0>{}), true;
    case GgmlType::Q5_1:
      return f(integral_constant<GgmlType, GgmlType::Q5_1>{}), true;
    case GgmlType::Q8_0:
      return f(integral_constant<GgmlType, GgmlType::Q8_0>{}), true;
    case GgmlType::Q2_K:
      return f(integral_constant<GgmlType, GgmlType::Q2_K>{}), true;
    case GgmlType::Q3_K:
      return f(integral_constant<GgmlType, GgmlType::Q3_K>{}), true;
    case GgmlType::Q4_K:
      return f(integral_constant<GgmlType, GgmlType::Q4_K>{}), true;
    case GgmlType::Q5_K:
      return f(integral_constant<GgmlType, GgmlType::Q5_K>{}), true;
    case GgmlType::Q6_K:
      return f(integral_constant<GgmlType, GgmlType::Q6_K>{}), true;
    default:
      return false;
  }
}

bool dense_dtype(GgmlType t, DType* dtype) {
  switch (t) {
    case GgmlType::F32:
      return *dtype = DType::F32, true;
    case GgmlType::F16:
      return *dtype = DType::F16, true;
    case GgmlType::BF16:
      return *dtype = DType::BF16, true;
    default:
      return false;
  }
}

// Each row's sums of x over runs of `len` values, one float32 sum per run, in
// order: the mins' part of a K-quant product (Decode8K::runs).
struct RunSums {
  Vector<float> data;
  int64_t stride = 0;
  RunSums(const Rows& xr, int64_t rows, int64_t k, int64_t len) : stride(k / len) {
    data.resize(static_cast<size_t>(rows * stride));
    for (int64_t m = 0; m < rows; m++)
      for (int64_t r = 0; r < stride; r++) {
        const float* p = xr.row(m) + r * len;
        float t = 0.0f;
        for (int64_t i = 0; i < len; i++) t += p[i];
        data[static_cast<size_t>(m * stride + r)] = t;
      }
  }
  const float* row(int64_t m) const { return data.data() + m * stride; }
};

#if PYLOADER_AVX2_LOOPS
// Decode at avx2: a 16-lane vector is a pair of registers here, so the formats
// most GGUF files hold (Q4_0, Q8_0 and the K-quants but Q2_K/Q3_K) have decoders
// written for 8-lane registers, each calling f(c, v) with v the block's values
// 8c .. 8c + 7, every value the one Decode<T> gives. The other formats go
// through Decode<T> and a block buffer in L1.
//
// Where a weight is a run's scale times a small integer code, that product is
// exact in float32, so the sum of a run's weights times x equals the scale times
// the sum of its codes times x: the decoders of those formats (Q4_0, Q8_0, Q6_K)
// also give runs(b, f), f(r, s, q) with s the scale of run r and q[i] the codes
// of its chunk kChunks r + i as floats, and decode multiplies each run's sum by
// its scale once instead of every weight. Exact because (significant bits):
//   - Q4_0: d (11) times q - 8 in [-8, 7] (3, or 8 itself): 14;
//   - Q8_0: d (11) times q in [-128, 127] (7, or 128): 18;
//   - Q6_K: d * scale (11 + 7: itself exact) times q - 32 (5, or 32): 23.
// each() is the runs' product, so dequantization rounds nothing either.
// Q4_K and Q5_K give runs too, and their mins (kMins): a run's weights times x
// are taken as MLX's affine kernels take them, scale times the codes times x
// less the min times the run's sum of x (Decode8K).

// The float16 at p in every lane.
inline __m256 half_splat8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_broadcastw_epi16(_mm_loadu_si16(p)));
}

// The 32 bytes at p.
inline __m256i bytes32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// A block's 256 codes as bytes in value order, assembled 32 at a time in byte
// lanes (put) and widened 8 at a time from memory (chunk), for the formats whose
// codes take several operations each in 32-bit lanes (Q5_K, Q6_K). AVX2 has no
// byte shifts: the assembly shifts 16-bit lanes and masks off the bits that cross
// from the other byte. ready() makes the compiler store the codes and reload
// them: otherwise it keeps them in registers and extracts each chunk with two or
// three shuffles, which measured no faster than 32-bit lanes; from memory a chunk
// is a load and one shuffle.
struct CodeBytes {
  alignas(32) uint8_t q[256];
  void put(int i, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * i), v); }
  void ready() { __asm__("" : "+m"(q)); }
  // Codes 8c .. 8c + 7 as floats, the bytes read as int8 where SIGNED.
  template <bool SIGNED>
  __m256 chunk(int c) const {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c));
    return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  }
};

template <GgmlType T>
struct Decode8 {
  static constexpr bool kHave = false;
  static constexpr int kChunks = 0;  // of 8 values a run of one scale; 0: no runs()
  static constexpr bool kMins = false;  // runs() returns the runs' mins (K-quants)
};

// f(c, v) for every chunk of the runs D gives: v = s * q[i], c = kChunks r + i.
template <class D, typename F>
inline void each_of_runs(const uint8_t* b, F&& f) {
  D::runs(b, [&](int r, __m256 s, const __m256* q) {
#pragma GCC unroll 4
    for (int i = 0; i < D::kChunks; i++) f(D::kChunks * r + i, _mm256_mul_ps(q[i], s));
  });
}

template <>
struct Decode8<GgmlType::Q4_0> {
  static constexpr bool kHave = true;
  static constexpr int kChunks = 4;
  static constexpr bool kMins = false;
  template <typename F>
  static void runs(const uint8_t* b, F&& f) {
    const __m256i low4 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256 q[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      const __m256i v = avx2_loops::bytes8(b + 2 + 8 * (c % 2));
      q[c] = _mm256_cvtepi32_ps(
          _mm256_sub_epi32(c < 2 ? _mm256_and_si256(v, low4) : _mm256_srli_epi32(v, 4), eight));
    }
    f(0, half_splat8(b), q);
  }
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    each_of_runs<Decode8>(b, f);
  }
};

template <>
struct Decode8<GgmlType::Q8_0> {
  static constexpr bool kHave = true;
  static constexpr int kChunks = 4;
  static constexpr bool kMins = false;
  template <typename F>
  static void runs(const uint8_t* b, F&& f) {
    __m256 q[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
      q[c] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * c))));
    f(0, half_splat8(b), q);
  }
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    each_of_runs<Decode8>(b, f);
  }
};

// The 8 bytes of v as floats.
inline __m256 to_floats8(uint64_t v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(v))));
}

// Q4_K (FIVE false) and Q5_K (true), as DecodeK. The scale d1 = d * sc (11 + 6
// significant bits) times a code (4 or 5) is exact in float32, so one fused
// multiply-subtract rounds once where DecodeK rounds the exact product (a no-op)
// and then the difference: the same value (each()). runs() gives each run of 32
// its d1 and codes and returns the 8 runs' m1 = dmin * m (17 bits, exact): a
// run's weights times x are d1 times its codes times x less m1 times its sum of
// x, the sum MLX's affine kernels take too.
template <bool FIVE>
struct Decode8K {
  static constexpr bool kHave = true;
  static constexpr int kChunks = 4;
  static constexpr bool kMins = true;
  // The 8 values d * sc and the 8 values dmin * m, each one vector product.
  static void scales(const uint8_t* b, __m256* d1, __m256* m1) {
    const ScalesMins sm = scales_mins(b + 4);
    *d1 = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), to_floats8(sm.sc));
    *m1 = _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), to_floats8(sm.m));
  }
  // Runs j (even) and j + 1 take the low and high nibbles of the same bytes,
  // loaded once; g(i, c, v) gets run j + i's chunk c as integer codes.
  template <typename G>
  static void codes(const uint8_t* b, int j, G&& g) {
    const __m256i low4 = _mm256_set1_epi32(15), bit4 = _mm256_set1_epi32(16);
    const uint8_t* high = b + 16;
    const uint8_t* codes = b + (FIVE ? 48 : 16);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      const __m256i q = avx2_loops::bytes8(codes + 16 * j + 8 * c);
      __m256i v[2] = {_mm256_and_si256(q, low4), _mm256_srli_epi32(q, 4)};
      if constexpr (FIVE) {
        // Bit j + i of each high byte as bit 4 (16) of its lane.
        const __m256i h = avx2_loops::bytes8(high + 8 * c);
        const __m256i at4 = j < 4 ? _mm256_slli_epi32(h, 4 - j) : _mm256_srli_epi32(h, j - 4);
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(at4, bit4));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_srli_epi32(at4, 1), bit4));
      }
      g(0, c, v[0]);
      g(1, c, v[1]);
    }
  }
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    __m256 d1v, m1v;
    scales(b, &d1v, &m1v);
    alignas(32) float d1s[8], m1s[8];
    _mm256_store_ps(d1s, d1v);
    _mm256_store_ps(m1s, m1v);
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const __m256 d1[2] = {_mm256_broadcast_ss(d1s + j), _mm256_broadcast_ss(d1s + j + 1)};
      const __m256 m1[2] = {_mm256_broadcast_ss(m1s + j), _mm256_broadcast_ss(m1s + j + 1)};
      codes(b, j, [&](int i, int c, __m256i v) {
        f(4 * (j + i) + c, _mm256_fmsub_ps(_mm256_cvtepi32_ps(v), d1[i], m1[i]));
      });
    }
  }
  template <typename F>
  static __m256 runs(const uint8_t* b, F&& f) {
    __m256 d1v, m1v;
    scales(b, &d1v, &m1v);
    alignas(32) float d1s[8];
    _mm256_store_ps(d1s, d1v);
    if constexpr (FIVE) {
      CodeBytes q8;
      codes5(b, &q8);
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        __m256 q[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) q[c] = q8.chunk<false>(4 * j + c);
        f(j, _mm256_broadcast_ss(d1s + j), q);
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        __m256 q[2][4];
        codes(b, j, [&](int i, int c, __m256i v) { q[i][c] = _mm256_cvtepi32_ps(v); });
        f(j, _mm256_broadcast_ss(d1s + j), q[0]);
        f(j + 1, _mm256_broadcast_ss(d1s + j + 1), q[1]);
      }
    }
    return m1v;
  }

 private:
  // Q5_K's codes (CodeBytes): codes() widens the 32 high bytes once per run pair
  // and moves bit j of each into place in 32-bit lanes. Here bit j goes to bit 4
  // by a 16-bit shift of at most 4 left or 3 right, which moves no bit of the
  // other byte there.
  static void codes5(const uint8_t* b, CodeBytes* q8) {
    const __m256i low4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    const __m256i qh = bytes32(b + 16);
    // Bit j of each high byte at bit 4.
    auto high = [&](int j) {
      const __m256i at4 = j < 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
      return _mm256_and_si256(at4, bit4);
    };
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const __m256i qs = bytes32(b + 48 + 16 * j);
      q8->put(j, _mm256_or_si256(_mm256_and_si256(qs, low4), high(j)));
      q8->put(j + 1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), low4),
                                     high(j + 1)));
    }
    q8->ready();
  }
};

template <>
struct Decode8<GgmlType::Q4_K> : Decode8K<false> {};
template <>
struct Decode8<GgmlType::Q5_K> : Decode8K<true> {};

// Q6_K, as Decode<Q6_K>: each half-block's 128 codes less 32 are assembled as
// CodeBytes, 32 at a time (the low bytes at l and l + 32 and the high byte at l
// serve values l, l + 32, l + 64 and l + 96 of the half).
template <>
struct Decode8<GgmlType::Q6_K> {
  static constexpr bool kHave = true;
  static constexpr int kChunks = 2;
  static constexpr bool kMins = false;
  template <typename F>
  static void runs(const uint8_t* b, F&& f) {
    const __m256 d = half_splat8(b + 208);
    alignas(32) float scale[16];  // d * scales[s], one product each as Decode<Q6_K>
    for (int i = 0; i < 16; i += 8) {
      const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + i));
      _mm256_store_ps(scale + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
    }
    const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(48),
                  bias = _mm256_set1_epi8(32);
    CodeBytes q8;  // the codes less 32, as int8
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      const __m256i la = bytes32(b + 64 * h), lb = bytes32(b + 64 * h + 32),
                    qh = bytes32(b + 128 + 32 * h);
      auto put = [&](int t, __m256i v) { q8.put(4 * h + t, _mm256_sub_epi8(v, bias)); };
      // Value l + 32 t takes its low 4 bits from la (t even) or lb, the low nibble
      // for t < 2, and bits 2t, 2t + 1 of qh as bits 4 and 5.
      put(0, _mm256_or_si256(_mm256_and_si256(la, low4),
                             _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2)));
      put(1, _mm256_or_si256(_mm256_and_si256(lb, low4),
                             _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2)));
      put(2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                             _mm256_and_si256(qh, top2)));
      put(3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2)));
    }
    q8.ready();
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
      const __m256 q[2] = {q8.chunk<true>(2 * r), q8.chunk<true>(2 * r + 1)};
      f(r, _mm256_broadcast_ss(scale + r), q);
    }
  }
  template <typename F>
  static void each(const uint8_t* b, F&& f) {
    each_of_runs<Decode8>(b, f);
  }
};

// kFactor: a run's sum of codes times x is scaled once (Decode8<T>::runs) where
// the format has runs; else every weight is multiplied as decoded.
// sums: where the format has mins (kMins), each row's sums of x over its runs of
// 8 kChunks values (RunSums), else null.
template <GgmlType T, int MB, bool kFactor>
void ggml_fused_avx2(const BlockWeights& w, const Rows& x, int64_t blocks, int64_t m0,
                     int64_t n0, int64_t n1, const Output& out, const RunSums* sums) {
  constexpr int kElems = ggml_format(T).block_elems, kBytes = ggml_format(T).block_bytes;
  constexpr int kAcc = MB <= 2 ? 4 : 2;
  // Up to 2 rows, each decoded vector goes straight into the products; more
  // rows' accumulators leave too few registers, so the block is decoded into
  // buf first.
  constexpr bool kDirect = Decode8<T>::kHave && MB <= 2;
  // Chunks of 8 values in a run of one scale, where runs are summed first; else 0.
  constexpr int kRunChunks = kDirect && kFactor ? Decode8<T>::kChunks : 0;
  alignas(64) float buf[kElems];
  const float* xr[MB];
  const float* sr[MB] = {};  // the rows' run sums, where kMins
  for (int m = 0; m < MB; m++) {
    xr[m] = x.row(m0 + m);
    if constexpr (kRunChunks > 0 && Decode8<T>::kMins) sr[m] = sums->row(m0 + m);
  }
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w.data + n * w.row_bytes;
    __m256 acc[MB][kAcc];
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
      for (int j = 0; j < kAcc; j++) acc[m][j] = _mm256_setzero_ps();
    // Block b; `slot` (kSlot0 or kSlot1, alternating with b) offsets the
    // accumulators a run goes to, so blocks of one run alternate between two.
    auto block = [&](int64_t b, auto slot) {
      const uint8_t* p = row + b * kBytes;
#pragma GCC unroll 4
      for (int off = 0; off < kBytes; off += 64) prefetch_to_l1(p + kPrefetchBytes + off);
      const int64_t k0 = b * kElems;
      // The block's values 8c .. 8c + 7 into every row.
      auto multiply = [&](int c, __m256 wv) {
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++)
          acc[m][c % kAcc] =
              _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[m] + k0 + 8 * c), acc[m][c % kAcc]);
      };
      if constexpr (kRunChunks > 0) {
        // Each run's codes times x, then that sum times the run's scale.
        auto run = [&](int r, __m256 s, const __m256* q) {
#pragma GCC unroll 16
          for (int m = 0; m < MB; m++) {
            const float* xs = xr[m] + k0 + 8 * kRunChunks * r;
            __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xs));
#pragma GCC unroll 4
            for (int i = 1; i < kRunChunks; i++)
              t = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xs + 8 * i), t);
            __m256& a = acc[m][(r + decltype(slot)::value) % kAcc];
            a = _mm256_fmadd_ps(t, s, a);
          }
        };
        if constexpr (Decode8<T>::kMins) {
          // Less the 8 runs' mins times their sums of x.
          const __m256 mins = Decode8<T>::runs(p, run);
#pragma GCC unroll 16
          for (int m = 0; m < MB; m++) {
            __m256& a = acc[m][(decltype(slot)::value + 1) % kAcc];
            a = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(sr[m] + 8 * b), a);
          }
        } else {
          Decode8<T>::runs(p, run);
        }
      } else if constexpr (kDirect) {
        Decode8<T>::each(p, multiply);
      } else {
        if constexpr (Decode8<T>::kHave)
          Decode8<T>::each(p, [&](int c, __m256 v) { _mm256_store_ps(buf + 8 * c, v); });
        else
          Decode<T>::each(p, [&](int c, vf v) { store(buf + 16 * c, v); });
#pragma GCC unroll 8
        for (int c = 0; c < kElems / 8; c++) multiply(c, _mm256_load_ps(buf + 8 * c));
      }
    };
    avx2_loops::in_slot_pairs(blocks, 1, block);
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) {
      __m256 t = acc[m][0];
#pragma GCC unroll 16
      for (int j = 1; j < kAcc; j++) t = _mm256_add_ps(t, acc[m][j]);
      store_out(out, (m0 + m) * w.n + n, avx2_loops::hsum(t));
    }
  }
}
#endif

// `blocks` blocks of T from p decoded into dst.
template <GgmlType T>
void decode_row(const uint8_t* p, int64_t blocks, float* dst) {
  constexpr int kElems = ggml_format(T).block_elems, kBytes = ggml_format(T).block_bytes;
#if PYLOADER_AVX2_LOOPS
  if constexpr (Decode8<T>::kHave) {
    for (int64_t b = 0; b < blocks; b++)
      Decode8<T>::each(p + b * kBytes,
                       [&](int c, __m256 v) { _mm256_storeu_ps(dst + b * kElems + 8 * c, v); });
    return;
  }
#endif
  for (int64_t b = 0; b < blocks; b++)
    Decode<T>::each(p + b * kBytes, [&](int c, vf v) { store(dst + b * kElems + 16 * c, v); });
}

// A run's codes times x are up to 1 / |scale| times its weights times x: summed
// first (avx2's Decode8<T>::runs, formats with runs only; the K-quants' sums of x
// too) only while that cannot leave float32's range.
template <GgmlType T>
bool runs_can_be_summed(const Rows& xr, int64_t rows, int64_t k) {
#if PYLOADER_AVX2_LOOPS
  if constexpr (Decode8<T>::kChunks > 0) {
    float top = 0.0f;
    for (int64_t m = 0; m < rows; m++)
      for (int64_t i = 0; i < k; i++) top = std::max(top, std::fabs(xr.row(m)[i]));
    return top < 0x1p100f;
  }
#endif
  (void)xr, (void)rows, (void)k;
  return false;
}

// Decode: MB activation rows times weight rows n0 .. n1, each block decoded
// in registers and multiplied into every row; kAcc accumulators per row (the
// run's index modulo kAcc) keep the multiply-adds independent.
template <GgmlType T, int MB>
void ggml_fused(const BlockWeights& w, const Rows& x, int64_t blocks, int64_t m0, int64_t n0,
                int64_t n1, const Output& out, bool factor, const RunSums* sums) {
#if PYLOADER_AVX2_LOOPS
  if constexpr (Decode8<T>::kChunks > 0)
    if (factor) return ggml_fused_avx2<T, MB, true>(w, x, blocks, m0, n0, n1, out, sums);
  return ggml_fused_avx2<T, MB, false>(w, x, blocks, m0, n0, n1, out, sums);
#endif
  (void)factor, (void)sums;
  constexpr int kElems = ggml_format(T).block_elems, kBytes = ggml_format(T).block_bytes;
  constexpr int kAcc = MB <= 2 ? 4 : 2;
  const float* xr[MB];
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w.data + n * w.row_bytes;
    vf acc[MB][kAcc] = {};
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t* p = row + b * kBytes;
#pragma GCC unroll 4
      for (int off = 0; off < kBytes; off += 64) prefetch_to_l1(p + kPrefetchBytes + off);
      const int64_t k0 = b * kElems;
      Decode<T>::each(p, [&](int c, vf v) {
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++) acc[m][c % kAcc] += v * load(xr[m] + k0 + 16 * c);
      });
    }
    for (int m = 0; m < MB; m++) {
      vf t = acc[m][0];
      for (int j = 1; j < kAcc; j++) t += acc[m][j];
      store_out(out, (m0 + m) * w.n + n, hsum(t));
    }
  }
}

// Prefill of weight rows n0 .. n0 + rows (rows <= kPanelRows): one panel.
template <GgmlType T>
void ggml_panel(const BlockWeights& w, int64_t blocks, const Rows& xr, int64_t n0, int64_t rows,
                const Output& out) {
  Panel panel(xr.stride);
  for (int64_t j = 0; j < rows; j++) {
    decode_row<T>(w.data + (n0 + j) * w.row_bytes, blocks, panel.row(j));
    panel.clear(j, blocks * ggml_format(T).block_elems);
  }
  panel.multiply(xr, rows, n0, out, w.n);
}

}  // namespace

void ggml_matmul(const Activations& x, const BlockWeights& w, const Output& out) {
  if (x.rows == 0 || w.n == 0) return;
  DType dense;
  if (dense_dtype(w.type, &dense)) return PYLOADER_KERNEL_LEVEL::dense_matmul(x, DenseWeights{w.data, dense, w.n}, out);
  if (x.k == 0) return zero_output(out, x.rows * w.n);
  const Rows xr = convert_rows(x, Order::Plain);
  with_block_type(w.type, [&](auto type) {
    constexpr GgmlType T = decltype(type)::value;
    const int64_t blocks = x.k / ggml_format(T).block_elems;
    if (x.rows <= kFusedRows) {
      const bool factor = runs_can_be_summed<T>(xr, x.rows, x.k);
      std::optional<RunSums> sums;
#if PYLOADER_AVX2_LOOPS
      if constexpr (Decode8<T>::kMins)
        if (factor) sums.emplace(xr, x.rows, x.k, 8 * Decode8<T>::kChunks);
#endif
      fused_split(xr, w.n, [&](auto mb, int64_t m0, int64_t n0, int64_t n1) {
        ggml_fused<T, decltype(mb)::value>(w, xr, blocks, m0, n0, n1, out, factor,
                                           sums ? &*sums : nullptr);
      });
      return;
    }
    parallel_for(tasks_for(w.n, kPanelRows), [&](int64_t t) {
      const int64_t n0 = t * kPanelRows;
      ggml_panel<T>(w, blocks, xr, n0, std::min(kPanelRows, w.n - n0), out);
    });
  });
}

void ggml_dequantize(const BlockWeights& w, int64_t k, float* out) {
  if (w.n == 0 || k == 0) return;
  // Rows a task decodes: about 64 KiB of output.
  const int64_t per = std::max<int64_t>(1, 16384 / k);
  parallel_for(tasks_for(w.n, per), [&](int64_t t) {
    const int64_t r1 = std::min(w.n, (t + 1) * per);
    for (int64_t r = t * per; r < r1; r++) {
      const uint8_t* p = w.data + r * w.row_bytes;
      float* dst = out + r * k;
      DType dense;
      if (dense_dtype(w.type, &dense)) {
        int64_t i = 0;
        for (; i + kLanes <= k; i += kLanes) store(dst + i, load_row16(p, i, dense));
        for (; i < k; i++) dst[i] = scalar_to_float(p, i, dense);
        continue;
      }
      with_block_type(w.type, [&](auto type) {
        constexpr GgmlType T = decltype(type)::value;
        decode_row<T>(p, k / ggml_format(T).block_elems, dst);
      });
    }
  });
}

}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
