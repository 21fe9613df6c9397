#include "bindings/bindings.h"

#ifndef PYLOADER_MLX_VERSION
#error "PYLOADER_MLX_VERSION must be set by the build"
#endif

NB_MODULE(_core, m) {
  m.doc() = "pyloader's C++ core: safetensors index, mmap and pread readers";
  m.attr("mlx_build_version") = PYLOADER_MLX_VERSION;
  init_platform(m);
  init_errors(m);
  init_arrays(m);
  init_index(m);
  init_experts(m);
  init_kernels(m);
  init_kv(m);
  init_readers(m);
  init_stand_in(m);
}
