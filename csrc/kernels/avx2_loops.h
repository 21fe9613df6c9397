// The inner loops of the avx2 level, over its own 8-lane registers.
//
// matmul_impl.h writes the products once over 16-lane vectors; where the
// registers are 16 lanes wide (AVX-512) the compiler keeps every vector in one
// register. AVX2 has sixteen 8-lane registers: a 16-lane vector is a pair, the
// fused loops' accumulators no longer fit, and the compiler keeps them (and the
// halves it joins through memory) on the stack. These loops are the same
// arithmetic written for that register file: decode products whose weights are
// dequantized with integer widening and one multiply-add (a 16-entry table
// lookup costs three instructions per eight values at this width), and a prefill
// tile of 4 activation rows by 3 weight rows (12 accumulators, 3 weight
// registers, 1 activation register). Where the output is 16-bit, 4- and 8-bit
// decode runs on integer multiply-adds instead (IntRows, int_fused below).
//
// Included by matmul_impl.h, inside its level namespace, when compiled for avx2
// without AVX-512: it uses that file's Quantized, Rows, Output and helpers.
// Values sit in the order those helpers define (Order::Nibbles for 4 bits:
// each 16 bytes carry 32 values, the low nibbles first), so activations
// converted once serve every level's loops.

namespace avx2_loops {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Calls f(i, slot) for i = 0, step, 2 step, ... below end, the slot alternating
// kSlot0, kSlot1 (matmul_impl.h): two accumulators whose index is a constant (a
// runtime index would keep them on the stack).
template <typename F>
inline void in_slot_pairs(int64_t end, int64_t step, F&& f) {
  int64_t i = 0;
  for (; i + 2 * step <= end; i += 2 * step) {
    f(i, kSlot0);
    f(i + step, kSlot1);
  }
  if (i < end) f(i, kSlot0);
}

// 8 bytes at p, zero-extended to 32-bit lanes.
inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 8 consecutive values of dtype T at p as float32.
template <DType T>
inline __m256 load8(const void* p) {
  if constexpr (T == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(p));
  } else if constexpr (T == DType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  } else {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
}

// `count` values of dtype T from base + i as float32 into dst.
template <DType T>
inline void floats8_of(const void* base, int64_t i, int64_t count, float* dst) {
  constexpr int64_t kItem = T == DType::F32 ? 4 : 2;
  const char* p = static_cast<const char*>(base) + i * kItem;
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) _mm256_storeu_ps(dst + j, load8<T>(p + j * kItem));
  for (; j < count; j++) dst[j] = scalar_of<T>(base, i + j);
}

// The `n` values of dtype t at p as float32 into dst, then zeros up to padded(n).
inline void row_to_float(const void* p, DType t, int64_t n, float* dst) {
  switch (t) {
    case DType::F32:
      floats8_of<DType::F32>(p, 0, n, dst);
      break;
    case DType::F16:
      floats8_of<DType::F16>(p, 0, n, dst);
      break;
    case DType::BF16:
      floats8_of<DType::BF16>(p, 0, n, dst);
      break;
  }
  std::fill(dst + n, dst + padded(n), 0.0f);
}

// The dequantized values of 4-bit codes q (0..15 per lane): scale * q + bias,
// or for mxfp4 the E2M1 value of q times the group's scale (`table` holds the
// eight magnitudes times the scale; bit 3 of q is the sign).
template <bool MX>
inline __m256 value4(__m256i q, __m256 s, __m256 b, __m256 table) {
  if constexpr (MX) {
    const __m256 mag = _mm256_permutevar8x32_ps(table, q);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(q, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
  } else {
    (void)table;
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b);
  }
}

