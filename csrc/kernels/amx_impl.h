// Prefill products on the tile registers (Intel AMX-BF16), for the amx level:
// included by matmul_impl.h after the level's other code, whose panel path it
// falls back to. Nothing here is less exact than that path.
//
// A tile instruction (TDPBF16PS) multiplies bfloat16 pairs and adds them to
// float32 sums, each product exact and each addition rounded as a float32
// fused multiply-add would round it. The operands are made exact bfloat16:
//  - the integers of 4- and 8-bit weights are exact bfloat16;
//  - a float16 value is the sum of two bfloat16 (its 11-bit significand is the
//    nearest bfloat16 plus a remainder of at most 4 bits), so float16
//    activations and float16 weights go in as two pieces each; bfloat16 ones
//    as one.
// Float32 activations or weights (three or more pieces: no gain) keep the
// panel path, and so do float32 results (mixed half-precision dtypes): the
// tile sums run over longer chains of float32 additions than the panel's
// lanes, which a half-precision result's own rounding hides and a float32
// one would not. Affine weights are summed per group, P = sum(x q), and each
// group adds scale * P + bias * sum(x) to float32 accumulators: the products
// of dequantized weights, reordered; MLX's own kernels do the same.
//
// Mxfp4 weights go in as their codes' values (exact in bfloat16) with the
// group's power-of-two scale and no bias.
//
// Non-finite operands would not land where the float64 product has them
// (an infinite activation split into pieces gives inf + NaN), so a call with a
// non-finite activation, and a block of weight rows with a non-finite scale,
// bias or converted weight, runs on the panel path instead. (BFloat16 weights
// whose rows fill whole tiles are read in place, unsplit: a non-finite one
// multiplies as a float32 fused multiply-add would.)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {
namespace {
namespace tiles {

constexpr int kK = 32;                   // k per tile row: 32 bfloat16 (64 bytes)
constexpr int kRows = 16;                // rows of a tile
constexpr int64_t kTile = kRows * kK;    // bfloat16 per tile (1 KiB)
constexpr int64_t kBlockN = 2 * kRows;   // weight rows per task: two tiles' worth

// The tile configuration LDTILECFG reads: palette 1, eight tiles of 16 rows of
// 64 bytes.
struct Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(Config) == 64, "LDTILECFG reads 64 bytes");

// The calling thread's tile registers, configured for the scope's lifetime
// (tile state is per thread; releasing it keeps context switches cheap).
class TileScope {
 public:
  TileScope() {
    Config c;
    for (int t = 0; t < 8; t++) {
      c.colsb[t] = 64;
      c.rows[t] = kRows;
    }
    _tile_loadconfig(&c);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// 32 floats (positions 0..15 in lo, 16..31 in hi) as bfloat16, rounded to
// nearest even.
inline __m512i to_bf16(__m512 lo, __m512 hi) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Writes the pieces of 32 floats (1 or 2) that add up to them exactly (each
// value a float16 or bfloat16 one).
inline void split(__m512 lo, __m512 hi, int pieces, __m512i* out) {
  out[0] = to_bf16(lo, hi);
  if (pieces == 2) {
    const __m512 back_lo = widen_bf16(_mm512_castsi512_si256(out[0]));
    const __m512 back_hi = widen_bf16(_mm512_extracti64x4_epi64(out[0], 1));
    out[1] = to_bf16(_mm512_sub_ps(lo, back_lo), _mm512_sub_ps(hi, back_hi));
  }
}

// The lanes of v that are infinite or NaN (every exponent bit set).
inline __mmask16 non_finite(__m512 v) {
  const __m512i exp = _mm512_set1_epi32(0x7f800000);
  return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exp), exp);
}

inline bool all_finite(const float* p, int64_t n) {
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) bad |= non_finite(_mm512_loadu_ps(p + i));
  for (; i < n; i++)
    if (!std::isfinite(p[i])) return false;
  return bad == 0;
}

// The 32 values of a chunk in the order the weights' tile rows hold them:
// plain, or (4-bit weights) the even k first, then the odd k, as the low and
// high nibbles of 16 packed bytes unpack.
inline void chunk_in_order(const float* p, Order order, __m512* lo, __m512* hi) {
  const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  if (order == Order::Nibbles) {
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    *lo = _mm512_permutex2var_ps(a, even, b);
    *hi = _mm512_permutex2var_ps(a, odd, b);
  } else {
    *lo = a;
    *hi = b;
  }
}

// The activations as the second operand of the tile products: for each chunk
// of 32 k and each block of 16 rows, one tile per piece whose row r holds, for
// every activation row j of the block, the pair of positions 2r, 2r + 1.
// Blocks come in pairs (a zero block completes an odd count).
struct Acts {
  int64_t rows = 0, chunks = 0, blocks = 0;
  int pieces = 1;
  Vector<uint16_t> data;   // [block][chunk][piece][kTile]
  Vector<float> sums;      // [group][block * 16]: sum of x over the group

