#include "bindings/bindings.h"

#include <nanobind/stl/string.h>

#include "core/file.h"
#include "core/platform.h"

using namespace pyloader;

void init_platform(nb::module_& m) {
  // Read the environment switches now: a bad value fails the import, naming it.
  platform();
  m.def(
      "platform",
      [] {
        const PlatformSettings& p = platform();
        nb::dict d;
        d["os"] = p.os;
        d["kernel_page"] = p.kernel_page;
        d["page_size"] = p.page_size;
        d["portable_io"] = p.portable_io;
        d["drop"] = p.drop_by_remap ? "remap" : "madvise";
        d["pread_cap"] = p.pread_cap;
        d["sigbus_guard"] = p.sigbus_guard;
        d["huge_pages"] = p.huge_pages;
        return d;
      },
      "The platform layer's settings (docs/platform-switches.md): os, kernel_page, "
      "page_size, portable_io, drop, pread_cap, sigbus_guard, huge_pages.");
  m.def("page_size", &page_size,
        "The page every range is rounded to: the kernel's, or PYLOADER_PAGE_SIZE.");
  m.def("open_for_python", &open_for_python, nb::arg("path"), nb::arg("flags"),
        "An opener for open(): the descriptor of `path` opened without blocking, owned "
        "by the file object from the moment it exists (no Ctrl-C can leak it).");
  m.def("_pread_calls", &pread_calls, "pread calls made so far (a test hook).");
  m.def("_remap_releases", &remap_releases,
        "Mapped ranges released by remapping so far (a test hook).");
}
