// pyloader's CPU kernels: matrix products over raw pointers and shapes, the
// weights in MLX's layouts. Pure compute: no MLX, no Python, no I/O. The MLX
// primitives in csrc/mlxops/ call these on MLX's CPU stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyloader::kernels {

enum class DType : uint8_t { F32, F16, BF16 };

// The SIMD levels a build can carry. Baseline is the architecture's own
// vector ISA: SSE2 on x86-64, NEON (Advanced SIMD) on aarch64. Amx is Avx512
// whose prefill products run on the tile registers (AMX-BF16) where that is
// exact: half-precision activations, 4- or 8-bit or half-precision weights.
enum class Isa : uint8_t { Baseline, Avx2, Avx512, Amx };

// x: rows x k, row-major and contiguous.
struct Activations {
  const void* data;
  DType dtype;
  int64_t rows;
  int64_t k;
};

// rows x n, row-major and contiguous.
struct Output {
  void* data;
  DType dtype;
};

// MLX's quantization modes these kernels compute. Affine: value = scale * q +
// bias per group, scales and biases of a float dtype. Mxfp4 (OCP microscaling
// FP4, MLX's mode "mxfp4"): 4-bit E2M1 codes (sign, 2 exponent bits, 1
// mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), groups of 32
// sharing a scale stored as an 8-bit exponent (E8M0: 2^(e - 127), 255 = NaN);
// value = scale * fp4(q); no biases.
enum class QuantMode : uint8_t { Affine, Mxfp4 };

// Quantized weights as nn.QuantizedLinear holds them (n x k, used transposed):
// each row packs k values of `bits` bits least-significant bit first into
// k * bits / 32 uint32 words, `group_size` consecutive values sharing a scale.
struct QuantizedWeights {
  const uint32_t* packed;
  const void* scales;  // n x (k / group_size); uint8 exponents for Mxfp4
  const void* biases;  // same shape and dtype as scales (Affine); null (Mxfp4)
  DType scale_dtype;   // Affine
  int64_t n;
  int bits;
  int group_size;
  QuantMode mode = QuantMode::Affine;
};

// A dense n x k matrix, used transposed (x @ w.T, as nn.Linear).
struct DenseWeights {
  const void* data;
  DType dtype;
  int64_t n;
};

// out = x @ dequantize(w).T, accumulated in float32. Throws
// std::invalid_argument for a format it does not cover (see quantized_supported).
void quantized_matmul(const Activations& x, const QuantizedWeights& w, const Output& out);

// out = x @ w.T, accumulated in float32.
void dense_matmul(const Activations& x, const DenseWeights& w, const Output& out);

// ggml's block formats (GGUF tensor types): ggml_blocks.h has their layouts.
enum class GgmlType : uint8_t {
  F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
};

// n rows of weights in a ggml block format, as a GGUF file stores them: row i
// (output i) is row_bytes bytes, k / block_elems blocks end to end. Read in
// place; `data` needs no alignment.
struct BlockWeights {
  const uint8_t* data;
  GgmlType type;
  int64_t n;
  int64_t row_bytes;
};

// out = x @ dequantize(w).T, accumulated in float32, where dequantize is ggml's
// reference dequantization (exact float32 weights). Throws
// std::invalid_argument when x.k is not a multiple of the block or row_bytes
// is not what k values of the type take.
void ggml_matmul(const Activations& x, const BlockWeights& w, const Output& out);

// w's n rows of k values as float32 (n x k, row-major) into out, exactly as
// ggml's reference dequantization computes them (the same float32 operations
// in the same order). The same checks as ggml_matmul.
void ggml_dequantize(const BlockWeights& w, int64_t k, float* out);

// The ggml types the kernels compute, in GgmlType order, and their names.
std::vector<GgmlType> ggml_types();
const char* ggml_type_name(GgmlType t);
// "Q4_K" -> GgmlType::Q4_K; std::invalid_argument for a name not in ggml_types().
GgmlType parse_ggml_type(const std::string& name);

// Scaled dot-product attention, as mx.fast.scaled_dot_product_attention
// defines it: out = softmax(scale * q k^T + mask) v per (batch, query head),
// query head h reading key/value head h / (q_heads / kv_heads). Scores,
// softmax and the weighted sum are float32; the result is rounded once.
// q, k, v and mask are strided views: element strides of their first three
// dimensions (0 broadcasts), the last dimension contiguous. A key the causal
// or a bool mask drops scores the dtype's lowest finite value, as in MLX: a row
// with no key left is the mean of the values, kv_len = 0 gives zeros, and only
// a row whose every score is -inf (an additive mask) is NaN.
struct AttentionView {
  const void* data;
  int64_t stride[3];
};

enum class Mask : uint8_t { None, Bool, Additive };

struct Attention {
  DType dtype;  // q, k, v and out
  int64_t batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim;
  AttentionView q, k, v;
  float scale;
  // Query i sees keys j <= i + kv_len - q_len (the last query sees every key).
  bool causal;
  Mask mask;
  DType mask_dtype;  // of an additive mask
  // (batch, q_heads, q_len, kv_len) view: true keeps a key (Bool), or a value
  // added to the score (Additive).
  const void* mask_data;
  int64_t mask_stride[4];
  void* out;  // (batch, q_heads, q_len, value_dim), contiguous
};

void attention(const Attention& a);

// The bits and group sizes of MLX's affine mode that these kernels compute.
bool affine_supported(int bits, int group_size);
// The same for a mode: Mxfp4 is 4 bits in groups of 32.
bool quantized_supported(QuantMode mode, int bits, int group_size);

// The level that runs: the best one this CPU supports among those compiled
// in, unless PYLOADER_KERNEL_ISA or set_isa chose another.
Isa active_isa();
// Compiled in and supported by this CPU, lowest first.
std::vector<Isa> supported_isas();
// Throws std::invalid_argument when `isa` is not in supported_isas().
void set_isa(Isa isa);
const char* isa_name(Isa isa);
// "baseline" | "avx2" | "avx512" | "amx" (std::invalid_argument otherwise).
Isa parse_isa(const std::string& name);

// Threads the kernels split rows over (the caller included).
size_t thread_count();

}  // namespace pyloader::kernels