  const uint16_t* tile(int64_t c, int64_t b, int p) const {
    return const_cast<Acts*>(this)->tile_data(c, b, p);
  }
  const float* group_sums(int64_t g, int64_t b) const {
    return sums.data() + (g * blocks + b) * kRows;
  }

  // False when the activations are not half precision or hold a non-finite
  // value. group_size > 0 also computes the group sums.
  bool prepare(const Activations& x, Order order, int64_t group_size) {
    if (x.dtype == DType::F32) return false;
    rows = x.rows;
    pieces = x.dtype == DType::F16 ? 2 : 1;
    chunks = (x.k + kK - 1) / kK;
    blocks = (x.rows + 2 * kRows - 1) / (2 * kRows) * 2;
    data.assign(static_cast<size_t>(chunks * blocks * pieces * kTile), 0);
    const int64_t groups = group_size > 0 ? x.k / group_size : 0;
    sums.assign(static_cast<size_t>(groups * blocks * kRows), 0.0f);
    // Each block of 16 rows writes its own tile columns and sums: one task each.
    Vector<char> finite(static_cast<size_t>(blocks), 1);
    parallel_for((x.rows + kRows - 1) / kRows, [&](int64_t b) {
      for (int64_t m = b * kRows; m < std::min(x.rows, (b + 1) * kRows); m++)
        if (!prepare_row(x, order, group_size, groups, m)) finite[static_cast<size_t>(b)] = 0;
    });
    return std::find(finite.begin(), finite.end(), 0) == finite.end();
  }

 private:
  uint16_t* tile_data(int64_t c, int64_t b, int p) {
    return data.data() + ((b * chunks + c) * pieces + p) * kTile;
  }

