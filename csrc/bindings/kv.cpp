// KvArena and KvSequence: the preallocated KV cache's C++ core.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "mlxio/kv_arena.h"

using namespace pyloader;
namespace mx = mlx::core;

void init_kv(nb::module_& m) {
  nb::class_<KvArena>(m, "KvArena",
                      "One preallocated buffer (MLX's allocator) holding every slot of a KV cache.")
      .def_static(
          "create",
          [](const std::vector<std::tuple<std::vector<int>, mx::Dtype>>& slots, bool populate,
             bool lock) {
            std::vector<KvSlotSpec> specs;
            for (const auto& [shape, dtype] : slots)
              specs.push_back({mx::Shape(shape.begin(), shape.end()), dtype});
            nb::gil_scoped_release release;  // populating touches every page
            return KvArena::create(std::move(specs), {populate, lock});
          },
          nb::arg("slots"), nb::arg("populate") = true, nb::arg("lock") = false,
          "slots: [(shape (batch, heads, capacity, dim), dtype), ...].")
      .def_prop_ro("num_slots", &KvArena::num_slots)
      .def_prop_ro("payload_bytes", &KvArena::payload_bytes, "Sum of the slots' bytes.")
      .def_prop_ro("allocated_bytes", &KvArena::allocated_bytes,
                   "Bytes allocated (payload + each slot's alignment to 64 bytes within a buffer).")
      .def_prop_ro("resident_bytes", &KvArena::resident_bytes,
                   "Bytes of the arena's whole pages resident in memory (mincore).")
      .def_prop_ro("populated", &KvArena::populated)
      .def_prop_ro("locked", &KvArena::locked)
      .def_prop_ro("lock_error", &KvArena::lock_error,
                   "Why mlock failed (with the limit and a hint), or ''.")
      .def_prop_ro(
          "buffer_bytes",
          [](const KvArena& a) {
            std::vector<size_t> out;
            for (size_t i = 0; i < a.num_buffers(); ++i) out.push_back(a.buffer_bytes(i));
            return out;
          },
          "Bytes of each allocator buffer the slots are split into (each at most the "
          "device's largest buffer: Metal's maxBufferLength, PYLOADER_MAX_BUFFER_LENGTH).")
      .def("slot_bytes", &KvArena::slot_bytes, nb::arg("slot"))
      .def("slot", &KvArena::slot, nb::arg("slot"), "The whole slot as an array (read only).");

  nb::class_<KvSequence>(m, "KvSequence",
                         "One cache layer's slots in an arena, written in place.")
      .def(nb::init<std::shared_ptr<KvArena>, std::vector<size_t>>(), nb::arg("arena"),
           nb::arg("slots"))
      .def(
          "write",
          [](KvSequence& s, std::vector<mx::array> xs, int start) {
            return s.write(std::move(xs), start);
          },
          nb::arg("xs"), nb::arg("start"),
          "Writes xs[i] (batch, heads, n, dim) at [start, start + n) of slot i; returns "
          "views of [0, start + n). Lazy.")
      .def(
          "view", [](KvSequence& s, int end) { return s.view(end); }, nb::arg("end"),
          "Views of positions [0, end) of every slot. Lazy.")
      .def_prop_ro("capacity", &KvSequence::capacity)
      .def_prop_ro("num_slots", &KvSequence::num_slots)
      .def_prop_ro("nbytes", &KvSequence::nbytes)
      .def_prop_ro("copy_on_write_count", &KvSequence::copy_on_write_count)
      .def_prop_ro("live_views", &KvSequence::live_views)
      .def_prop_ro("arena", &KvSequence::arena);
  m.def("_kv_pointers_taken", &kv_pointers_taken,
        "(in the write's task, elsewhere): data pointers the KV cache's writes took so far "
        "(a test hook: every one belongs in the task).");
}
