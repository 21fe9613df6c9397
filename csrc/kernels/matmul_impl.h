// The matrix products, written once over 16-lane vectors (GCC/Clang vector
// extensions) and compiled once per SIMD level: matmul_<level>.cpp defines
// PYLOADER_KERNEL_LEVEL and includes this file under that level's flags, so
// the same source becomes AVX-512, AVX2 or baseline (SSE2/NEON) code. The few
// operations the vector extensions cannot express well (a 16-entry table
// lookup, half-float conversion) pick their instruction here by the flags the
// file is compiled with.
//
// Every product accumulates in float32 (the avx2 level's 4- and 8-bit decode
// with a 16-bit output sums each group in int32 first: avx2_loops.h, IntRows).
// Activations are converted once per
// call into float32 rows (and, for 2- and 4-bit weights, into the order the
// packed bytes unpack in, so the inner loop never shuffles); weights are
// dequantized in registers as value = scale * q + bias, as MLX defines them.
// Few rows (decode) stream the weights once through fused dot products;
// more rows (prefill) dequantize a panel of weight rows into float32 and run
// a register-blocked product over it.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/half.h"
#include "kernels/kernels.h"
#include "kernels/levels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef PYLOADER_KERNEL_LEVEL
#error "define PYLOADER_KERNEL_LEVEL before including matmul_impl.h"
#endif

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {
namespace {

// Every container this level's code fills. std::vector<float> and friends are
// templates over built-in types: each level's file would emit its own copy of
// their out-of-line members (resize, assign) as a weak symbol under the same
// name, compiled with that level's flags, and the linker keeps one copy for the
// whole library, so code of a lower level (or outside the kernels) could run
// AVX-512 instructions. An allocator of this level's own (internal linkage)
// makes every instantiation this file's alone. Optimized builds check that no
// level's object exports a symbol outside its namespace
// (cmake/check_level_symbols.py; at -O0 every std helper is emitted out of line).
// Buffers start on a cache line: a vector load that straddles two lines costs
// two.
template <typename T>
constexpr std::size_t kAlign = alignof(T) > 64 ? alignof(T) : 64;
template <typename T>
struct LevelAllocator {
  using value_type = T;
  LevelAllocator() = default;
  template <typename U>
  LevelAllocator(const LevelAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > std::size_t(-1) / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kAlign<T>)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    ::operator delete(p, n * sizeof(T), std::align_val_t(kAlign<T>));
  }
  template <typename U>
  bool operator==(const LevelAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const LevelAllocator<U>&) const noexcept {
    return false;
  }
};
template <typename T>
using Vector = std::vector<T, LevelAllocator<T>>;

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr int kLanes = 16;

// Rows of decode handled by the fused path; more go through panels.
constexpr int64_t kFusedRows = 4;
// How far ahead of the bytes being unpacked the fused loops prefetch.
constexpr int64_t kPrefetchBytes = 4096;
// Weights are read once per product: dense and 8-bit rows, whose loads keep up
// with the arithmetic, prefetch into L2 only (prefetcht1); 4-bit rows, where
// unpacking sets the pace, prefetch into L1 (docs/kernels.md).
inline void prefetch_to_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline void prefetch_to_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
// Weight rows per panel (a task of the prefill path) and the register tile of
// its product: kTileM activation rows by kTileN weight rows, as many as the
// registers hold (kTileM x kTileN accumulators, kTileN weight vectors and one
// activation vector; a 16-lane vector is two registers below AVX-512).
#if defined(__AVX512F__)
constexpr int64_t kPanelRows = 32;
constexpr int kTileM = 6;
constexpr int kTileN = 4;
#elif defined(__AVX2__)
// avx2_loops.h's tile: 8-lane registers, 4 x 3 of them accumulating.
#define PYLOADER_AVX2_LOOPS 1
constexpr int64_t kPanelRows = 24;
constexpr int kTileM = 4;
constexpr int kTileN = 3;
#else
constexpr int64_t kPanelRows = 32;
constexpr int kTileM = 2;
constexpr int kTileN = 2;
#endif

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// s in every lane. Subtracting zero keeps every value as it is, -0 included
// (adding +0 would turn -0 into +0).
inline vf splat(float s) { return s - vf{}; }
inline vf iota() { return vf{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
// The value of each FP4 (E2M1) code: bit 3 the sign, then two exponent bits and
// one mantissa bit.
inline vf fp4_values() {
  return vf{0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
}
// An E8M0 scale: 2^(e - 127); 0 is 2^-127 (a float32 subnormal), 255 NaN.
inline float e8m0_to_float(uint8_t e) {
  if (e == 255) return bits_to_float(0x7fc00000u);
  return bits_to_float(e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23);
}

#if defined(__AVX2__) || defined(__F16C__)
// Two 8-lane registers as one 16-lane vector.
template <typename V, typename H>
inline V join(H low, H high) {
  H halves[2] = {low, high};
  V out;
  std::memcpy(&out, halves, sizeof out);
  return out;
}
#endif

// 16 bytes, zero-extended to 32-bit lanes.
inline vi bytes_to_lanes(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return join<vi>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  // Widen through 16-bit lanes: compilers lower these two steps to
  // unpack/zip instructions, where a direct 8-to-32-bit conversion is
  // often done a lane at a time.
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, vh), vi);
#endif
}
inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }

inline vf select(vi mask, vf a, vf b) {
  return reinterpret_cast<vf>((mask & reinterpret_cast<vi>(a)) | (~mask & reinterpret_cast<vi>(b)));
}

// table[idx & 15] per lane.
inline vf lookup(vf table, vi idx) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(
      _mm512_permutexvar_ps(reinterpret_cast<__m512i>(idx), reinterpret_cast<__m512>(table)));
#elif defined(__AVX2__)
  __m256 t[2], r[2];
  __m256i ix[2];
  std::memcpy(t, &table, sizeof t);
  std::memcpy(ix, &idx, sizeof ix);
  for (int h = 0; h < 2; h++) {
    __m256 lo = _mm256_permutevar8x32_ps(t[0], ix[h]);
    __m256 hi = _mm256_permutevar8x32_ps(t[1], ix[h]);
    // Bit 3 of the index picks the upper half of the table.
    r[h] = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(ix[h], 28)));
  }
  return join<vf>(r[0], r[1]);