// The decode dot products of MB activation rows with weight rows n0 .. n1 at
// BITS (4 or 8) in groups of GS, scales (and biases) of dtype ST. Each group's
// bytes are dequantized once into registers and multiplied into every row;
// kAcc accumulators per row keep the multiply-adds independent.
template <int MB, int BITS, int GS, DType ST, bool MX>
void quantized_fused(const Quantized& a, const Rows& x, int64_t m0, int64_t n0, int64_t n1,
                     const Output& out, int64_t n_total) {
  constexpr int kGroupBytes = GS * BITS / 8;
  constexpr int kAcc = MB <= 2 ? 4 : 2;
  constexpr int64_t kBlock = 128;  // groups whose scales are converted at once
  const int64_t groups = a.groups;
  const float* xr[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  alignas(32) float sc[kBlock], bi[kBlock];
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256 fp4 = _mm256_setr_ps(0, 0.5f, 1, 1.5f, 2, 3, 4, 6);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = a.row(n);
    const int64_t sbase = n * groups;
    __m256 acc[MB][kAcc];
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
      for (int j = 0; j < kAcc; j++) acc[m][j] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += kBlock) {
      const int64_t gn = std::min(kBlock, groups - g0);
      if constexpr (MX) {
        exponents_of(a.w.scales, sbase + g0, gn, sc);
      } else {
        floats8_of<ST>(a.w.scales, sbase + g0, gn, sc);
        floats8_of<ST>(a.w.biases, sbase + g0, gn, bi);
      }
      for (int64_t gi = 0; gi < gn; gi++) {
        const uint8_t* p = row + (g0 + gi) * kGroupBytes;
        const int64_t k0 = (g0 + gi) * GS;
        const __m256 s = _mm256_broadcast_ss(sc + gi);
        const __m256 b = MX ? _mm256_setzero_ps() : _mm256_broadcast_ss(bi + gi);
        const __m256 table = MX ? _mm256_mul_ps(fp4, s) : s;
        if constexpr (BITS == 4) {
          prefetch_to_l1(p + kPrefetchBytes);
#pragma GCC unroll 4
          for (int c = 0; c < GS; c += 32) {
            const __m256i qa = bytes8(p + c / 2), qb = bytes8(p + c / 2 + 8);
            const __m256 w[4] = {value4<MX>(_mm256_and_si256(qa, low4), s, b, table),
                                 value4<MX>(_mm256_and_si256(qb, low4), s, b, table),
                                 value4<MX>(_mm256_srli_epi32(qa, 4), s, b, table),
                                 value4<MX>(_mm256_srli_epi32(qb, 4), s, b, table)};
#pragma GCC unroll 16
            for (int v = 0; v < 4; v++) {
              const int slot = kAcc == 4 ? v : v % 2;
#pragma GCC unroll 16
              for (int m = 0; m < MB; m++)
                acc[m][slot] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xr[m] + k0 + c + 8 * v),
                                               acc[m][slot]);
            }
          }
        } else {
          prefetch_to_l2(p + kPrefetchBytes);
#pragma GCC unroll 16
          for (int c = 0; c < GS; c += 8) {
            const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bytes8(p + c)), s, b);
            const int slot = (c / 8) % kAcc;
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++)
              acc[m][slot] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[m] + k0 + c), acc[m][slot]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) {
      __m256 t = acc[m][0];
#pragma GCC unroll 16
      for (int j = 1; j < kAcc; j++) t = _mm256_add_ps(t, acc[m][j]);
      store_out(out, (m0 + m) * n_total + n, hsum(t));
    }
  }
}

// Decode at 4 or 8 bits; false for the formats these loops do not cover.
template <int MB>
bool quantized_fused(const Quantized& a, const Rows& x, int64_t m0, int64_t n0, int64_t n1,
                     const Output& out, int64_t n_total) {
  return with_fast_format(a, [&](auto bits, auto gs, auto st, auto mx) {
    quantized_fused<MB, decltype(bits)::value, decltype(gs)::value, decltype(st)::value,
                    decltype(mx)::value>(a, x, m0, n0, n1, out, n_total);
  });
}

