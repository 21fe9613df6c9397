// One init function per area, all called from the single NB_MODULE.
#pragma once

#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_errors(nb::module_& m);
void init_index(nb::module_& m);
void init_kv(nb::module_& m);
void init_readers(nb::module_& m);
