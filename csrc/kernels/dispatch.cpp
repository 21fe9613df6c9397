// The one place that decides which compiled level runs (the CPU's features,
// PYLOADER_KERNEL_ISA, set_isa), checks a call's arguments, and splits rows
// over the kernels' threads. A level is its table of entry points (levels.h):
// choosing a level selects its table once, and every call goes through it.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/platform.h"
#include "core/thread_pool.h"
#include "kernels/ggml_blocks.h"
#include "kernels/kernels.h"
#include "kernels/levels.h"

#if PYLOADER_KERNELS_X86
#include <cpuid.h>
#endif

namespace pyloader::kernels {

namespace {

#if PYLOADER_KERNELS_X86
// CPUID leaf 7: AMX-TILE and AMX-BF16 (subleaf 0, EDX bits 24 and 22) and
// AVX512-BF16 (subleaf 1, EAX bit 5), which the tile path's conversions use.
bool has_tile_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tiles = (d >> 24 & 1) && (d >> 22 & 1);
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return tiles && (a >> 5 & 1);
}
#endif

// The levels this target builds, each with its table, lowest first.
struct Level {
  Isa isa;
  const LevelKernels* kernels;
};
const Level kCompiled[] = {
    {Isa::Baseline, &baseline::kKernels},
#if PYLOADER_KERNELS_X86
    {Isa::Avx2, &avx2::kKernels},
    {Isa::Avx512, &avx512::kKernels},
    {Isa::Amx, &amx::kKernels},
#endif
};

const Level* compiled(Isa isa) {
  for (const Level& level : kCompiled)
    if (level.isa == isa) return &level;
  return nullptr;
}

#if PYLOADER_KERNELS_X86
// AMD family 19h (Zen 4 is its AVX-512 part) runs a 512-bit vector as two
// 256-bit halves. There a GGUF block decoded into 8-lane registers (the avx2
// level's decoders) multiplies faster into a few activation rows than one
// decoded into 16 lanes, while the avx512 level stays faster for many rows and
// for MLX's formats (bench/kernel_products.py --ggml, docs/kernels.md).
bool splits_512_bit_vectors() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned family = ((a >> 8) & 0xf) + ((a >> 8 & 0xf) == 0xf ? (a >> 20) & 0xff : 0);
  return family == 0x19;
}

// Rows up to which such a CPU takes the avx2 level's GGUF product (decode).
constexpr int64_t kNarrowDecodeRows = 4;

void ggml_matmul_narrow_decode(const Activations& x, const BlockWeights& w, const Output& out) {
  (x.rows <= kNarrowDecodeRows ? avx2::kKernels : avx512::kKernels).ggml_matmul(x, w, out);
}

// The avx512 level as chosen automatically on such a CPU; PYLOADER_KERNEL_ISA
// and set_isa select the plain table, so each level's own code stays testable.
const LevelKernels kAvx512NarrowDecode = [] {
  LevelKernels k = avx512::kKernels;
  k.ggml_matmul = ggml_matmul_narrow_decode;
  return k;
}();
const Level kAvx512NarrowDecodeLevel = {Isa::Avx512, &kAvx512NarrowDecode};
#endif