// Decode with dense weights of dtype WT: R weight rows n .. n + R at a time,
// so each activation load feeds R multiply-adds and R streams are in flight
// (one row at a time with a software prefetch 4 KiB ahead read float16 at
// 0.83-0.87 of the 2-thread read bandwidth on an AVX2-only EPYC, four rows
// without prefetch at 0.94-0.97: the hardware prefetchers follow four
// sequential streams better than a hint that lands in the next row).
template <int MB, int R, DType WT>
void dense_rows(const DenseWeights& w, const float* const* xr, int64_t k, int64_t m0, int64_t n,
                const Output& out) {
  constexpr int64_t kItem = WT == DType::F32 ? 4 : 2;
  constexpr int kAcc = MB * R <= 4 ? 2 : 1;  // at most 8 accumulators
  const int64_t full = k / 8 * 8;
  const char* row[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) row[r] = static_cast<const char*>(w.data) + (n + r) * k * kItem;
  __m256 acc[MB][R][kAcc];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
      for (int j = 0; j < kAcc; j++) acc[m][r][j] = _mm256_setzero_ps();
  // Eight values of each row into accumulator SLOT.
  const auto step = [&](int64_t i, auto slot) {
    constexpr int kSlot = decltype(slot)::value % kAcc;
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) wv[r] = load8<WT>(row[r] + i * kItem);
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) {
      const __m256 xv = _mm256_loadu_ps(xr[m] + i);
#pragma GCC unroll 16
      for (int r = 0; r < R; r++) acc[m][r][kSlot] = _mm256_fmadd_ps(wv[r], xv, acc[m][r][kSlot]);
    }
  };
  in_slot_pairs(full, 8, step);
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      __m256 t = acc[m][r][0];
      if constexpr (kAcc == 2) t = _mm256_add_ps(t, acc[m][r][1]);
      float sum = hsum(t);
      for (int64_t j = full; j < k; j++) sum += scalar_of<WT>(row[r], j) * xr[m][j];
      store_out(out, (m0 + m) * w.n + n + r, sum);
    }
}

template <int MB, DType WT>
void dense_fused(const DenseWeights& w, const Rows& x, int64_t k, int64_t m0, int64_t n0,
                 int64_t n1, const Output& out) {
  constexpr int R = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  const float* xr[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  int64_t n = n0;
  for (; n + R <= n1; n += R) dense_rows<MB, R, WT>(w, xr, k, m0, n, out);
  for (; n < n1; n++) dense_rows<MB, 1, WT>(w, xr, k, m0, n, out);
}

// Row n of 4- or 8-bit weights (affine, or mxfp4 in groups of 32) dequantized
// into dst in the activations' order (the overload below picks the format, or
// returns false for one these loops do not cover).
template <int BITS, int GS, DType ST, bool MX>
void dequantize_row(const Quantized& a, int64_t n, float* dst) {
  constexpr int kGroupBytes = GS * BITS / 8;
  const uint8_t* row = a.row(n);
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256 fp4 = _mm256_setr_ps(0, 0.5f, 1, 1.5f, 2, 3, 4, 6);
  for (int64_t g = 0; g < a.groups; g++) {
    const uint8_t* p = row + g * kGroupBytes;
    float* d = dst + g * GS;
    const __m256 s = _mm256_set1_ps(MX ? e8m0_to_float(static_cast<const uint8_t*>(
                                             a.w.scales)[n * a.groups + g])
                                       : scalar_of<ST>(a.w.scales, n * a.groups + g));
    const __m256 b =
        MX ? _mm256_setzero_ps() : _mm256_set1_ps(scalar_of<ST>(a.w.biases, n * a.groups + g));
    const __m256 table = MX ? _mm256_mul_ps(fp4, s) : s;
    if constexpr (BITS == 4) {
      for (int c = 0; c < GS; c += 32) {
        const __m256i qa = bytes8(p + c / 2), qb = bytes8(p + c / 2 + 8);
        _mm256_storeu_ps(d + c, value4<MX>(_mm256_and_si256(qa, low4), s, b, table));
        _mm256_storeu_ps(d + c + 8, value4<MX>(_mm256_and_si256(qb, low4), s, b, table));
        _mm256_storeu_ps(d + c + 16, value4<MX>(_mm256_srli_epi32(qa, 4), s, b, table));
        _mm256_storeu_ps(d + c + 24, value4<MX>(_mm256_srli_epi32(qb, 4), s, b, table));
      }
    } else {
      for (int c = 0; c < GS; c += 8)
        _mm256_storeu_ps(d + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(bytes8(p + c)), s, b));
    }
  }
}

inline bool dequantize_row(const Quantized& a, int64_t n, float* dst) {
  return with_fast_format(a, [&](auto bits, auto gs, auto st, auto mx) {
    dequantize_row<decltype(bits)::value, decltype(gs)::value, decltype(st)::value,
                   decltype(mx)::value>(a, n, dst);
  });
}