  // Row m's tile columns and group sums; false when it holds a non-finite value.
  bool prepare_row(const Activations& x, Order order, int64_t group_size, int64_t groups,
                   int64_t m) {
    thread_local Vector<float> row;
    row.assign(static_cast<size_t>(chunks * kK + kLanes), 0.0f);
    const __m512i pair_index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(kRows));
    row_to_float(element(x.data, m * x.k, x.dtype), x.dtype, x.k, row.data());
    if (!all_finite(row.data(), x.k)) return false;
    const int64_t b = m / kRows, j = m % kRows;
    for (int64_t c = 0; c < chunks; c++) {
      __m512 lo, hi;
      chunk_in_order(row.data() + c * kK, order, &lo, &hi);
      __m512i piece[2];
      split(lo, hi, pieces, piece);
      for (int p = 0; p < pieces; p++) {
        // Pair r (bfloat16 2r, 2r + 1) to tile row r, column j.
        auto* dst = reinterpret_cast<int32_t*>(tile_data(c, b, p)) + j;
        _mm512_i32scatter_epi32(dst, pair_index, piece[p], 4);
      }
    }
    for (int64_t g = 0; g < groups; g++) {
      __m512d acc = _mm512_setzero_pd();
      const float* v = row.data() + g * group_size;
      for (int64_t i = 0; i < group_size; i += 16) {
        const __m512 f = _mm512_loadu_ps(v + i);
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(
                                     _mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
      }
      sums[static_cast<size_t>((g * blocks + b) * kRows + j)] =
          static_cast<float>(_mm512_reduce_add_pd(acc));
    }
    return true;
  }
};

// Writes the sums of one block of weight rows for activation rows m0 ..: sums
// holds, per activation row block bb and weight row r < 32, the 16 rows' sums
// at sums[(bb * 32 + r) * 16 + j]; each activation row's 32 outputs are one
// transposed run of the block.
inline void store_block(const Output& out, const float* sums, int64_t act_rows, int64_t rows,
                        int64_t n0, int64_t n_total) {
  alignas(64) float run[kBlockN];
  for (int64_t m = 0; m < act_rows; m++) {
    const float* col = sums + (m / kRows) * kBlockN * kRows + m % kRows;
    for (int64_t r = 0; r < kBlockN; r++) run[r] = col[r * kRows];
    if (rows == kBlockN) {
      store_row16(out.data, m * n_total + n0, out.dtype, load(run));
      store_row16(out.data, m * n_total + n0 + kRows, out.dtype, load(run + kRows));
    } else {
      for (int64_t r = 0; r < rows; r++) store_out(out, m * n_total + n0 + r, run[r]);
    }
  }
}

// The register block: weight tiles 4, 5 (rows 0..15, 16..31 of a block of
// weight rows, `stride` bytes between rows), activation tiles 6, 7 (two blocks
// of activation rows), and C tiles 0..3 += their products: tile 0 = (4, 6),
// 1 = (5, 6), 2 = (4, 7), 3 = (5, 7).
inline void load_weights(const uint16_t* w0, const uint16_t* w1, int64_t stride = 64) {
  _tile_loadd(4, w0, stride);
  _tile_loadd(5, w1, stride);
}
inline void load_activations(const uint16_t* x0, const uint16_t* x1) {
  _tile_loadd(6, x0, 64);
  _tile_loadd(7, x1, 64);
}
inline void multiply_2x2() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  _tile_dpbf16ps(2, 4, 7);
  _tile_dpbf16ps(3, 5, 7);
}
inline void product_2x2(const uint16_t* w0, const uint16_t* w1, const uint16_t* x0,
                        const uint16_t* x1, int64_t w_stride = 64) {
  load_weights(w0, w1, w_stride);
  load_activations(x0, x1);
  multiply_2x2();
}

inline void zero_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The four C tiles as [tile][16 weight rows][16 activation rows]: tiles 0, 1
// are activation block b's weight rows 0..15 and 16..31, tiles 2, 3 block b + 1's.
inline void store_2x2(float* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}
inline void load_2x2(const float* c) {
  _tile_loadd(0, c, 64);
  _tile_loadd(1, c + 256, 64);
  _tile_loadd(2, c + 512, 64);
  _tile_loadd(3, c + 768, 64);
}

// Tile row i of weight row n's chunk c, for 4- or 8-bit affine weights (the
// codes' integers) or mxfp4 weights (the codes' values).
inline __m512i quantized_chunk(const Quantized& a, int64_t n, int64_t c) {
  const uint8_t* p = a.row(n);
  __m512i lanes_lo, lanes_hi;
  if (a.w.bits == 4) {
    const __m512i q =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * 16)));
    lanes_lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
    lanes_hi = _mm512_srli_epi32(q, 4);
    if (a.mxfp4()) {  // the codes' values, each exact in bfloat16
      const __m512 values = reinterpret_cast<__m512>(fp4_values());
      return to_bf16(_mm512_permutexvar_ps(lanes_lo, values),
                     _mm512_permutexvar_ps(lanes_hi, values));
    }
  } else {
    const auto* bytes = reinterpret_cast<const __m128i*>(p + c * 32);
    lanes_lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes));
    lanes_hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes + 1));
  }
  return to_bf16(_mm512_cvtepi32_ps(lanes_lo), _mm512_cvtepi32_ps(lanes_hi));
}

// A task's blocks of weight rows: `count` blocks of kBlockN from n0 (the last
// may be short), run together so that each activation tile they share is read
// from memory once for all of them. ok[j] is false for a block refused (a
// non-finite scale, bias or weight): nothing of it is written.
struct Blocks {
  int64_t n0, n;
  int count;
  int64_t rows(int j) const { return std::min(kBlockN, n - (n0 + j * kBlockN)); }
  int64_t first(int j) const { return n0 + j * kBlockN; }
};

