// The table of the level being compiled (levels.h): included by each
// matmul_<level>.cpp after the level's kernels. Qualified names, so that a
// kernel a level lacks fails to compile instead of binding to the dispatcher
// of the same name in the enclosing namespace.
#ifndef PYLOADER_KERNEL_LEVEL
#error "define PYLOADER_KERNEL_LEVEL before including level_table.h"
#endif

namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL {

const LevelKernels kKernels = {
    PYLOADER_KERNEL_LEVEL::quantized_matmul, PYLOADER_KERNEL_LEVEL::dense_matmul,
    PYLOADER_KERNEL_LEVEL::attention,        PYLOADER_KERNEL_LEVEL::rms_norm,
    PYLOADER_KERNEL_LEVEL::rope,             PYLOADER_KERNEL_LEVEL::swiglu,
    PYLOADER_KERNEL_LEVEL::ggml_matmul,      PYLOADER_KERNEL_LEVEL::ggml_dequantize,
};

}  // namespace pyloader::kernels::PYLOADER_KERNEL_LEVEL