// The sums of four vectors' lanes, in order.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// `count` float32 values into elements i .. of `out`, rounded to its dtype.
inline void store_floats(const Output& out, int64_t i, int64_t count, const float* v) {
  int64_t j = 0;
  if (out.dtype == DType::F32) {
    std::memcpy(static_cast<float*>(out.data) + i, v, static_cast<size_t>(count) * 4);
    return;
  }
  if (out.dtype == DType::F16)
    for (; j + 8 <= count; j += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out.data) + i + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(v + j), _MM_FROUND_TO_NEAREST_INT));
  for (; j < count; j++) store_out(out, i + j, v[j]);
}

// One register tile of the prefill product: kTileM activation rows by kTileN
// panel rows over k0 .. k1. The 8 lane sums of (i, r) carry over between
// blocks of k at part + (i * kPanelRows + r) * 8 (read unless `first`);
// after the `last` block each pair's total goes to res[i * kPanelRows + r].
inline void tile(const Rows& x, int64_t m, const float* panel, int64_t stride, int64_t j0,
                 int64_t k0, int64_t k1, bool first, bool last, float* part, float* res) {
  __m256 acc[kTileM][kTileN];
  const float* xr[kTileM];
  const float* wr[kTileN];
#pragma GCC unroll 16
  for (int i = 0; i < kTileM; i++) {
    xr[i] = x.row(m + i);
#pragma GCC unroll 16
    for (int r = 0; r < kTileN; r++)
      acc[i][r] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + (i * kPanelRows + r) * 8);
  }
