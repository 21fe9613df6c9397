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
// registers, 1 activation register).
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

// Decode with dense weights of dtype WT.
template <int MB, DType WT>
void dense_fused(const DenseWeights& w, const Rows& x, int64_t k, int64_t m0, int64_t n0,
                 int64_t n1, const Output& out) {
  constexpr int64_t kItem = WT == DType::F32 ? 4 : 2;
  constexpr int kAcc = MB <= 2 ? 4 : 2;
  const int64_t full = k / 8 * 8;
  const float* xr[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) xr[m] = x.row(m0 + m);
  for (int64_t n = n0; n < n1; n++) {
    const char* row = static_cast<const char*>(w.data) + n * k * kItem;
    __m256 acc[MB][kAcc];
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
      for (int j = 0; j < kAcc; j++) acc[m][j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= full; i += 32) {
      prefetch_to_l2(row + i * kItem + kPrefetchBytes);
      if constexpr (kItem == 4) prefetch_to_l2(row + i * kItem + kPrefetchBytes + 64);
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) {
        const __m256 wv = load8<WT>(row + (i + 8 * c) * kItem);
        const int slot = c % kAcc;
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++)
          acc[m][slot] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[m] + i + 8 * c), acc[m][slot]);
      }
    }
    for (; i < full; i += 8) {
      const __m256 wv = load8<WT>(row + i * kItem);
#pragma GCC unroll 16
      for (int m = 0; m < MB; m++)
        acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[m] + i), acc[m][0]);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) {
      __m256 t = acc[m][0];
#pragma GCC unroll 16
      for (int j = 1; j < kAcc; j++) t = _mm256_add_ps(t, acc[m][j]);
      float sum = hsum(t);
      for (int64_t r = full; r < k; r++)
        sum += scalar_of<WT>(row, r) * xr[m][r];
      store_out(out, (m0 + m) * w.n + n, sum);
    }
  }
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

}  // namespace avx2_loops