// Affine and mxfp4 weights. Per group: each block's weight tiles are built once,
// then for each pair of activation blocks every weight block multiplies the same
// activation tiles (in L1 after the first), and its group sums are scaled into
// float32 accumulators.
void quantized_blocks(const Quantized& a, const Acts& x, const Blocks& blocks, const Output& out,
                      bool* ok) {
  const int64_t groups = a.groups, per_group = a.w.group_size / kK;
  const int count = blocks.count;
  // [block][weight row][group]
  thread_local Vector<float> scales, biases;
  // [block][activation block][weight row][activation row of the block]
  thread_local Vector<float> acc;
  // [block][chunk of the group][half][kTile]
  thread_local Vector<uint16_t> w;
  const int64_t per_block = kBlockN * groups, acc_block = x.blocks * kBlockN * kRows;
  scales.assign(static_cast<size_t>(count * per_block), 0.0f);
  biases.assign(static_cast<size_t>(count * per_block), 0.0f);
  acc.assign(static_cast<size_t>(count * acc_block), 0.0f);
  w.resize(static_cast<size_t>(count * 4 * 2 * kTile));
  for (int j = 0; j < count; j++) {
    float* sj = scales.data() + j * per_block;
    float* bj = biases.data() + j * per_block;
    for (int64_t r = 0; r < blocks.rows(j); r++)
      for (int64_t g = 0; g < groups; g++) {
        sj[r * groups + g] = a.scale(blocks.first(j) + r, g);
        bj[r * groups + g] = a.bias(blocks.first(j) + r, g);
      }
    ok[j] = all_finite(sj, per_block) && all_finite(bj, per_block);
  }
  auto tiles_of = [&](int j, int64_t ci, int h) {
    return w.data() + ((j * 4 + ci) * 2 + h) * kTile;
  };
  alignas(64) float c[4 * kRows * kRows];
  for (int64_t g = 0; g < groups; g++) {
    for (int j = 0; j < count; j++) {
      if (!ok[j]) continue;
      for (int64_t ci = 0; ci < per_group; ci++)
        for (int h = 0; h < 2; h++)
          for (int i = 0; i < kRows; i++) {
            const int64_t r = h * kRows + i;
            const __m512i v = r < blocks.rows(j)
                                  ? quantized_chunk(a, blocks.first(j) + r, g * per_group + ci)
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(tiles_of(j, ci, h) + i * kK, v);
          }
    }
    for (int64_t b = 0; b < x.blocks; b += 2) {
      for (int j = 0; j < count; j++) {
        if (!ok[j]) continue;
        zero_2x2();
        for (int64_t ci = 0; ci < per_group; ci++)
          for (int p = 0; p < x.pieces; p++)
            product_2x2(tiles_of(j, ci, 0), tiles_of(j, ci, 1),
                        x.tile(g * per_group + ci, b, p), x.tile(g * per_group + ci, b + 1, p));
        store_2x2(c);
        const float* sj = scales.data() + j * per_block;
        const float* bj = biases.data() + j * per_block;
        for (int t = 0; t < 4; t++) {
          const int h = t & 1;
          const int64_t bb = b + (t >> 1);
          const __m512 xs = _mm512_loadu_ps(x.group_sums(g, bb));
          for (int i = 0; i < kRows; i++) {
            const int64_t r = h * kRows + i;
            float* dst = acc.data() + j * acc_block + (bb * kBlockN + r) * kRows;
            const __m512 sum = _mm512_load_ps(c + (t * kRows + i) * kRows);
            __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(bj[r * groups + g]), xs,
                                       _mm512_loadu_ps(dst));
            v = _mm512_fmadd_ps(_mm512_set1_ps(sj[r * groups + g]), sum, v);
            _mm512_storeu_ps(dst, v);
          }
        }
      }
    }
  }
  for (int j = 0; j < count; j++)
    if (ok[j])
      store_block(out, acc.data() + j * acc_block, x.rows, blocks.rows(j), blocks.first(j),
                  a.w.n);
}