#pragma GCC unroll 16
  for (int r = 0; r < kTileN; r++) wr[r] = panel + (j0 + r) * stride;
  for (int64_t k = k0; k < k1; k += 8) {
    __m256 wv[kTileN];
#pragma GCC unroll 16
    for (int r = 0; r < kTileN; r++) wv[r] = _mm256_load_ps(wr[r] + k);
#pragma GCC unroll 16
    for (int i = 0; i < kTileM; i++) {
      const __m256 xv = _mm256_load_ps(xr[i] + k);
#pragma GCC unroll 16
      for (int r = 0; r < kTileN; r++) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  if (!last) {
#pragma GCC unroll 16
    for (int i = 0; i < kTileM; i++)
#pragma GCC unroll 16
      for (int r = 0; r < kTileN; r++) _mm256_store_ps(part + (i * kPanelRows + r) * 8, acc[i][r]);
    return;
  }
  static_assert(kTileM * kTileN % 4 == 0, "the tile's sums are reduced four at a time");
  alignas(16) float total[kTileM * kTileN];
  const __m256* flat = &acc[0][0];
#pragma GCC unroll 16
  for (int f = 0; f < kTileM * kTileN; f += 4)
    _mm_store_ps(total + f, hsum4(flat[f], flat[f + 1], flat[f + 2], flat[f + 3]));
#pragma GCC unroll 16
  for (int i = 0; i < kTileM; i++)
#pragma GCC unroll 16
    for (int r = 0; r < kTileN; r++) res[i * kPanelRows + r] = total[i * kTileN + r];
}

// out[m, n0 + j] for every activation row m and panel row j < rows (the
// panel's rows up to a multiple of kTileN are zero, as Panel::multiply
// leaves them). Blocked over k and m as Panel::multiply is: kBlockK of k at
// a time keeps the panel's slice in L1 while the tiles sweep it.
inline void panel_multiply(const float* panel, int64_t stride, const Rows& x, int64_t rows,
                           int64_t n0, const Output& out, int64_t n_total, int64_t block_m,
                           int64_t block_k) {
  thread_local Vector<float> part, res;
  part.resize(static_cast<size_t>(block_m * kPanelRows * 8));
  res.resize(static_cast<size_t>(block_m * kPanelRows));
  for (int64_t mb = 0; mb < x.rows; mb += block_m) {
    const int64_t m_rows = std::min(block_m, (x.rows - mb + kTileM - 1) / kTileM * kTileM);
    for (int64_t k0 = 0; k0 < stride; k0 += block_k) {
      const int64_t k1 = std::min(stride, k0 + block_k);
      for (int64_t m = 0; m < m_rows; m += kTileM)
        for (int64_t j = 0; j < rows; j += kTileN)
          tile(x, mb + m, panel, stride, j, k0, k1, k0 == 0, k1 == stride,
               part.data() + (m * kPanelRows + j) * 8, res.data() + m * kPanelRows + j);
    }
    for (int64_t m = 0; m < m_rows && mb + m < x.rows; m++)
      store_floats(out, (mb + m) * n_total + n0, rows, res.data() + m * kPanelRows);
  }
}

// ---------------------------------------------------------------------------
// Decode with the activations as 16-bit integers (16-bit outputs only).
//
// Each group of GS activations becomes int16 codes i and a float scale
// sx = max |x| / 32767 over the group, so x' = sx * i is within sx / 2 of x.
// A weight group then costs integer multiply-adds (vpmaddwd: 16 products per
// instruction, no float conversion of the weights) and one float multiply-add:
// y += (s * sx) * sum(q * i) + (b * sx) * sum(i), the product of the
// dequantized weights with x' in float32. The rounding of x' is at most
// 2^-16 of each group's largest magnitude; docs/kernels.md gives the bound
// and its measure against the 16-bit output's own rounding.

// x as codes, one row of k after another: for 8 bits in order; for 4 bits
// each 64 values (32 in a last, odd group of 32) as four planes, plane p
// holding the values 4j + p, the order vpmaddwd meets them in when a row's
// bytes are read as 16-bit lanes (lane j: the codes of values 4j .. 4j + 3).
struct IntRows {
  Vector<int16_t> codes;
  Vector<float> scale, sum;  // per row, per group (padded to 8): sx and sx * sum(i)
  int64_t rows = 0, k = 0, stride = 0;
  const int16_t* row(int64_t m) const { return codes.data() + m * k; }
  const float* scales(int64_t m) const { return scale.data() + m * stride; }
  const float* sums(int64_t m) const { return sum.data() + m * stride; }
};

// The sum of four int32 lanes.
inline int32_t hsum_i32(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// False where a group holds a value that is not finite, or a largest
// magnitude below 2^-96 but not zero (its scale would be a float32 subnormal).
inline bool to_codes(const Activations& x, int bits, int64_t gs, IntRows& r) {
  const int64_t groups = x.k / gs;
  r.rows = x.rows;
  r.k = x.k;
  r.stride = (groups + 7) / 8 * 8;
  r.codes.resize(static_cast<size_t>(x.rows * x.k));
  r.scale.assign(static_cast<size_t>(x.rows * r.stride), 0.0f);
  r.sum.assign(static_cast<size_t>(x.rows * r.stride), 0.0f);
  Vector<float> v(static_cast<size_t>(padded(x.k)));
  Vector<int16_t> plain(static_cast<size_t>(gs));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < x.rows; m++) {
    row_to_float(element(x.data, m * x.k, x.dtype), x.dtype, x.k, v.data());
    int16_t* dst = r.codes.data() + m * x.k;
    for (int64_t g = 0; g < groups; g++) {
      const float* xg = v.data() + g * gs;
      __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int64_t j = 0; j < gs; j += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xg + j), abs_mask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
        top = _mm256_max_ps(top, a);
      }
      const float most = hmax(top);
      if (_mm256_movemask_ps(bad) != 0 || (most > 0 && most < 0x1p-96f)) return false;
      const __m256 inv = _mm256_set1_ps(most > 0 ? 32767.0f / most : 0.0f);
      __m256i total = _mm256_setzero_si256();
      for (int64_t j = 0; j < gs; j += 16) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + j), inv));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + j + 8), inv));
        const __m256i c = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(plain.data() + j), c);
        total = _mm256_add_epi32(total, _mm256_madd_epi16(c, _mm256_set1_epi16(1)));
      }
      const int32_t codes_sum = hsum_i32(
          _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1)));
      const float sx = most / 32767.0f;
      r.scale[m * r.stride + g] = sx;
      r.sum[m * r.stride + g] = sx * static_cast<float>(codes_sum);
      if (bits == 8) {
        std::memcpy(dst + g * gs, plain.data(), static_cast<size_t>(gs) * 2);
        continue;
      }
      // Planes within each stretch of 64 values of the row (a group of 32
      // starting at an odd multiple of 32 is the second half of one): value i
      // of a stretch of width w goes to plane i % 4 at i / 4, each stretch the
      // group touches walked once, so no value pays a division.
      for (int64_t j0 = 0; j0 < gs;) {
        const int64_t kk = g * gs + j0, c = kk / 64 * 64;
        const int64_t width = std::min<int64_t>(64, x.k - c), q = width / 4;
        const int64_t i0 = kk - c, span = std::min<int64_t>(gs - j0, width - i0);
        int16_t* d = dst + c;
        for (int64_t i = i0; i < i0 + span; i++) d[(i & 3) * q + (i >> 2)] = plain[j0 + i - i0];
        j0 += span;
      }
    }
  }
  return true;
}