#else
  vf out;
  for (int i = 0; i < kLanes; i++) out[i] = table[idx[i] & 15];
  return out;
#endif
}

inline vf load_f16(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return join<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                  _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  // Exact conversion in integer lanes: normal numbers rebias the exponent;
  // subnormals are scaled from a biased float; inf and NaN keep all-ones.
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu x = __builtin_convertvector(h, vu);
  vu sign = (x & 0x8000u) << 16;
  vu o = (x & 0x7fffu) << 13;
  vu e = o & (0x7c00u << 13);
  o += (127u - 15u) << 23;
  vi is_special = reinterpret_cast<vi>(e == (0x7c00u << 13));
  o += reinterpret_cast<vu>(is_special) & ((128u - 16u) << 23);
  vi is_small = reinterpret_cast<vi>(e == 0u);
  vf small = reinterpret_cast<vf>(o + (1u << 23)) - reinterpret_cast<vf>(vu{} + (113u << 23));
  vf f = select(is_small, small, reinterpret_cast<vf>(o));
  return reinterpret_cast<vf>(reinterpret_cast<vu>(f) | sign);
#endif
}

inline vf load_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#endif
  float s[kLanes];
  std::memcpy(s, &v, sizeof s);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; i++) s[i] += s[i + w];
  return s[0];
}

// Element i of an array of dtype T as float32.
template <DType T>
inline float scalar_of(const void* base, int64_t i) {
  if constexpr (T == DType::F32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == DType::BF16) {
    return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
#if defined(__F16C__)
    return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
#else
    return f16_to_float(static_cast<const uint16_t*>(base)[i]);
#endif
  }
}

// The same with the dtype known only at run time.
inline float scalar_to_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::F32:
      return scalar_of<DType::F32>(base, i);
    case DType::F16:
      return scalar_of<DType::F16>(base, i);
    case DType::BF16:
      return scalar_of<DType::BF16>(base, i);
  }
  return 0.0f;
}

inline void store_out(const Output& out, int64_t i, float v) {
  switch (out.dtype) {
    case DType::F32:
      static_cast<float*>(out.data)[i] = v;
      break;
    case DType::F16:
      static_cast<uint16_t*>(out.data)[i] = float_to_f16(v);
      break;
    case DType::BF16:
      static_cast<uint16_t*>(out.data)[i] = float_to_bf16(v);
      break;
  }
}

// 16 consecutive values of a row of `t`, as float32.
inline vf load_row16(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::F32:
      return load(static_cast<const float*>(base) + i);
    case DType::F16:
      return load_f16(static_cast<const uint16_t*>(base) + i);
    case DType::BF16:
      return load_bf16(static_cast<const uint16_t*>(base) + i);
  }
  return vf{};
}

