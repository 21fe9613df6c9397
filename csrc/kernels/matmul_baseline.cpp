// The kernels at the architecture's baseline vector ISA (SSE2 on x86-64,
// NEON on aarch64): the level every CPU runs, and the one forced-path tests
// select with PYLOADER_KERNEL_ISA=baseline.
#define PYLOADER_KERNEL_LEVEL baseline
#include "kernels/matmul_impl.h"
#include "kernels/pointwise_impl.h"
#include "kernels/attention_impl.h"
#include "kernels/ggml_impl.h"
#include "kernels/level_table.h"