// The four planes of 64 4-bit codes at p (32 bytes read as 16-bit lanes).
inline void planes4(const uint8_t* p, __m256i q[4]) {
  const __m256i low4 = _mm256_set1_epi16(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  q[0] = _mm256_and_si256(v, low4);
  q[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  q[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
  q[3] = _mm256_srli_epi16(v, 12);
}

inline __m256i codes16(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// sum(q * i) of 64 values, as 8 int32 lanes (lanes 0..3: the first 32).
inline __m256i dot4(const __m256i q[4], const int16_t* xs) {
  return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(q[0], codes16(xs)),
                                           _mm256_madd_epi16(q[1], codes16(xs + 16))),
                          _mm256_add_epi32(_mm256_madd_epi16(q[2], codes16(xs + 32)),
                                           _mm256_madd_epi16(q[3], codes16(xs + 48))));
}

// sum(q * i) of the last 32 4-bit values of a row whose groups of 32 are odd
// in number (16 bytes; planes of 8).
inline int32_t dot4_half(const uint8_t* p, const int16_t* xs) {
  const __m128i low4 = _mm_set1_epi16(15);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const auto x8 = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs + 8 * i));
  };
  __m128i s = _mm_add_epi32(_mm_madd_epi16(_mm_and_si128(v, low4), x8(0)),
                            _mm_madd_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4), x8(1)));
  s = _mm_add_epi32(s, _mm_madd_epi16(_mm_and_si128(_mm_srli_epi16(v, 8), low4), x8(2)));
  return hsum_i32(_mm_add_epi32(s, _mm_madd_epi16(_mm_srli_epi16(v, 12), x8(3))));
}