// 16 floats into elements i .. i + 15 of an array of dtype t, each rounded
// to nearest even as float_to_f16 and float_to_bf16 round it.
inline void store_row16(void* base, int64_t i, DType t, vf v) {
  switch (t) {
    case DType::F32:
      store(static_cast<float*>(base) + i, v);
      return;
    case DType::F16: {
      auto* dst = static_cast<uint16_t*>(base) + i;
#if defined(__AVX512F__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                          _mm512_cvtps_ph(reinterpret_cast<__m512>(v),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
      float f[kLanes];
      std::memcpy(f, &v, sizeof f);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                       _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8),
                       _mm256_cvtps_ph(_mm256_loadu_ps(f + 8), _MM_FROUND_TO_NEAREST_INT));
#else
      float f[kLanes];
      std::memcpy(f, &v, sizeof f);
      for (int j = 0; j < kLanes; j++) dst[j] = float_to_f16(f[j]);
#endif
      return;
    }
    case DType::BF16: {
      // Round to nearest even in integer lanes; a NaN stays a (quiet) NaN.
      const vu bits = reinterpret_cast<vu>(v);
      const vu rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16;
      // NaN lanes by the sign of a difference, not a comparison: compilers
      // split 16-lane comparisons into one per lane where registers are narrower.
      const vi nan_lanes = reinterpret_cast<vi>(0x7f800000u - (bits & 0x7fffffffu)) >> 31;
      const vu nan = reinterpret_cast<vu>(nan_lanes);
      const vh h = __builtin_convertvector((nan & ((bits >> 16) | 0x40u)) | (~nan & rounded), vh);
      std::memcpy(static_cast<uint16_t*>(base) + i, &h, sizeof h);
      return;
    }
  }
}

// How packed values sit in the vectors the fused loops read. Plain: value k at
// position k. Nibbles (4-bit): each 16 bytes hold 32 values; the low nibbles
// (even k) come first, then the high ones. Crumbs (2-bit, k a multiple of
// 64): each 16 bytes hold 64 values; four planes of 16, plane p holding the
// values 4i + p. Activations are stored in the same order.
enum class Order { Plain, Nibbles, Crumbs };

Order order_for(int bits, int64_t k) {
  if (bits == 4) return Order::Nibbles;
  if (bits == 2 && k % 64 == 0) return Order::Crumbs;
  return Order::Plain;
}

int64_t padded(int64_t k) { return (k + kLanes - 1) / kLanes * kLanes; }

// Element i of an array of dtype t.
inline const void* element(const void* base, int64_t i, DType t) {
  return static_cast<const char*>(base) + i * (t == DType::F32 ? 4 : 2);
}

// The `n` values of dtype t at p as float32 into dst, then zeros up to
// padded(n).
void row_to_float(const void* p, DType t, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_row16(p, i, t));
  for (; i < n; i++) dst[i] = scalar_to_float(p, i, t);
  for (; i < padded(n); i++) dst[i] = 0.0f;
}

// x as float32 rows of padded(k) (zeros after k), in `order`; rows padded to
// a multiple of kTileM with zero rows.
struct Rows {
  Vector<float> data;
  int64_t stride = 0, rows = 0;
  const float* row(int64_t m) const { return data.data() + m * stride; }
};

Rows convert_rows(const Activations& x, Order order) {
  Rows r;
  r.stride = padded(x.k);
  r.rows = x.rows;
  const int64_t alloc_rows = (x.rows + kTileM - 1) / kTileM * kTileM;
  r.data.assign(static_cast<size_t>(alloc_rows * r.stride), 0.0f);
  Vector<float> plain(static_cast<size_t>(r.stride));
  for (int64_t m = 0; m < x.rows; m++) {
    float* dst = r.data.data() + m * r.stride;
    float* tmp = order == Order::Plain ? dst : plain.data();
    row_to_float(element(x.data, m * x.k, x.dtype), x.dtype, x.k, tmp);
    if (order == Order::Nibbles) {
      for (int64_t c = 0; c < x.k; c += 32)
        for (int j = 0; j < 16; j++) {
          dst[c + j] = tmp[c + 2 * j];
          dst[c + 16 + j] = tmp[c + 2 * j + 1];
        }
    } else if (order == Order::Crumbs) {
      for (int64_t c = 0; c < x.k; c += 64)
        for (int p = 0; p < 4; p++)
          for (int j = 0; j < 16; j++) dst[c + 16 * p + j] = tmp[c + 4 * j + p];
    }
  }
  return r;
}

// ---------------------------------------------------------------------------
// Quantized weights (affine and mxfp4).

struct Quantized {
  const QuantizedWeights& w;
  int64_t k, groups, row_bytes;
  Order order;

  Quantized(const QuantizedWeights& weights, int64_t k_)
      : w(weights),
        k(k_),
        groups(k_ / weights.group_size),
        row_bytes(k_ * weights.bits / 8),
        order(order_for(weights.bits, k_)) {}

  const uint8_t* row(int64_t n) const {
    return reinterpret_cast<const uint8_t*>(w.packed) + n * row_bytes;
  }
  bool mxfp4() const { return w.mode == QuantMode::Mxfp4; }
  float scale(int64_t n, int64_t g) const {
    if (mxfp4()) return e8m0_to_float(static_cast<const uint8_t*>(w.scales)[n * groups + g]);
    return scalar_to_float(w.scales, n * groups + g, w.scale_dtype);
  }
  float bias(int64_t n, int64_t g) const {
    return mxfp4() ? 0.0f : scalar_to_float(w.biases, n * groups + g, w.scale_dtype);
  }
  // The 16 values a 4-bit code of row n's group g stands for.
  vf table4(int64_t n, int64_t g) const {
    return mxfp4() ? fp4_values() * scale(n, g) : iota() * scale(n, g) + bias(n, g);
  }