// Half-precision dense weights, a slab of kSlab chunks of k at a time: each
// block's weight tiles for the slab are built, then for each pair of activation
// blocks every weight block multiplies the same activation tiles, its C tiles
// carried across slabs in memory.
void dense_blocks(const DenseWeights& w, int64_t k, const Acts& x, const Blocks& blocks,
                  const Output& out, bool* ok) {
  constexpr int64_t kSlab = 64;
  const int pieces = w.dtype == DType::F16 ? 2 : 1;
  const int count = blocks.count;
  // [block][slab chunk][piece][half][kTile]
  thread_local Vector<uint16_t> a;
  // [block][activation block][weight row][activation row of the block]
  thread_local Vector<float> sums;
  thread_local Vector<float> row;
  const int64_t a_block = kSlab * pieces * 2 * kTile, sum_block = x.blocks * kBlockN * kRows;
  a.resize(static_cast<size_t>(count * a_block));
  sums.resize(static_cast<size_t>(count * sum_block));
  row.resize(static_cast<size_t>(kK + kLanes));
  for (int j = 0; j < count; j++) ok[j] = true;
  auto tiles_of = [&](int j, int64_t c, int p, int h) {
    return a.data() + j * a_block + ((c * pieces + p) * 2 + h) * kTile;
  };
  // A whole block of bfloat16 rows whose k fills whole chunks is its own
  // tiles: rows of 32 values read in place, k apart (no conversion, and no
  // split that a non-finite value could turn into NaN).
  auto direct = [&](int j) {
    return w.dtype == DType::BF16 && k % kK == 0 && blocks.rows(j) == kBlockN;
  };
  auto row_tiles = [&](int j, int64_t c, int h) {
    return static_cast<const uint16_t*>(w.data) + (blocks.first(j) + h * kRows) * k + c * kK;
  };
  for (int64_t c0 = 0; c0 < x.chunks; c0 += kSlab) {
    const int64_t slab = std::min(kSlab, x.chunks - c0);
    const int64_t k0 = c0 * kK, k1 = std::min(k, (c0 + slab) * kK);
    for (int j = 0; j < count; j++) {
      if (!ok[j] || direct(j)) continue;
      for (int64_t r = 0; r < kBlockN && ok[j]; r++) {
        const int h = static_cast<int>(r / kRows), i = static_cast<int>(r % kRows);
        const bool present = r < blocks.rows(j);
        const void* src = element(w.data, (blocks.first(j) + r) * k + k0, w.dtype);
        __mmask16 bad = 0;
        for (int64_t c = 0; c < slab; c++) {
          __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
          if (present && k0 + (c + 1) * kK <= k1) {  // a whole chunk, converted in registers
            lo = reinterpret_cast<__m512>(load_row16(src, c * kK, w.dtype));
            hi = reinterpret_cast<__m512>(load_row16(src, c * kK + 16, w.dtype));
          } else if (present) {  // the row's tail, zero-padded
            std::fill(row.begin(), row.begin() + kK + kLanes, 0.0f);
            row_to_float(element(src, c * kK, w.dtype), w.dtype, k1 - k0 - c * kK, row.data());
            lo = _mm512_loadu_ps(row.data());
            hi = _mm512_loadu_ps(row.data() + 16);
          }
          bad |= non_finite(lo) | non_finite(hi);
          __m512i piece[2];
          split(lo, hi, pieces, piece);
          for (int p = 0; p < pieces; p++)
            _mm512_storeu_si512(tiles_of(j, c, p, h) + i * kK, piece[p]);
        }
        if (bad) ok[j] = false;
      }
    }
    for (int64_t b = 0; b < x.blocks; b += 2) {
      for (int j = 0; j < count; j++) {
        if (!ok[j]) continue;
        // The C tiles' layout is sums' (store_2x2): blocks b and b + 1.
        float* s0 = sums.data() + j * sum_block + b * kBlockN * kRows;
        if (c0 == 0) {
          zero_2x2();
        } else {
          load_2x2(s0);
        }
        if (direct(j)) {
          for (int64_t c = 0; c < slab; c++)
            for (int q = 0; q < x.pieces; q++)
              product_2x2(row_tiles(j, c0 + c, 0), row_tiles(j, c0 + c, 1),
                          x.tile(c0 + c, b, q), x.tile(c0 + c, b + 1, q), k * 2);
        } else {
          for (int64_t c = 0; c < slab; c++) {
            // Every pair of a weight piece and an activation piece. The
            // activation pieces go forward for even weight pieces and back
            // for odd ones, so the pair loaded last serves the next weight
            // piece first without a reload.
            for (int p = 0; p < pieces; p++) {
              load_weights(tiles_of(j, c, p, 0), tiles_of(j, c, p, 1));
              for (int step = 0; step < x.pieces; step++) {
                const int q = p % 2 == 0 ? step : x.pieces - 1 - step;
                if (p == 0 || step > 0)
                  load_activations(x.tile(c0 + c, b, q), x.tile(c0 + c, b + 1, q));
                multiply_2x2();
              }
            }
          }
        }
        store_2x2(s0);
      }
    }
  }
  for (int j = 0; j < count; j++)
    if (ok[j])
      store_block(out, sums.data() + j * sum_block, x.rows, blocks.rows(j), blocks.first(j),
                  w.n);
}

