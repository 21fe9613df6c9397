// How bytes become MLX arrays on this libmlx (mlxio/mlx_buffers.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "mlxio/mlx_buffers.h"
#include "mlxio/task_count.h"

using namespace pyloader;

void init_arrays(nb::module_& m) {
  m.def("release_leaked_tasks", &release_leaked_tasks,
        nb::call_guard<nb::gil_scoped_release>(),
        "Waits for the tasks queued on the default streams (the caller has synchronized "
        "any other), then sets MLX's count of active tasks back to zero (a failed task "
        "can leave it too high, and eval then waits forever: mlxio/task_count.h); "
        "returns by how much it was off.");
  m.def("active_tasks", &active_tasks, "MLX's count of active tasks.");
  m.def("buffer_owner", [] { return buffer_owner_name(buffer_owner()); },
        "Whose buffers this libmlx's arrays hold: 'cpu' (MLX's CPU allocator), 'metal' "
        "or 'cuda'.");
  m.def("zero_copy_mode", [] { return zero_copy_name(zero_copy_mode()); },
        "How mapped tensors become arrays: 'header', 'make_buffer' or 'copy' "
        "(PYLOADER_ZERO_COPY, read once; 'auto' chooses by buffer_owner()).");
  m.def(
      "parse_zero_copy",
      [](const std::string& value, const std::string& owner) {
        BufferOwner o;
        if (owner == "cpu") o = BufferOwner::Cpu;
        else if (owner == "metal") o = BufferOwner::Metal;
        else if (owner == "cuda") o = BufferOwner::Cuda;
        else throw std::invalid_argument("unknown buffer owner '" + owner + "'");
        return zero_copy_name(parse_zero_copy(value, o));
      },
      nb::arg("value"), nb::arg("owner"),
      "The mode zero_copy_mode() takes for PYLOADER_ZERO_COPY=`value` ('' or 'auto', "
      "'header', 'make_buffer', 'copy') under buffer owner `owner` ('cpu', 'metal', "
      "'cuda').");
  m.def(
      "page_span",
      [](uint64_t region_address, uint64_t region_bytes, uint64_t offset, uint64_t nbytes,
         uint64_t page, std::optional<uint64_t> kernel_page)
          -> std::optional<std::tuple<uint64_t, uint64_t, uint64_t>> {
        auto s = page_span(region_address, region_bytes, offset, nbytes, page,
                           kernel_page.value_or(page));
        if (!s) return std::nullopt;
        return std::make_tuple(s->begin, s->length, s->offset);
      },
      nb::arg("region_address"), nb::arg("region_bytes"), nb::arg("offset"), nb::arg("nbytes"),
      nb::arg("page"), nb::arg("kernel_page") = nb::none(),
      "The make_buffer path's arithmetic: (begin, length, offset) of the whole pages that "
      "wrap bytes [offset, offset + nbytes) of a region, or None when they cannot be wrapped. "
      "`kernel_page` (default `page`): the page the kernel maps, where the mapping ends.");
  m.def(
      "released_bytes",
      [](std::tuple<uint64_t, uint64_t, uint64_t> gone,
         const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& live) {
        auto span = [](const std::tuple<uint64_t, uint64_t, uint64_t>& t) {
          return PageSpan{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
        };
        std::vector<PageSpan> spans;
        for (const auto& t : live) spans.push_back(span(t));
        return released_bytes(span(gone), spans);
      },
      nb::arg("gone"), nb::arg("live"),
      "Bytes of page_span `gone` no span in `live` shares: what releasing its buffer gives "
      "back while the others stay.");
}