  // Values [k0, k0 + count) of row n, dequantized, in plain order, for the
  // bit widths without a vector path (1, 3, 5, 6, and 2 when k is not a
  // multiple of 64). The packing is a little-endian bit stream.
  void dequantize_plain(int64_t n, int64_t k0, int64_t count, float* dst) const {
    const uint8_t* bytes = row(n);
    const int bits = w.bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t i = 0; i < count; i++) {
      const int64_t kk = k0 + i;
      const int64_t bit = kk * bits;
      const int64_t byte = bit >> 3;
      uint32_t word = bytes[byte];
      if (byte + 1 < row_bytes) word |= static_cast<uint32_t>(bytes[byte + 1]) << 8;
      const uint32_t q = (word >> (bit & 7)) & mask;
      const int64_t g = kk / w.group_size;
      dst[i] = scale(n, g) * static_cast<float>(q) + bias(n, g);
    }
  }
};

// Calls f(k, v, slot) for all of row n, v holding the 16 dequantized values
// at k..k+15 in the weights' order: the inner loop of both paths. The slot (a
// compile-time 0 or 1, alternating) lets the caller keep two accumulators.
constexpr std::integral_constant<int, 0> kSlot0{};
constexpr std::integral_constant<int, 1> kSlot1{};

template <typename F>
inline void for_each_chunk(const Quantized& a, int64_t n, F&& f) {
  const uint8_t* bytes = a.row(n);
  const int64_t gs = a.w.group_size;
  if (a.w.bits == 4) {
    for (int64_t g = 0; g < a.groups; g++) {
      const vf table = a.table4(n, g);
      for (int64_t c = g * gs; c < (g + 1) * gs; c += 32) {
        prefetch_to_l1(bytes + c / 2 + kPrefetchBytes);
        const vi q = bytes_to_lanes(bytes + c / 2);
        f(c, lookup(table, q), kSlot0);
        f(c + 16, lookup(table, q >> 4), kSlot1);
      }
    }
  } else if (a.w.bits == 8) {
    for (int64_t g = 0; g < a.groups; g++) {
      const vf s = splat(a.scale(n, g)), b = splat(a.bias(n, g));
      for (int64_t c = g * gs; c < (g + 1) * gs; c += 32) {
        prefetch_to_l2(bytes + c + kPrefetchBytes);
        f(c, to_float(bytes_to_lanes(bytes + c)) * s + b, kSlot0);
        f(c + 16, to_float(bytes_to_lanes(bytes + c + 16)) * s + b, kSlot1);
      }
    }
  } else if (a.order == Order::Crumbs) {
    // 64 values a chunk; with groups of 32, lanes 8..15 (values 32..63) belong
    // to the next group, which takes table entries 4..7.
    const vf mod4 = vf{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
    const vi first4 = vi{-1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const vi upper = vi{0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4};
    const bool split = gs == 32;
    for (int64_t c = 0; c < a.k; c += 64) {
      const int64_t ga = c / gs, gb = (c + 32) / gs;
      const vf s = select(first4, splat(a.scale(n, ga)), splat(a.scale(n, gb)));
      const vf b = select(first4, splat(a.bias(n, ga)), splat(a.bias(n, gb)));
      const vf table = mod4 * s + b;
      prefetch_to_l2(bytes + c / 4 + kPrefetchBytes);
      const vi q = bytes_to_lanes(bytes + c / 4);
      const vi off = split ? upper : vi{};
      f(c, lookup(table, (q & 3) | off), kSlot0);
      f(c + 16, lookup(table, ((q >> 2) & 3) | off), kSlot1);
      f(c + 32, lookup(table, ((q >> 4) & 3) | off), kSlot0);
      f(c + 48, lookup(table, ((q >> 6) & 3) | off), kSlot1);
    }
  } else {
    float tmp[128];
    for (int64_t g = 0; g < a.groups; g++) {
      a.dequantize_plain(n, g * gs, gs, tmp);
      for (int64_t c = 0; c < gs; c += 32) {
        f(g * gs + c, load(tmp + c), kSlot0);
        f(g * gs + c + 16, load(tmp + c + 16), kSlot1);
      }
    }
  }
}

// Decode: up to kFusedRows activation rows, the weights streamed once.
//
// `count` scales (or biases) of dtype T from `base + i` as float32 into `dst`.
template <DType T>
inline void floats_of(const void* base, int64_t i, int64_t count, float* dst) {
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) store(dst + j, load_row16(base, i + j, T));
  for (; j < count; j++) dst[j] = scalar_of<T>(base, i + j);
}

// `count` E8M0 scales from `base + i` as float32 into `dst`.
inline void exponents_of(const void* base, int64_t i, int64_t count, float* dst) {
  const auto* p = static_cast<const uint8_t*>(base) + i;
  for (int64_t j = 0; j < count; j++) dst[j] = e8m0_to_float(p[j]);
}

// The formats the fast loops are compiled for: 4 or 8 bits in groups of 32,
// 64 or 128 with float32, float16 or bfloat16 scales, and mxfp4 (4 bits in
// groups of 32). Calls f(bits, group size, scale dtype, mxfp4), each a
// compile-time constant (std::integral_constant), and returns true; false for
// any other format.
template <typename F>
bool with_fast_format(const Quantized& a, F&& f) {
  using std::integral_constant;
  const auto by_scales = [&](auto bits, auto gs) {
    if (a.mxfp4()) {
      if constexpr (decltype(bits)::value == 4 && decltype(gs)::value == 32) {
        f(bits, gs, integral_constant<DType, DType::F32>{}, std::true_type{});
        return true;
      }
      return false;
    }
    switch (a.w.scale_dtype) {
      case DType::F32:
        f(bits, gs, integral_constant<DType, DType::F32>{}, std::false_type{});
        return true;
      case DType::F16:
        f(bits, gs, integral_constant<DType, DType::F16>{}, std::false_type{});
        return true;
      case DType::BF16:
        f(bits, gs, integral_constant<DType, DType::BF16>{}, std::false_type{});
        return true;
    }
    return false;
  };
  const auto by_group = [&](auto bits) {
    switch (a.w.group_size) {
      case 32:
        return by_scales(bits, integral_constant<int, 32>{});
      case 64:
        return by_scales(bits, integral_constant<int, 64>{});
      case 128:
        return by_scales(bits, integral_constant<int, 128>{});
      default:
        return false;
    }
  };
  if (a.w.bits == 4) return by_group(integral_constant<int, 4>{});
  if (a.w.bits == 8) return by_group(integral_constant<int, 8>{});
  return false;
}

#if PYLOADER_AVX2_LOOPS
#include "kernels/avx2_loops.h"
#endif

// Decode at 4 or 8 bits, the two formats models ship in: each group's bytes are
// unpacked once and multiplied into MB activation rows, with four accumulators
// per row (one per 16-value chunk of a 64-value stretch) so no chain of adds
// waits on another. GS and the scales' dtype are compile-time constants, so the
// loop over a group is unrolled and holds no division; a row's scales and
// biases are converted to float32 a block at a time, so a group's table costs
// two broadcast loads and one multiply-add. MX: mxfp4 (the codes' values times
// the group's E8M0 scale, no biases).
template <int MB, int BITS, int GS, DType ST, bool MX = false>
void quantized_fused_fast(const Quantized& a, const Rows& x, int64_t m0, int64_t n0, int64_t n1,
                          const Output& out, int64_t n_total) {
  constexpr int kGroupBytes = GS * BITS / 8;
  constexpr int64_t kBlock = 128;  // groups converted at once
  const int64_t groups = a.groups;
  const float* xr[MB];
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  alignas(64) float sc[kBlock], bi[kBlock];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = a.row(n);
    const int64_t sbase = n * groups;
    vf acc[MB][4] = {};
    for (int64_t g0 = 0; g0 < groups; g0 += kBlock) {
      const int64_t gn = std::min(kBlock, groups - g0);
      if constexpr (MX) {
        exponents_of(a.w.scales, sbase + g0, gn, sc);
      } else {
        floats_of<ST>(a.w.scales, sbase + g0, gn, sc);
        floats_of<ST>(a.w.biases, sbase + g0, gn, bi);
      }
      for (int64_t gi = 0; gi < gn; gi++) {
        const int64_t g = g0 + gi;
        const uint8_t* p = row + g * kGroupBytes;
        const int64_t k0 = g * GS;
        if constexpr (BITS == 4) {
          prefetch_to_l1(p + kPrefetchBytes);
          const vf table = MX ? fp4_values() * sc[gi] : iota() * sc[gi] + bi[gi];
#pragma GCC unroll 4
          for (int c = 0; c < GS; c += 32) {
            const vi q = bytes_to_lanes(p + c / 2);
            const vf lo = lookup(table, q), hi = lookup(table, q >> 4);
            const int slot = (c / 32) % 2 * 2;
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++) {
              acc[m][slot] += lo * load(xr[m] + k0 + c);
              acc[m][slot + 1] += hi * load(xr[m] + k0 + c + 16);
            }
          }
        } else {
          prefetch_to_l2(p + kPrefetchBytes);
          const vf vs = splat(sc[gi]), vb = splat(bi[gi]);
#pragma GCC unroll 8
          for (int c = 0; c < GS; c += 16) {
            const vf w = to_float(bytes_to_lanes(p + c)) * vs + vb;
            const int slot = (c / 16) % 4;
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++) acc[m][slot] += w * load(xr[m] + k0 + c);
          }
        }
      }
    }
    for (int m = 0; m < MB; m++)
      store_out(out, (m0 + m) * n_total + n,
                hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])));
  }
}

