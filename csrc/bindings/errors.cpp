// Maps each core error class to one Python exception type.
#include <Python.h>
#include <nanobind/stl/string.h>

#include "bindings/bindings.h"
#include "core/errors.h"

void init_errors(nb::module_& m) {
  static nb::exception<pyloader::FormatError> format_error(m, "FormatError", PyExc_ValueError);
  static nb::exception<pyloader::UnsupportedError> unsupported(m, "UnsupportedError",
                                                               PyExc_TypeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const pyloader::TensorNotFound& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const pyloader::AllocationError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const pyloader::IoError& e) {
      // OSError(errno, text, filename) picks the matching subclass itself
      // (FileNotFoundError for ENOENT, PermissionError for EACCES, ...).
      nb::object exc = nb::handle(PyExc_OSError)(e.err(), e.detail(), e.path());
      nb::setattr(exc, "offset", e.offset() >= 0 ? nb::cast(e.offset()) : nb::none());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}