// The decode products of MB rows of codes with weight rows n0 .. n1 at BITS
// (4 or 8) in groups of GS, scales and biases of dtype ST.
template <int MB, int BITS, int GS, DType ST>
void int_fused(const Quantized& a, const IntRows& x, int64_t m0, int64_t n0, int64_t n1,
               const Output& out, int64_t n_total) {
  constexpr int kGroupBytes = GS * BITS / 8;
  constexpr int64_t kBlock = 128;  // groups whose scales are converted at once
  const int64_t groups = a.groups;
  const int16_t* xr[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  alignas(32) float sc[kBlock], bi[kBlock], cs[MB][kBlock];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = a.row(n);
    const int64_t sbase = n * groups;
    __m256 acc[MB][2], bias[MB];
    float tail[MB] = {};
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = bias[m] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += kBlock) {
      const int64_t gn = std::min(kBlock, groups - g0), gn8 = (gn + 7) / 8 * 8;
      floats8_of<ST>(a.w.scales, sbase + g0, gn, sc);
      floats8_of<ST>(a.w.biases, sbase + g0, gn, bi);
      std::fill(sc + gn, sc + gn8, 0.0f);
      std::fill(bi + gn, bi + gn8, 0.0f);
      // Per row: s * sx for each group, and the biases' term sum(b * sx * sum(i)).
#pragma GCC unroll 16
      for (int m = 0; m < MB; m++)
        for (int64_t j = 0; j < gn8; j += 8) {
          _mm256_store_ps(cs[m] + j, _mm256_mul_ps(_mm256_load_ps(sc + j),
                                                   _mm256_loadu_ps(x.scales(m0 + m) + g0 + j)));
          bias[m] = _mm256_fmadd_ps(_mm256_load_ps(bi + j),
                                    _mm256_loadu_ps(x.sums(m0 + m) + g0 + j), bias[m]);
        }
      if constexpr (BITS == 4 && GS == 32) {
        // Two groups a stretch of 64: lanes 0..3 of its sums the first.
        const auto pair = [&](int64_t gi, auto slot) {
          const uint8_t* p = row + (g0 + gi) * kGroupBytes;
          prefetch_to_l1(p + kPrefetchBytes);
          __m256i q[4];
          planes4(p, q);
          constexpr int kSlot = decltype(slot)::value;
#pragma GCC unroll 16
          for (int m = 0; m < MB; m++) {
            const __m256i s = dot4(q, xr[m] + (g0 + gi) * GS);
            const __m256 f = _mm256_set_m128(_mm_set1_ps(cs[m][gi + 1]), _mm_set1_ps(cs[m][gi]));
            acc[m][kSlot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), f, acc[m][kSlot]);
          }
        };
        const int64_t gi = gn / 2 * 2;
        in_slot_pairs(gi, 2, pair);
        if (gi < gn) {
#pragma GCC unroll 16
          for (int m = 0; m < MB; m++)
            tail[m] = static_cast<float>(dot4_half(row + (g0 + gi) * kGroupBytes,
                                                   xr[m] + (g0 + gi) * GS)) * cs[m][gi];
        }
      } else {
        // One group into accumulator SLOT.
        const auto group = [&](int64_t gi, auto slot) {
          const uint8_t* p = row + (g0 + gi) * kGroupBytes;
          const int16_t* xs[MB];
          __m256i s[MB];
#pragma GCC unroll 16
          for (int m = 0; m < MB; m++) {
            xs[m] = xr[m] + (g0 + gi) * GS;
            s[m] = _mm256_setzero_si256();
          }
          if constexpr (BITS == 4) {
            prefetch_to_l1(p + kPrefetchBytes);
#pragma GCC unroll 2
            for (int c = 0; c < GS; c += 64) {
              __m256i q[4];
              planes4(p + c / 2, q);
#pragma GCC unroll 16
              for (int m = 0; m < MB; m++) s[m] = _mm256_add_epi32(s[m], dot4(q, xs[m] + c));
            }
          } else {
            prefetch_to_l2(p + kPrefetchBytes);
#pragma GCC unroll 4
            for (int c = 0; c < GS; c += 32) {
              const __m256i w0 = _mm256_cvtepu8_epi16(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
              const __m256i w1 = _mm256_cvtepu8_epi16(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c + 16)));
#pragma GCC unroll 16
              for (int m = 0; m < MB; m++)
                s[m] = _mm256_add_epi32(
                    s[m], _mm256_add_epi32(_mm256_madd_epi16(w0, codes16(xs[m] + c)),
                                           _mm256_madd_epi16(w1, codes16(xs[m] + c + 16))));
            }
          }
          constexpr int kSlot = decltype(slot)::value;
#pragma GCC unroll 16
          for (int m = 0; m < MB; m++)
            acc[m][kSlot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]),
                                            _mm256_broadcast_ss(cs[m] + gi), acc[m][kSlot]);
        };
        in_slot_pairs(gn, 1, group);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
      store_out(out, (m0 + m) * n_total + n,
                hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + hsum(bias[m]) + tail[m]);
  }
}

// Whether int_fused computes this product: affine 4 or 8 bits in groups of
// 32, 64 or 128, and a 16-bit output (from 16-bit activations and scales).
inline bool int_eligible(const Quantized& a, const Output& out) {
  const int gs = a.w.group_size;
  return out.dtype != DType::F32 && !a.mxfp4() && (a.w.bits == 4 || a.w.bits == 8) &&
         (gs == 32 || gs == 64 || gs == 128);
}

template <int MB>
void int_fused(const Quantized& a, const IntRows& x, int64_t m0, int64_t n0, int64_t n1,
               const Output& out, int64_t n_total) {
  with_fast_format(a, [&](auto bits, auto gs, auto st, auto mx) {
    if constexpr (!decltype(mx)::value)
      int_fused<MB, decltype(bits)::value, decltype(gs)::value, decltype(st)::value>(
          a, x, m0, n0, n1, out, n_total);
  });
}

}  // namespace avx2_loops