template <int MB>
void quantized_fused(const Quantized& a, const Rows& x, int64_t m0, int64_t n0, int64_t n1,
                     const Output& out, int64_t n_total) {
#if PYLOADER_AVX2_LOOPS
  if (avx2_loops::quantized_fused<MB>(a, x, m0, n0, n1, out, n_total)) return;
#endif
  if (with_fast_format(a, [&](auto bits, auto gs, auto st, auto mx) {
        quantized_fused_fast<MB, decltype(bits)::value, decltype(gs)::value, decltype(st)::value,
                             decltype(mx)::value>(a, x, m0, n0, n1, out, n_total);
      }))
    return;
  // Two accumulators per row (the chunk's slot) break the chain of adds.
  for (int64_t n = n0; n < n1; n++) {
    vf acc[MB][2] = {};
    for_each_chunk(a, n, [&](int64_t k, vf wv, auto slot) {
#pragma GCC unroll 16
      for (int m = 0; m < MB; m++) acc[m][decltype(slot)::value] += wv * load(x.row(m0 + m) + k);
    });
    for (int m = 0; m < MB; m++)
      store_out(out, (m0 + m) * n_total + n, hsum(acc[m][0] + acc[m][1]));
  }
}

// Prefill: a panel of kPanelRows weight rows dequantized once into float32,
// row-major in the activations' k order, then reused by every activation row.
// The product is a register tile of kTileM activation rows by kTileN weight
// rows: each step loads one vector of each and multiplies every pair, so each
// output lane sums every 16th k of its row, and the lanes are added at the end
// (as the decode path does). Building the panel writes whole vectors, never
// scatters.
class Panel {
 public:
  explicit Panel(int64_t stride) : stride_(stride) {
    thread_local Vector<float> buffer;
    const size_t need = static_cast<size_t>(kPanelRows * stride);
    if (buffer.size() < need) buffer.resize(need);
    data_ = buffer.data();
  }
  float* row(int64_t j) { return data_ + j * stride_; }
  // Row j's values at k .. k + 15.
  void put(int64_t j, int64_t k, vf v) { store(row(j) + k, v); }
  // Row j's values from k to the padded end are zero (the tail of a row whose
  // k is not a multiple of the vector width, and rows past the matrix's end).
  void clear(int64_t j, int64_t k) {
    std::fill(data_ + j * stride_ + k, data_ + (j + 1) * stride_, 0.0f);
  }

