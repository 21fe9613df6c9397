#include <atomic>
#include <chrono>
#include <future>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "core/file.h"
#include "core/sigbus_guard.h"
#include "core/trace_buffer.h"
#include "mlxio/mmap_reader.h"
#include "mlxio/pread_reader.h"

using namespace pyloader;
namespace mx = mlx::core;

namespace {

nb::dict to_dict(NamedArrays&& arrays);

// Runs a bulk read on a helper thread while this one, every 20 ms, takes the
// GIL and lets Python run its signal handlers: Ctrl-C then stops the read
// within a chunk per thread and raises KeyboardInterrupt, instead of
// waiting for the whole load.
template <typename Work>
NamedArrays interruptible(Work&& work) {
  std::atomic<bool> stop{false};
  nb::gil_scoped_release release;
  auto fut = std::async(std::launch::async, [&] { return work(&stop); });
  while (fut.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
    nb::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) {
      nb::python_error interrupt;  // takes the pending KeyboardInterrupt
      stop.store(true);
      {
        nb::gil_scoped_release wait;
        try {
          static_cast<void>(fut.get());  // Interrupted, or a result that is dropped
        } catch (...) {
        }
      }
      throw interrupt;
    }
  }
  return fut.get();
}

// names=None loads every tensor; a list loads exactly those (possibly none).
template <typename Reader>
nb::dict load_names(Reader& r, const std::optional<std::vector<std::string>>& names) {
  NamedArrays out = interruptible([&](const std::atomic<bool>* stop) {
    return names ? r.load(*names, stop) : r.load_all(stop);
  });
  return to_dict(std::move(out));
}

// load_overlapped (names=None: every tensor), GIL released: it only allocates and
// starts the reads (pread) or copies misaligned tensors (mmap).
template <typename Reader>
nb::dict load_overlapped_names(Reader& r, const std::optional<std::vector<std::string>>& names) {
  NamedArrays out;
  {
    nb::gil_scoped_release release;
    out = r.load_overlapped(names);
  }
  return to_dict(std::move(out));
}

nb::dict to_dict(NamedArrays&& arrays) {
  nb::dict d;
  for (auto& [name, a] : arrays)
    d[nb::str(name.c_str(), name.size())] = nb::cast(std::move(a), nb::rv_policy::move);
  return d;
}

nb::dict stats_dict(const ReaderStats& s) {
  nb::dict d;
  d["tensors"] = s.tensors;
  d["bytes"] = s.bytes;
  d["zero_copy_tensors"] = s.zero_copy_tensors;
  d["zero_copy_bytes"] = s.zero_copy_bytes;
  d["copied_tensors"] = s.copied_tensors;
  d["copied_bytes"] = s.copied_bytes;
  d["bytes_read"] = s.bytes_read;
  d["populate_bytes"] = s.populate_bytes;
  d["buffer_reuses"] = s.buffer_reuses;
  d["buffer_misses"] = s.buffer_misses;
  d["direct_bytes"] = s.direct_bytes;
  d["failed_tensors"] = s.failed_tensors;
  d["zero_copy_verified"] = s.zero_copy_verified;
  d["zero_copy_mode"] = s.zero_copy_mode;
  return d;
}

// (events, dropped): each event (kind, ticket, thread_id, start_ns, end_ns, bytes).
nb::tuple take_trace(TraceBuffer& trace) {
  uint64_t dropped = 0;
  std::vector<TraceEvent> events = trace.take(&dropped);
  nb::list out;
  for (const TraceEvent& e : events)
    out.append(nb::make_tuple(e.kind, e.ticket, e.thread, e.start_ns, e.end_ns, e.bytes));
  return nb::make_tuple(out, dropped);
}

constexpr const char* kTraceEnableDoc =
    "Start (clearing what was recorded) or stop recording what the reader's threads do; "
    "past `capacity` events, new ones are counted as dropped.";
constexpr const char* kTakeTraceDoc =
    "The events recorded since the last call, as (events, dropped): each event is "
    "(kind, ticket, thread_id, start_ns, end_ns, bytes), ticket 0 for synchronous work, "
    "times on trace_clock_ns()'s clock.";

}  // namespace

ReadBackend read_backend(const std::string& name) {
  if (name == "threads") return ReadBackend::Threads;
  if (name == "io_uring") return ReadBackend::IoUring;
  throw std::invalid_argument("unknown read backend '" + name +
                              "' (expected threads or io_uring)");
}

const char* read_backend_name(ReadBackend backend) {
  return backend == ReadBackend::IoUring ? "io_uring" : "threads";
}

