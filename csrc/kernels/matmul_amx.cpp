// The kernels built for amx: the avx512 level whose prefill products run on
// the tile registers (amx_impl.h). CMakeLists.txt gives this file its flags;
// dispatch.cpp runs it only on a CPU that has them and an OS that grants them.
#if defined(__x86_64__) || defined(_M_X64)
#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "matmul_amx.cpp must be compiled with the amx flags (CMakeLists.txt)"
#endif
#define PYLOADER_KERNEL_LEVEL amx
#include "kernels/matmul_impl.h"
#include "kernels/pointwise_impl.h"
#include "kernels/attention_impl.h"
#include "kernels/ggml_impl.h"
#include "kernels/level_table.h"
#endif
