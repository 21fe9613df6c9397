#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "core/file.h"
#include "core/mapping.h"
#include "core/read_chunks.h"
#include "core/safetensors_index.h"

using namespace pyloader;

namespace {

nb::dict pairs_to_dict(const std::vector<std::pair<std::string, std::string>>& kv) {
  nb::dict d;
  for (const auto& [k, v] : kv) d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
  return d;
}

}  // namespace

void init_index(nb::module_& m) {
  nb::class_<TensorInfo>(m, "TensorInfo", "Where one tensor lives; no data is read.")
      .def_ro("name", &TensorInfo::name)
      .def_ro("file_id", &TensorInfo::file, "Index into TensorIndex.files.")
      .def_prop_ro("dtype", [](const TensorInfo& t) { return dtype_name(t.dtype); },
                   "safetensors dtype name, e.g. 'BF16'.")
      .def_prop_ro("shape",
                   [](const TensorInfo& t) {
                     nb::list l;
                     for (uint64_t d : t.shape) l.append(d);
                     return nb::tuple(l);
                   })
      .def_ro("offset", &TensorInfo::offset, "Absolute byte offset in its file.")
      .def_ro("nbytes", &TensorInfo::nbytes)
      .def_ro("aligned", &TensorInfo::aligned,
              "True when the offset is a multiple of the dtype's item size.")
      .def_prop_ro("extents",
                   [](const TensorInfo& t) {
                     nb::list l;
                     for (const Extent& e : extents_of(t)) l.append(nb::make_tuple(e.offset, e.len));
                     return l;
                   },
                   "Its byte ranges (offset, length) in element order: one for a tensor, "
                   "one per row for a block of columns.")
      .def("__repr__", [](const TensorInfo& t) {
        std::string s = "TensorInfo('" + t.name + "', " + dtype_name(t.dtype) + ", [";
        for (size_t i = 0; i < t.shape.size(); ++i)
          s += (i ? ", " : "") + std::to_string(t.shape[i]);
        return s + "], offset=" + std::to_string(t.offset) +
               ", nbytes=" + std::to_string(t.nbytes) +
               (t.aligned ? "" : ", misaligned") + ")";
      });

  nb::class_<FileInfo>(m, "FileInfo", "One safetensors file of a checkpoint.")
      .def_ro("path", &FileInfo::path)
      .def_ro("size", &FileInfo::size)
      .def_ro("header_bytes", &FileInfo::header_bytes)
      .def_ro("data_start", &FileInfo::data_start)
      .def_prop_ro("metadata", [](const FileInfo& f) { return pairs_to_dict(f.metadata); });

  nb::class_<TensorIndex>(m, "TensorIndex",
                          "The validated table of a checkpoint's tensors (headers only).")
      .def_static(
          "open",
          [](const std::string& path) {
            std::shared_ptr<TensorIndex> idx;
            {
              nb::gil_scoped_release release;
              idx = std::make_shared<TensorIndex>(TensorIndex::open(path));
            }
            return idx;
          },
          nb::arg("path"))
      .def_static(
          "of_regions",
          [](const std::string& path, uint64_t data_start,
             const std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>,
                                          uint64_t, uint64_t>>& regions) {
            std::vector<TensorRegion> specs;
            specs.reserve(regions.size());
            for (const auto& [name, dtype, shape, offset, nbytes] : regions)
              specs.push_back({name, dtype, shape, offset, nbytes});
            std::shared_ptr<TensorIndex> idx;
            {
              nb::gil_scoped_release release;
              idx = std::make_shared<TensorIndex>(TensorIndex::of_regions(path, data_start, specs));
            }
            return idx;
          },
          nb::arg("path"), nb::arg("data_start"), nb::arg("regions"),
          "An index over (name, dtype, shape, offset, nbytes) regions of one file whose "
          "format another reader checked (a GGUF file); each region is checked again "
          "against the file.")
      .def_prop_ro("root", &TensorIndex::root)
      .def_prop_ro("files", [](const TensorIndex& i) { return i.files(); })
      .def_prop_ro("total_nbytes", &TensorIndex::total_nbytes)
      .def_prop_ro("index_metadata",
                   [](const TensorIndex& i) { return pairs_to_dict(i.index_metadata()); })
      .def("keys",
           [](const TensorIndex& i) {
             nb::list l;
             for (const auto& t : i.tensors()) l.append(nb::str(t.name.c_str(), t.name.size()));
             return l;
           })
      .def("tensors", [](const TensorIndex& i) { return i.tensors(); })
      .def("__len__", [](const TensorIndex& i) { return i.tensors().size(); })
      .def("__contains__",
           [](const TensorIndex& i, const std::string& n) { return i.find(n) != nullptr; })
      .def("__getitem__", [](const TensorIndex& i, const std::string& n) { return i.at(n); })
      .def(
          "with_slices",
          [](const TensorIndex& i,
             const std::vector<std::tuple<std::string, std::string, uint32_t,
                                          std::vector<std::pair<uint64_t, uint64_t>>>>& slices) {
            std::vector<TensorSlice> specs;
            specs.reserve(slices.size());
            for (const auto& [name, tensor, axis, ranges] : slices)
              specs.push_back({name, tensor, axis, ranges});
            return std::make_shared<TensorIndex>(i.with_slices(specs));
          },
          nb::arg("slices"),
          "A copy that also finds each (name, tensor, axis, [(start, stop), ...]) slice by "
          "name: the tensor's indices [start, stop) of each range along axis, the other "
          "axes whole.");

  m.def("uring_available", &uring_available,
        "True when this build has io_uring and the kernel lets this process use it.");
  m.def("uring_built", &uring_built,
        "True when this build was compiled with liburing (uring_available may still be "
        "False: PYLOADER_PORTABLE_IO=1, or a kernel that refuses io_uring).");
  m.def(
      "evict_file",
      [](const std::string& path) {
        nb::gil_scoped_release release;
        evict_file_from_page_cache(path);
      },
      nb::arg("path"),
      "Drop a file's clean pages from the page cache (posix_fadvise DONTNEED; "
      "msync(MS_INVALIDATE) where there is none, e.g. Darwin).");
  m.def(
      "cached_bytes",
      [](const std::string& path) {
        nb::gil_scoped_release release;
        return cached_bytes_of_file(path);
      },
      nb::arg("path"),
      "Bytes of a file in the page cache (mincore; whole pages, at most its size).");
}
