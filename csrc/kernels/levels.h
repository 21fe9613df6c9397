// The entry points each SIMD level provides (matmul_<level>.cpp), and the
// thread split they share. Internal to csrc/kernels.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/kernels.h"
#include "kernels/pointwise.h"

// The x86-64 levels are built unless the build says otherwise (PYLOADER_SIMD_LEVELS).
#ifndef PYLOADER_KERNELS_X86
#if defined(__x86_64__) || defined(_M_X64)
#define PYLOADER_KERNELS_X86 1
#else
#define PYLOADER_KERNELS_X86 0
#endif
#endif

namespace pyloader::kernels {

// Runs job(0) .. job(tasks - 1) on the kernels' threads; returns when all ran.
void parallel_for(int64_t tasks, const std::function<void(int64_t)>& job);

// One level's entry points, with kernels.h's signatures. Each compiled level
// defines one instance (level_table.h); dispatch.cpp selects the active one
// when the level is chosen and calls through it.
struct LevelKernels {
  void (*quantized_matmul)(const Activations& x, const QuantizedWeights& w, const Output& out);
  void (*dense_matmul)(const Activations& x, const DenseWeights& w, const Output& out);
  void (*attention)(const Attention& a);
  void (*rms_norm)(const RmsNorm& a);
  void (*rope)(const Rope& a);
  void (*swiglu)(const void* gate, const void* x, DType dtype, int64_t count, void* out);
  void (*ggml_matmul)(const Activations& x, const BlockWeights& w, const Output& out);
  void (*ggml_dequantize)(const BlockWeights& w, int64_t k, float* out);
};

// The baseline level is built on every target; the x86 levels only on x86-64.
namespace baseline {
extern const LevelKernels kKernels;
}
#if PYLOADER_KERNELS_X86
namespace avx2 {
extern const LevelKernels kKernels;
}
namespace avx512 {
extern const LevelKernels kKernels;
}
namespace amx {
extern const LevelKernels kKernels;
}
#endif

}  // namespace pyloader::kernels
