// One init function per area, all called from the single NB_MODULE.
#pragma once

#include <string>

#include <nanobind/nanobind.h>

#include "core/read_chunks.h"

namespace nb = nanobind;

// "threads" | "io_uring" (std::invalid_argument otherwise), and back.
pyloader::ReadBackend read_backend(const std::string& name);
const char* read_backend_name(pyloader::ReadBackend backend);

void init_arrays(nb::module_& m);
void init_errors(nb::module_& m);
void init_experts(nb::module_& m);
void init_index(nb::module_& m);
void init_kernels(nb::module_& m);
void init_kv(nb::module_& m);
void init_platform(nb::module_& m);
void init_readers(nb::module_& m);
void init_stand_in(nb::module_& m);