  // out[m, n0 + j] for every activation row m and panel row j < rows.
  // Rows past `rows` up to the tile's width are cleared first: the tile reads
  // them (and never stores their sums).
  //
  // Blocked for the caches: kBlockK of k at a time, so the tile's activation
  // rows and the panel's slice of every weight row stay in L1 while the tiles
  // sweep them; the accumulators of kBlockM activation rows wait in a buffer
  // between slices. Each lane still adds its k in order, so the blocking
  // changes no result.
  void multiply(const Rows& x, int64_t rows, int64_t n0, const Output& out, int64_t n_total) {
    for (int64_t j = rows; j < round_up(rows, kTileN); j++) clear(j, 0);
#if PYLOADER_AVX2_LOOPS
    avx2_loops::panel_multiply(data_, stride_, x, rows, n0, out, n_total, kBlockM, kBlockK);
#else
    thread_local Vector<vf> part;
    thread_local Vector<float> res;
    part.resize(static_cast<size_t>(kBlockM * kPanelRows));
    res.resize(static_cast<size_t>(kBlockM * kPanelRows));
    for (int64_t mb = 0; mb < x.rows; mb += kBlockM) {
      // Rows holds its rows rounded up to kTileM (zeros past the end).
      const int64_t m_rows = std::min(kBlockM, round_up(x.rows - mb, kTileM));
      for (int64_t k0 = 0; k0 < stride_; k0 += kBlockK) {
        const int64_t k1 = std::min(stride_, k0 + kBlockK);
        for (int64_t m = 0; m < m_rows; m += kTileM)
          for (int64_t j = 0; j < rows; j += kTileN)
            tile(x, mb + m, j, k0, k1, k0 == 0, k1 == stride_,
                 part.data() + m * kPanelRows + j, res.data() + m * kPanelRows + j);
      }
      for (int64_t m = 0; m < m_rows && mb + m < x.rows; m++) {
        const float* r = res.data() + m * kPanelRows;
        const int64_t o = (mb + m) * n_total + n0;
        int64_t j = 0;
        for (; j + kLanes <= rows; j += kLanes) store_row16(out.data, o + j, out.dtype, load(r + j));
        for (; j < rows; j++) store_out(out, o + j, r[j]);
      }
    }
#endif
  }

