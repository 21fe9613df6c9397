// ExpertBank and ExpertReader: the expert cache's slots and their reads.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "mlxio/expert_bank.h"

using namespace pyloader;
namespace mx = mlx::core;

namespace {

nb::dict read_stats(const ExpertReadStats& s) {
  nb::dict d;
  d["calls"] = s.calls;
  d["experts"] = s.experts;
  d["bytes"] = s.bytes;
  d["reads"] = s.reads;
  d["seconds"] = s.seconds;
  return d;
}

}  // namespace

void init_experts(nb::module_& m) {
  nb::class_<ExpertBank>(m, "ExpertBank",
                         "One MoE layer's expert slots: fixed-shape arrays written in place.")
      .def_static(
          "create",
          [](const TensorIndex& index, const std::vector<std::string>& tensors, uint32_t slots,
             bool populate) { return ExpertBank::create(index, tensors, slots, populate); },
          nb::arg("index"), nb::arg("tensors"), nb::arg("slots"), nb::arg("populate") = true,
          "tensors: the layer's stacked expert tensors [E, ...]; arrays are [slots + 1, ...] "
          "(the last slot is zero scratch).")
      .def_static("layout_bytes", &ExpertBank::layout_bytes, nb::arg("strides"),
                  nb::arg("slots"),
                  "Bytes a bank of `slots` slots takes for tensors whose one-expert sizes "
                  "are `strides` (scratch slot and layout included).")
      .def_prop_ro("num_experts", &ExpertBank::num_experts)
      .def_prop_ro("num_slots", &ExpertBank::num_slots)
      .def_prop_ro("scratch_slot", &ExpertBank::scratch_slot)
      .def_prop_ro("expert_bytes", &ExpertBank::expert_bytes, "Bytes of one expert.")
      .def_prop_ro("allocated_bytes", &ExpertBank::allocated_bytes)
      .def_prop_ro("tensors",
                   [](const ExpertBank& b) {
                     std::vector<std::string> out;
                     for (size_t t = 0; t < b.num_tensors(); ++t) out.push_back(b.tensor_name(t));
                     return out;
                   })
      .def("arrays",
           [](const ExpertBank& b) {
             std::vector<mx::array> out;
             for (size_t t = 0; t < b.num_tensors(); ++t) out.push_back(b.array(t));
             return out;
           },
           "Every tensor's slots, in the order of `tensors`.")
      .def(
          "span_count",
          [](const ExpertBank& b, const std::vector<ExpertMove>& moves) {
            return b.spans(moves).size();
          },
          nb::arg("moves"), "Ranges a read of `moves` takes after merging (for tests).");

  nb::class_<ExpertReader>(m, "ExpertReader", "Reads experts into expert banks.")
      .def("__init__",
           [](ExpertReader* self, std::shared_ptr<const TensorIndex> index, size_t threads,
              const std::string& backend, bool drop_cache) {
             new (self) ExpertReader(std::move(index),
                                     ExpertReaderOptions{threads, read_backend(backend),
                                                         4ull << 20, drop_cache});
           },
           nb::arg("index"), nb::arg("threads") = 0, nb::arg("backend") = "threads",
           nb::arg("drop_cache") = false)
      .def(
          "load",
          [](ExpertReader& r, ExpertBank& bank, const std::vector<ExpertMove>& moves) {
            ExpertReadStats s;
            {
              nb::gil_scoped_release release;
              s = r.load(bank, moves);
            }
            return read_stats(s);
          },
          nb::arg("bank"), nb::arg("moves"),
          "Reads each (expert, slot) of `moves` into the bank; blocks without the GIL.")
      .def("stats", [](const ExpertReader& r) { return read_stats(r.stats()); })
      .def_prop_ro("threads", &ExpertReader::threads)
      .def_prop_ro("backend", [](const ExpertReader& r) { return read_backend_name(r.backend()); });
}