// Blocks of weight rows a task runs together.
constexpr int kTaskBlocks = 4;

// A product on the tile registers: x prepared as tiles (in `order`; group sums
// for a group_size > 0), then blocks(acts, Blocks, ok) for every kTaskBlocks
// blocks of kBlockN of the n weight rows, on the kernels' threads, each with its
// tile registers; the blocks it refused go to panel(xr, n0, rows) on the panel
// path (rows <= kPanelRows), with x's panel rows made once, when first needed.
// False (nothing written) when x is not one the tiles compute exactly.
template <typename Run, typename Panel>
bool on_tiles(const Activations& x, Order order, int64_t group_size, int64_t n, Run&& blocks,
              Panel&& panel) {
  Acts acts;
  if (!acts.prepare(x, order, group_size)) return false;
  const int64_t total = (n + kBlockN - 1) / kBlockN;
  const int64_t tasks = (total + kTaskBlocks - 1) / kTaskBlocks;
  Vector<char> refused(static_cast<size_t>(total), 0);
  parallel_for(tasks, [&](int64_t t) {
    TileScope scope;
    const Blocks b{t * kTaskBlocks * kBlockN, n,
                   static_cast<int>(std::min<int64_t>(kTaskBlocks, total - t * kTaskBlocks))};
    bool ok[kTaskBlocks];
    blocks(acts, b, ok);
    for (int j = 0; j < b.count; j++)
      refused[static_cast<size_t>(t * kTaskBlocks + j)] = ok[j] ? 0 : 1;
  });
  Vector<int64_t> rest;
  for (int64_t b = 0; b < total; b++)
    if (refused[static_cast<size_t>(b)]) rest.push_back(b * kBlockN);
  if (rest.empty()) return true;
  const Rows xr = convert_rows(x, order);
  parallel_for(static_cast<int64_t>(rest.size()), [&](int64_t i) {
    const int64_t n0 = rest[static_cast<size_t>(i)], rows = std::min(kBlockN, n - n0);
    for (int64_t j = 0; j < rows; j += kPanelRows)
      panel(xr, n0 + j, std::min(kPanelRows, rows - j));
  });
  return true;
}

// out = x @ dequantize(w).T on the tile registers; false (nothing written)
// when this call is not one they compute exactly.
bool quantized_matmul(const Activations& x, const Quantized& a, const Output& out) {
  if ((a.w.bits != 4 && a.w.bits != 8) || out.dtype == DType::F32) return false;
  return on_tiles(
      x, a.order, a.w.group_size, a.w.n,
      [&](const Acts& acts, const Blocks& b, bool* ok) { quantized_blocks(a, acts, b, out, ok); },
      [&](const Rows& xr, int64_t n0, int64_t rows) { quantized_panel(a, xr, n0, rows, out); });
}

bool dense_matmul(const Activations& x, const DenseWeights& w, const Output& out) {
  if (w.dtype == DType::F32 || out.dtype == DType::F32) return false;
  return on_tiles(
      x, Order::Plain, 0, w.n,
      [&](const Acts& acts, const Blocks& b, bool* ok) { dense_blocks(w, x.k, acts, b, out, ok); },
      [&](const Rows& xr, int64_t n0, int64_t rows) { dense_panel(w, x.k, xr, n0, rows, out); });
}

}  // namespace tiles
}  // namespace
}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