 private:
#if PYLOADER_AVX2_LOOPS
  // Blocks of 512 k by 16 tiles of activation rows: on an AVX2-only EPYC
  // (Zen 3), float16 and 4-bit products of 256 rows ran ~7% faster than with
  // 256 by 8 (fewer trips of the partial sums through memory). The wider
  // levels keep the tuning they were measured with.
  static constexpr int64_t kBlockK = 512;
  static constexpr int64_t kBlockM = 16 * kTileM;
#else
  static constexpr int64_t kBlockK = 256;
  static constexpr int64_t kBlockM = 8 * kTileM;
#endif
  static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

  // The tile's kTileM x kTileN products over k0 .. k1: the lane sums carry over
  // between blocks of k at part[i * kPanelRows + r] (read unless `first`);
  // after the `last` block each one's total goes to res[i * kPanelRows + r].
  void tile(const Rows& x, int64_t m, int64_t j0, int64_t k0, int64_t k1, bool first, bool last,
            vf* part, float* res) const {
    vf acc[kTileM][kTileN];
    const float* xr[kTileM];
    const float* wr[kTileN];
#pragma GCC unroll 16
    for (int i = 0; i < kTileM; i++) {
      xr[i] = x.row(m + i);
#pragma GCC unroll 16
      for (int r = 0; r < kTileN; r++) acc[i][r] = first ? vf{} : part[i * kPanelRows + r];
    }
#pragma GCC unroll 16
    for (int r = 0; r < kTileN; r++) wr[r] = data_ + (j0 + r) * stride_;
    for (int64_t k = k0; k < k1; k += kLanes) {
      vf wv[kTileN];
#pragma GCC unroll 16
      for (int r = 0; r < kTileN; r++) wv[r] = load(wr[r] + k);
#pragma GCC unroll 16
      for (int i = 0; i < kTileM; i++) {
        const vf xv = load(xr[i] + k);
#pragma GCC unroll 16
        for (int r = 0; r < kTileN; r++) acc[i][r] += xv * wv[r];
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < kTileM; i++)
#pragma GCC unroll 16
      for (int r = 0; r < kTileN; r++) {
        if (last)
          res[i * kPanelRows + r] = hsum(acc[i][r]);
        else
          part[i * kPanelRows + r] = acc[i][r];
      }
  }

  int64_t stride_;
  float* data_;
};

int64_t tasks_for(int64_t n, int64_t rows_per_task) { return (n + rows_per_task - 1) / rows_per_task; }

// Rows of weights a decode task takes: enough tasks to balance the threads,
// few enough that each streams a useful stretch.
int64_t fused_rows_per_task(int64_t n) {
  const int64_t threads = static_cast<int64_t>(thread_count());
  return std::max<int64_t>(8, (n + threads * 8 - 1) / (threads * 8));
}

template <typename R, typename Fused>
void fused_split(const R& x, int64_t n, Fused&& fused) {
  const int64_t per = fused_rows_per_task(n);
  parallel_for(tasks_for(n, per), [&](int64_t t) {
    const int64_t n0 = t * per, n1 = std::min(n, n0 + per);
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) fused(std::integral_constant<int, 4>{}, m, n0, n1);
    switch (x.rows - m) {
      case 3:
        fused(std::integral_constant<int, 3>{}, m, n0, n1);
        break;
      case 2:
        fused(std::integral_constant<int, 2>{}, m, n0, n1);
        break;
      case 1:
        fused(std::integral_constant<int, 1>{}, m, n0, n1);
        break;
      default:
        break;
    }
  });
}

void zero_output(const Output& out, int64_t count) {
  for (int64_t i = 0; i < count; i++) store_out(out, i, 0.0f);
}

// Decode with dense weights of dtype WT: each row streamed once, four
// accumulators per activation row, no dtype switch in the loop.
template <int MB, DType WT>
void dense_fused(const DenseWeights& w, const Rows& x, int64_t k, int64_t m0, int64_t n0,
                 int64_t n1, const Output& out) {
#if PYLOADER_AVX2_LOOPS
  return avx2_loops::dense_fused<MB, WT>(w, x, k, m0, n0, n1, out);
#endif
  constexpr int64_t kItem = WT == DType::F32 ? 4 : 2;
  const int64_t full = k / kLanes * kLanes;
  const float* xr[MB];
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  for (int64_t n = n0; n < n1; n++) {
    const int64_t base = n * k;
    const char* row = static_cast<const char*>(w.data) + base * kItem;
    vf acc[MB][4] = {};
    int64_t i = 0;
    for (; i + 4 * kLanes <= full; i += 4 * kLanes) {
      prefetch_to_l2(row + i * kItem + kPrefetchBytes);
      prefetch_to_l2(row + i * kItem + kPrefetchBytes + 64);
      if constexpr (kItem == 4) {
        prefetch_to_l2(row + i * kItem + kPrefetchBytes + 128);
        prefetch_to_l2(row + i * kItem + kPrefetchBytes + 192);
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) {
        const vf wv = load_row16(w.data, base + i + c * kLanes, WT);
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++) acc[m][c] += wv * load(xr[m] + i + c * kLanes);
      }
    }
    for (; i < full; i += kLanes) {
      const vf wv = load_row16(w.data, base + i, WT);
#pragma GCC unroll 16
      for (int m = 0; m < MB; m++) acc[m][0] += wv * load(xr[m] + i);
    }
    for (int m = 0; m < MB; m++) {
      float sum = hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]));
      for (int64_t r = full; r < k; r++) sum += scalar_to_float(w.data, base + r, WT) * xr[m][r];
      store_out(out, (m0 + m) * w.n + n, sum);
    }
  }
}