// The CPU (and OS) run `isa`'s instructions; false for a level this target
// does not build.
bool cpu_has(Isa isa) {
  if (!compiled(isa)) return false;
  switch (isa) {
    case Isa::Baseline:
      return true;
#if PYLOADER_KERNELS_X86
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::Avx512:
      return cpu_has(Isa::Avx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    case Isa::Amx:
      return cpu_has(Isa::Avx512) && has_tile_bf16() && enable_tile_registers();
#else
    default:
      return false;
#endif
  }
  return false;
}

// The level PYLOADER_KERNEL_ISA names, with its own table; else the widest level
// this CPU runs, with its table as chosen for this CPU.
const Level* initial_level() {
  if (const char* env = std::getenv("PYLOADER_KERNEL_ISA"); env && *env) {
    const Isa isa = parse_isa(env);
    if (!cpu_has(isa))
      throw std::invalid_argument(std::string("PYLOADER_KERNEL_ISA=") + env +
                                  ": this CPU or build does not have that level");
    return compiled(isa);
  }
  Isa best = Isa::Baseline;
  for (Isa isa : supported_isas()) best = isa;
#if PYLOADER_KERNELS_X86
  if (best == Isa::Avx512 && splits_512_bit_vectors()) return &kAvx512NarrowDecodeLevel;
#endif
  return compiled(best);
}

std::atomic<const Level*>& active_slot() {
  static std::atomic<const Level*> slot{initial_level()};
  return slot;
}

const LevelKernels& active() { return *active_slot().load()->kernels; }

size_t initial_threads() {
  if (const char* env = std::getenv("PYLOADER_KERNEL_THREADS"); env && *env) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (*end != '\0' || v < 1 || v > 1024)
      throw std::invalid_argument(std::string("PYLOADER_KERNEL_THREADS=") + env +
                                  ": expected a whole number of threads from 1 to 1024");
    return static_cast<size_t>(v);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& pool() {
  // The caller runs tasks too: threads - 1 workers, started by the first product
  // that splits (a process that never runs a kernel starts none).
  // Decode calls a product every few hundred microseconds: workers poll that long
  // before sleeping, so a product does not wait for a thread to wake.
  static ThreadPool instance(thread_count() - 1, std::chrono::microseconds(300));
  return instance;
}

void check_activations(const char* op, const Activations& x) {
  if (x.rows < 0 || x.k < 0)
    throw std::invalid_argument(std::string("[pyloader.kernels.") + op + "] negative shape");
  if ((x.rows > 0 && x.k > 0) && !x.data)
    throw std::invalid_argument(std::string("[pyloader.kernels.") + op + "] null activations");
}

}  // namespace

size_t thread_count() {
  static const size_t threads = initial_threads();
  return threads;
}

void parallel_for(int64_t tasks, const std::function<void(int64_t)>& job) {
  if (tasks <= 0) return;
  if (tasks == 1 || thread_count() == 1) {
    for (int64_t t = 0; t < tasks; t++) job(t);
    return;
  }
  pool().run(static_cast<size_t>(tasks), [&](size_t t) { job(static_cast<int64_t>(t)); });
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Baseline:
      return "baseline";
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
    case Isa::Amx:
      return "amx";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::Baseline, Isa::Avx2, Isa::Avx512, Isa::Amx})
    if (name == isa_name(isa)) return isa;
  throw std::invalid_argument("unknown kernel level '" + name +
                              "': expected baseline, avx2, avx512 or amx");
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Baseline, Isa::Avx2, Isa::Avx512, Isa::Amx})
    if (cpu_has(isa)) out.push_back(isa);
  return out;
}

Isa active_isa() { return active_slot().load()->isa; }

void set_isa(Isa isa) {
  if (!cpu_has(isa))
    throw std::invalid_argument(std::string("kernel level ") + isa_name(isa) +
                                " is not available on this CPU or build");
  active_slot().store(compiled(isa));
}

bool affine_supported(int bits, int group_size) {
  const bool bits_ok = bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 5 ||
                       bits == 6 || bits == 8;
  return bits_ok && (group_size == 32 || group_size == 64 || group_size == 128);
}

bool quantized_supported(QuantMode mode, int bits, int group_size) {
  if (mode == QuantMode::Mxfp4) return bits == 4 && group_size == 32;
  return affine_supported(bits, group_size);
}

void quantized_matmul(const Activations& x, const QuantizedWeights& w, const Output& out) {
  check_activations("quantized_matmul", x);
  if (!quantized_supported(w.mode, w.bits, w.group_size))
    throw std::invalid_argument("[pyloader.kernels.quantized_matmul] bits=" +
                                std::to_string(w.bits) +
                                ", group_size=" + std::to_string(w.group_size) +
                                " is not a format of that mode these kernels compute");
  if (x.k % w.group_size != 0 || w.n < 0)
    throw std::invalid_argument("[pyloader.kernels.quantized_matmul] k=" + std::to_string(x.k) +
                                " is not a multiple of group_size=" +
                                std::to_string(w.group_size));
  active().quantized_matmul(x, w, out);
}

