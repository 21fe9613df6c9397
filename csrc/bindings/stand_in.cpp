// stand_in(shape, dtype, message): an array that raises StandInError when evaluated.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "core/errors.h"
#include "mlxio/stand_in.h"

namespace mx = mlx::core;

void init_stand_in(nb::module_& m) {
  // Raised by whatever evaluates a stand-in (mx.eval, .item(), a token's
  // async_eval): nanobind's translators are shared by the mlx domain, so
  // mlx.core's own functions raise this type too.
  static nb::exception<pyloader::StandInRead> stand_in_error(m, "StandInError",
                                                             PyExc_RuntimeError);
  m.def(
      "stand_in",
      [](const std::vector<int>& shape, mx::Dtype dtype, const std::string& message) {
        return pyloader::stand_in_array(mx::Shape(shape.begin(), shape.end()), dtype,
                                        message);
      },
      nb::arg("shape"), nb::arg("dtype"), nb::arg("message"),
      "An array of `shape` and `dtype` holding no data: evaluating it raises "
      "StandInError(message). What a streamed parameter is while its unit is out.");
}