// Prefill of weight rows n0 .. n0 + rows (rows <= kPanelRows): one panel.
void quantized_panel(const Quantized& a, const Rows& xr, int64_t n0, int64_t rows,
                     const Output& out) {
  Panel panel(xr.stride);
  for (int64_t j = 0; j < rows; j++) {
#if PYLOADER_AVX2_LOOPS
    if (!avx2_loops::dequantize_row(a, n0 + j, panel.row(j)))
#endif
      for_each_chunk(a, n0 + j, [&](int64_t k, vf wv, auto) { panel.put(j, k, wv); });
    panel.clear(j, a.k);
  }
  panel.multiply(xr, rows, n0, out, a.w.n);
}

void dense_panel(const DenseWeights& w, int64_t k, const Rows& xr, int64_t n0, int64_t rows,
                 const Output& out) {
  Panel panel(xr.stride);
#if PYLOADER_AVX2_LOOPS
  using avx2_loops::row_to_float;
#endif
  for (int64_t j = 0; j < rows; j++)
    row_to_float(element(w.data, (n0 + j) * k, w.dtype), w.dtype, k, panel.row(j));
  panel.multiply(xr, rows, n0, out, w.n);
}

}  // namespace
}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL

#if defined(__AMX_BF16__)
#include "kernels/amx_impl.h"
#endif

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {

void quantized_matmul(const Activations& x, const QuantizedWeights& w, const Output& out) {
  const Quantized a(w, x.k);
  if (x.rows == 0 || w.n == 0) return;
#if defined(__AMX_BF16__)
  if (x.rows > kFusedRows && tiles::quantized_matmul(x, a, out)) return;
#endif
#if PYLOADER_AVX2_LOOPS
  avx2_loops::IntRows codes;
  if (x.rows <= kFusedRows && avx2_loops::int_eligible(a, out) &&
      avx2_loops::to_codes(x, w.bits, w.group_size, codes)) {
    fused_split(codes, w.n, [&](auto mb, int64_t m0, int64_t n0, int64_t n1) {
      avx2_loops::int_fused<decltype(mb)::value>(a, codes, m0, n0, n1, out, w.n);
    });
    return;
  }
#endif
  const Rows xr = convert_rows(x, a.order);
  if (x.rows <= kFusedRows) {
    fused_split(xr, w.n, [&](auto mb, int64_t m0, int64_t n0, int64_t n1) {
      quantized_fused<decltype(mb)::value>(a, xr, m0, n0, n1, out, w.n);
    });
    return;
  }
  parallel_for(tasks_for(w.n, kPanelRows), [&](int64_t t) {
    const int64_t n0 = t * kPanelRows;
    quantized_panel(a, xr, n0, std::min(kPanelRows, w.n - n0), out);
  });
}

void dense_matmul(const Activations& x, const DenseWeights& w, const Output& out) {
  if (x.rows == 0 || w.n == 0) return;
  if (x.k == 0) return zero_output(out, x.rows * w.n);
#if defined(__AMX_BF16__)
  if (x.rows > kFusedRows && tiles::dense_matmul(x, w, out)) return;
#endif
  const Rows xr = convert_rows(x, Order::Plain);
  const int64_t k = x.k;
  if (x.rows <= kFusedRows) {
    fused_split(xr, w.n, [&](auto mb, int64_t m0, int64_t n0, int64_t n1) {
      constexpr int MB = decltype(mb)::value;
      switch (w.dtype) {
        case DType::F32:
          return dense_fused<MB, DType::F32>(w, xr, k, m0, n0, n1, out);
        case DType::F16:
          return dense_fused<MB, DType::F16>(w, xr, k, m0, n0, n1, out);
        case DType::BF16:
          return dense_fused<MB, DType::BF16>(w, xr, k, m0, n0, n1, out);
      }
    });
    return;
  }
  parallel_for(tasks_for(w.n, kPanelRows), [&](int64_t t) {
    const int64_t n0 = t * kPanelRows;
    dense_panel(w, k, xr, n0, std::min(kPanelRows, w.n - n0), out);
  });
}

}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
