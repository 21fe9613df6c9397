// The entry points each SIMD level provides (matmul_<level>.cpp), and the
// thread split they share. Internal to csrc/kernels.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/kernels.h"
#include "kernels/pointwise.h"

namespace pyloader::kernels {

// Runs job(0) .. job(tasks - 1) on the kernels' threads; returns when all ran.
void parallel_for(int64_t tasks, const std::function<void(int64_t)>& job);

#define PYLOADER_DECLARE_KERNEL_LEVEL(level)                                             \
  namespace level {                                                                      \
  void quantized_matmul(const Activations& x, const QuantizedWeights& w, const Output& out); \
  void dense_matmul(const Activations& x, const DenseWeights& w, const Output& out);   \
  void attention(const Attention& a);                                                   \
  void rms_norm(const RmsNorm& a);                                                      \
  void rope(const Rope& a);                                                             \
  void swiglu(const void* gate, const void* x, DType dtype, int64_t count, void* out);  \
  }

PYLOADER_DECLARE_KERNEL_LEVEL(baseline)
#if defined(__x86_64__) || defined(_M_X64)
#define PYLOADER_KERNELS_X86 1
PYLOADER_DECLARE_KERNEL_LEVEL(avx2)
PYLOADER_DECLARE_KERNEL_LEVEL(avx512)
PYLOADER_DECLARE_KERNEL_LEVEL(amx)
#else
#define PYLOADER_KERNELS_X86 0
#endif

#undef PYLOADER_DECLARE_KERNEL_LEVEL

}  // namespace pyloader::kernels