void init_readers(nb::module_& m) {
  nb::class_<MmapReader>(m, "MmapReader", "Zero-copy arrays over read-only file mappings.")
      .def("__init__",
           [](MmapReader* self, std::shared_ptr<const TensorIndex> index, bool allow_misaligned) {
             new (self) MmapReader(std::move(index), MmapOptions{allow_misaligned});
           },
           nb::arg("index"), nb::arg("allow_misaligned") = false)
      .def("get",
           [](MmapReader& r, const std::string& name) {
             nb::gil_scoped_release release;
             return r.get(name);
           },
           nb::arg("name"))
      .def("load", &load_names<MmapReader>, nb::arg("names") = nb::none())
      .def("load_overlapped", &load_overlapped_names<MmapReader>, nb::arg("names") = nb::none(),
           "load(), then populate the viewed tensors' pages in file order in the background "
           "for as long as any of these views lives.")
      .def("advise",
           [](MmapReader& r, const std::string& name, const std::string& hint) {
             const auto advice = advice_from_string(hint);
             nb::gil_scoped_release release;  // populate reads from disk
             return r.advise_tensor(name, advice);
           },
           nb::arg("name"), nb::arg("hint"))
      .def("advise_range",
           [](MmapReader& r, uint32_t file, uint64_t offset, uint64_t length,
              const std::string& hint) {
             const auto advice = advice_from_string(hint);
             nb::gil_scoped_release release;  // populate reads from disk
             return r.advise_range(file, offset, length, advice);
           },
           nb::arg("file_id"), nb::arg("offset"), nb::arg("length"), nb::arg("hint"))
      .def("resident_bytes", &MmapReader::resident_bytes, nb::arg("name"))
      .def("prefetch",
           [](MmapReader& r, const std::vector<std::string>& names, const std::string& hint) {
             return r.prefetch(names, advice_from_string(hint));
           },
           nb::arg("names"), nb::arg("hint") = "populate")
      .def("wait",
           [](MmapReader& r, uint64_t ticket) {
             nb::gil_scoped_release release;
             r.wait(ticket);
           },
           nb::arg("ticket"))
      .def("ready", &MmapReader::ready, nb::arg("ticket"))
      .def("cancel", &MmapReader::cancel, nb::arg("ticket"))
      .def("drop", &MmapReader::drop, nb::arg("names"), nb::arg("evict"))
      .def("settle",
           [](MmapReader& r) {
             nb::gil_scoped_release release;
             r.settle();
           })
      .def("check_unchanged", &MmapReader::check_unchanged,
           "Raise OSError(ESTALE) if a mapped file changed since its header was read.")
      .def("stats", [](const MmapReader& r) { return stats_dict(r.stats()); })
      .def_prop_ro("live_mappings", &MmapReader::live_mappings)
      .def("release", &MmapReader::release)
      .def("trace_enable", [](MmapReader& r, bool on, size_t capacity) { r.trace().enable(on, capacity); },
           nb::arg("on"), nb::arg("capacity") = TraceBuffer::kDefaultCapacity, kTraceEnableDoc)
      .def("take_trace", [](MmapReader& r) { return take_trace(r.trace()); }, kTakeTraceDoc);

  nb::class_<PreadReader>(m, "PreadReader",
                          "Parallel chunked pread into fresh MLX-owned arrays.")
      .def("__init__",
           [](PreadReader* self, std::shared_ptr<const TensorIndex> index, size_t threads,
              size_t chunk_bytes, const std::string& backend, bool readahead,
              bool drop_cache, bool direct) {
             new (self) PreadReader(std::move(index),
                                    PreadOptions{threads, chunk_bytes, read_backend(backend),
                                                 readahead, drop_cache, direct});
           },
           nb::arg("index"), nb::arg("threads") = 0, nb::arg("chunk_bytes") = kDefaultPreadChunk,
           nb::arg("backend") = "threads", nb::arg("readahead") = true,
           nb::arg("drop_cache") = false, nb::arg("direct") = true)
      .def("submit", &PreadReader::submit, nb::arg("names"), nb::arg("reuse") = false)
      .def("take",
           [](PreadReader& r, uint64_t ticket) {
             NamedArrays out;
             {
               nb::gil_scoped_release release;
               out = r.take(ticket);
             }
             return to_dict(std::move(out));
           },
           nb::arg("ticket"))
      .def("ready", &PreadReader::ready, nb::arg("ticket"))
      .def("cancel", &PreadReader::cancel, nb::arg("ticket"))
      .def_prop_ro("backend", [](const PreadReader& r) { return read_backend_name(r.backend()); })
      .def("load",
           [](PreadReader& r, const std::optional<std::vector<std::string>>& names,
              bool reuse) {
             NamedArrays out = interruptible([&](const std::atomic<bool>* stop) {
               return names ? r.load(*names, stop, reuse) : r.load_all(stop);
             });
             return to_dict(std::move(out));
           },
           nb::arg("names") = nb::none(), nb::arg("reuse") = false)
      .def("load_overlapped", &load_overlapped_names<PreadReader>, nb::arg("names") = nb::none(),
           "Arrays at once, their bytes read in file order in the background: evaluating "
           "one waits for its own reads and raises the OSError its read ended with.")
      .def("reserve_buffers",
           [](PreadReader& r, size_t slots, size_t slot_bytes, bool direct) {
             nb::gil_scoped_release release;  // commits the memory
             r.reserve_buffers(slots, slot_bytes, direct);
           },
           nb::arg("slots"), nb::arg("slot_bytes"), nb::arg("direct"))
      .def("layout_bytes", &PreadReader::layout_bytes, nb::arg("names"))
      .def_prop_ro("buffer_slots", &PreadReader::buffer_slots)
      .def_prop_ro("ring_buffers", &PreadReader::ring_buffers,
                   "Allocator buffers the slots are split into (each under the device's "
                   "largest buffer).")
      .def_prop_ro("buffers_lent", &PreadReader::buffers_lent)
      .def_prop_ro("direct", &PreadReader::direct)
      .def("stats", [](const PreadReader& r) { return stats_dict(r.stats()); })
      .def_prop_ro("threads", &PreadReader::threads)
      .def("trace_enable", [](PreadReader& r, bool on, size_t capacity) { r.trace().enable(on, capacity); },
           nb::arg("on"), nb::arg("capacity") = TraceBuffer::kDefaultCapacity, kTraceEnableDoc)
      .def("take_trace", [](PreadReader& r) { return take_trace(r.trace()); }, kTakeTraceDoc);

  m.def("trace_clock_ns", &trace_clock_ns,
        "The readers' trace clock in nanoseconds (steady_clock: CLOCK_MONOTONIC on Linux, "
        "the clock of time.monotonic_ns()).");

  // Fault injection for the reliability tests (docs/RELIABILITY.md).
  m.def("_set_read_fault", &set_read_fault, nb::arg("path"), nb::arg("offset"), nb::arg("errno"),
        "Test hook: reads of `path` covering byte `offset` fail with `errno`.");
  m.def("_clear_read_faults", &clear_read_faults, "Test hook: disarm every injected fault.");
  m.def("_guarded_faults", &guarded_faults,
        "SIGBUS faults on truncated mappings absorbed as zero pages so far.");

  // The rule the mmap reader's releases follow under make_buffer views, which
  // MLX's CPU allocator never makes: a test hook drives it with ranges.
  struct ViewToken {
    std::shared_ptr<const void> held;
  };
  nb::class_<ViewToken>(m, "_ViewToken")
      .def("close", [](ViewToken& t) { t.held.reset(); }, "Drops the view.");
  struct ViewedRangesHook {
    std::shared_ptr<ViewedRanges> ranges = std::make_shared<ViewedRanges>();
    std::shared_ptr<std::vector<std::pair<uint64_t, uint64_t>>> released =
        std::make_shared<std::vector<std::pair<uint64_t, uint64_t>>>();
  };
  nb::class_<ViewedRangesHook>(m, "_ViewedRanges",
                               "Test hook: ViewedRanges (mlxio/mmap_reader.h) over byte ranges.")
      .def(nb::init<>())
      .def("view", [](ViewedRangesHook& h, uint64_t begin,
                      uint64_t end) { return ViewToken{h.ranges->view(begin, end)}; },
           nb::arg("begin"), nb::arg("end"))
      .def("release",
           [](ViewedRangesHook& h, uint64_t begin, uint64_t end) {
             return h.ranges->release(begin, end, [log = h.released, begin, end] {
               log->emplace_back(begin, end);
             });
           },
           nb::arg("begin"), nb::arg("end"), "True when it ran now; else it waits.")
      .def_prop_ro("released", [](const ViewedRangesHook& h) { return *h.released; })
      .def_prop_ro("live", [](const ViewedRangesHook& h) { return h.ranges->live(); })
      .def_prop_ro("waiting", [](const ViewedRangesHook& h) { return h.ranges->waiting(); });
}