void dense_matmul(const Activations& x, const DenseWeights& w, const Output& out) {
  check_activations("dense_matmul", x);
  if (w.n < 0) throw std::invalid_argument("[pyloader.kernels.dense_matmul] negative shape");
  active().dense_matmul(x, w, out);
}

void attention(const Attention& a) {
  const auto fail = [](const std::string& why) {
    throw std::invalid_argument("[pyloader.kernels.attention] " + why);
  };
  if (a.batch < 0 || a.q_heads < 0 || a.kv_heads < 0 || a.q_len < 0 || a.kv_len < 0 ||
      a.head_dim < 0 || a.value_dim < 0)
    fail("negative shape");
  if (a.kv_heads == 0 ? a.q_heads != 0 : a.q_heads % a.kv_heads != 0)
    fail(std::to_string(a.q_heads) + " query heads do not share " + std::to_string(a.kv_heads) +
         " key/value heads evenly");
  if (a.batch == 0 || a.q_heads == 0 || a.q_len == 0 || a.value_dim == 0) return;
  if (a.mask != Mask::None && !a.mask_data) fail("null mask");
  active().attention(a);
}

std::vector<GgmlType> ggml_types() {
  std::vector<GgmlType> out;
  for (const GgmlFormat& f : kGgmlFormats) out.push_back(f.type);
  return out;
}

const char* ggml_type_name(GgmlType t) { return ggml_format(t).name; }

GgmlType parse_ggml_type(const std::string& name) {
  std::string known;
  for (const GgmlFormat& f : kGgmlFormats) {
    if (name == f.name) return f.type;
    known += known.empty() ? "" : ", ";
    known += f.name;
  }
  throw std::invalid_argument("[pyloader.kernels] unknown ggml type '" + name +
                              "': the kernels compute " + known);
}

namespace {

// k values of w's type fill whole blocks and take w.row_bytes bytes a row.
void check_blocks(const char* op, const BlockWeights& w, int64_t k) {
  const std::string prefix = std::string("[pyloader.kernels.") + op + "] ";
  if (static_cast<size_t>(w.type) >= std::size(kGgmlFormats))
    throw std::invalid_argument(prefix + "unknown ggml type");
  const GgmlFormat& f = ggml_format(w.type);
  if (k < 0 || w.n < 0 || w.row_bytes < 0) throw std::invalid_argument(prefix + "negative shape");
  if (k % f.block_elems != 0)
    throw std::invalid_argument(prefix + "k=" + std::to_string(k) + " is not a multiple of " +
                                f.name + "'s block of " + std::to_string(f.block_elems) +
                                " values");
  const int64_t expect = k / f.block_elems * f.block_bytes;
  if (w.row_bytes != expect)
    throw std::invalid_argument(prefix + "rows of " + std::to_string(w.row_bytes) +
                                " bytes, but k=" + std::to_string(k) + " values of " + f.name +
                                " take " + std::to_string(expect) + " bytes (" +
                                std::to_string(k / f.block_elems) + " blocks of " +
                                std::to_string(f.block_bytes) + ")");
  if (w.n > 0 && k > 0 && !w.data) throw std::invalid_argument(prefix + "null weights");
}

}  // namespace

void ggml_matmul(const Activations& x, const BlockWeights& w, const Output& out) {
  check_activations("ggml_matmul", x);
  check_blocks("ggml_matmul", w, x.k);
  active().ggml_matmul(x, w, out);
}

void ggml_dequantize(const BlockWeights& w, int64_t k, float* out) {
  check_blocks("ggml_dequantize", w, k);
  active().ggml_dequantize(w, k, out);
}

void rms_norm(const RmsNorm& a) { active().rms_norm(a); }

void rope(const Rope& a) { active().rope(a); }

void swiglu(const void* gate, const void* x, DType dtype, int64_t count, void* out) {
  active().swiglu(gate, x, dtype, count, out);
}

}  // namespace pyloader::kernels
