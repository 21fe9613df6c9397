// The kernels built for avx2 (CMakeLists.txt gives this file its flags);
// dispatch.cpp runs them only on a CPU that has the level.
#if defined(__x86_64__) || defined(_M_X64)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "matmul_avx2.cpp must be compiled with the avx2 flags (CMakeLists.txt)"
#endif
#define PYLOADER_KERNEL_LEVEL avx2
#include "kernels/matmul_impl.h"
#include "kernels/pointwise_impl.h"
#include "kernels/attention_impl.h"
#include "kernels/ggml_impl.h"
#include "kernels/level_table.h"
#endif
