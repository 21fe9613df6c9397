#include "mlxio/mlx_buffers.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <variant>

#include "core/errors.h"
#include "core/mapping.h"
#include "mlx/backend/cuda/cuda.h"
#include "mlx/backend/metal/metal.h"
#include "mlx/device.h"

namespace mx = mlx::core;

namespace pyloader {

namespace {

BufferOwner libmlx_owner() {
  // Both are exported by every libmlx (false where that backend is not built).
  static const BufferOwner owner = mx::metal::is_available() ? BufferOwner::Metal
                                   : mx::cu::is_available()  ? BufferOwner::Cuda
                                                             : BufferOwner::Cpu;
  return owner;
}

}  // namespace

BufferOwner parse_buffer_owner(const std::string& value, BufferOwner real) {
  if (value.empty() || value == "auto") return real;
  BufferOwner named;
  if (value == "cpu") named = BufferOwner::Cpu;
  else if (value == "metal") named = BufferOwner::Metal;
  else if (value == "cuda") named = BufferOwner::Cuda;
  else
    throw std::invalid_argument("PYLOADER_BUFFER_OWNER='" + value +
                                "' is not one of auto, cpu, metal, cuda");
  if (named != real && real != BufferOwner::Cpu)
    throw UnsupportedError(std::string("PYLOADER_BUFFER_OWNER=") + value +
                           ": this libmlx's buffers belong to " + buffer_owner_name(real) +
                           "; only the CPU allocator's can take another owner's paths. "
                           "Unset it.");
  return named;
}

BufferOwner buffer_owner() {
  // A throwing initializer is retried: a bad value raises at every call.
  static const BufferOwner owner = [] {
    const char* v = std::getenv("PYLOADER_BUFFER_OWNER");
    return parse_buffer_owner(v ? v : "", libmlx_owner());
  }();
  return owner;
}

bool direct_reads_into_buffers() { return buffer_owner() == BufferOwner::Cpu; }

uint64_t max_buffer_bytes() {
  static const uint64_t limit = [] {
    if (const char* v = std::getenv("PYLOADER_MAX_BUFFER_LENGTH"); v && *v) {
      char* end = nullptr;
      errno = 0;
      unsigned long long n = std::strtoull(v, &end, 10);
      if (errno || *end || n == 0 || *v == '-')
        throw std::invalid_argument(std::string("PYLOADER_MAX_BUFFER_LENGTH=") + v +
                                    ": expected a positive number of bytes");
      return static_cast<uint64_t>(n);
    }
    // Only a Metal libmlx has a limit to ask for: the GPU's device_info (what
    // mx.device_info() shows in Python).
    if (libmlx_owner() == BufferOwner::Metal) {
      const auto& info = mx::device_info(mx::Device(mx::Device::gpu));
      auto it = info.find("max_buffer_length");
      if (it != info.end())
        if (const size_t* n = std::get_if<size_t>(&it->second)) return static_cast<uint64_t>(*n);
    }
    return std::numeric_limits<uint64_t>::max();
  }();
  return limit;
}

const char* buffer_owner_name(BufferOwner owner) {
  switch (owner) {
    case BufferOwner::Cpu: return "cpu";
    case BufferOwner::Metal: return "metal";
    case BufferOwner::Cuda: return "cuda";
  }
  return "?";
}

const char* zero_copy_name(ZeroCopy mode) {
  switch (mode) {
    case ZeroCopy::Header: return "header";
    case ZeroCopy::MakeBuffer: return "make_buffer";
    case ZeroCopy::Copy: return "copy";
  }
  return "?";
}

ZeroCopy parse_zero_copy(const std::string& value, BufferOwner owner) {
  if (value.empty() || value == "auto") {
    switch (owner) {
      case BufferOwner::Cpu: return ZeroCopy::Header;
      case BufferOwner::Metal: return ZeroCopy::MakeBuffer;
      case BufferOwner::Cuda: return ZeroCopy::Copy;
    }
  }
  if (value == "header") {
    if (owner != BufferOwner::Cpu)
      throw UnsupportedError(std::string("PYLOADER_ZERO_COPY=header needs MLX's CPU allocator "
                                         "(the mlx-cpu build); this libmlx's buffers belong to ") +
                             buffer_owner_name(owner) +
                             ". Unset it (auto), or set make_buffer or copy.");
    return ZeroCopy::Header;
  }
  if (value == "make_buffer") return ZeroCopy::MakeBuffer;
  if (value == "copy") return ZeroCopy::Copy;
  throw std::invalid_argument("PYLOADER_ZERO_COPY='" + value +
                              "' is not one of auto, header, make_buffer, copy");
}

ZeroCopy zero_copy_mode() {
  // A throwing initializer is retried: a bad value raises at every call.
  static const ZeroCopy mode = [] {
    const char* v = std::getenv("PYLOADER_ZERO_COPY");
    return parse_zero_copy(v ? v : "", buffer_owner());
  }();
  return mode;
}

std::optional<PageSpan> page_span(uint64_t region_address, uint64_t region_bytes,
                                  uint64_t offset, uint64_t nbytes, uint64_t page,
                                  uint64_t kernel_page) {
  if (page == 0 || (page & (page - 1)) != 0) return std::nullopt;
  if (kernel_page == 0 || (kernel_page & (kernel_page - 1)) != 0) return std::nullopt;
  if (region_address % page != 0) return std::nullopt;
  if (offset > region_bytes || nbytes > region_bytes - offset) return std::nullopt;
  if (nbytes == 0) return PageSpan{offset, 0, 0};
  uint64_t begin = offset / page * page;
  uint64_t last = offset + nbytes - 1;  // no overflow: <= region_bytes - 1
  uint64_t end = (last / page + 1) * page;
  // The mapping ends at the kernel's page past the region's end.
  const uint64_t mapped = (region_bytes + kernel_page - 1) / kernel_page * kernel_page;
  end = std::min(end, mapped);
  return PageSpan{begin, end - begin, offset - begin};
}

uint64_t released_bytes(const PageSpan& gone, const std::vector<PageSpan>& live) {
  // Spans are whole pages, so "a page of `gone` that some live span covers"
  // is an interval question: subtract the union of the live spans' overlaps.
  const uint64_t g0 = gone.begin, g1 = gone.begin + gone.length;
  std::vector<std::pair<uint64_t, uint64_t>> cover;
  for (const PageSpan& s : live) {
    uint64_t a = std::max(g0, s.begin), b = std::min(g1, s.begin + s.length);
    if (a < b) cover.emplace_back(a, b);
  }
  std::sort(cover.begin(), cover.end());
  uint64_t covered = 0, reach = g0;
  for (const auto& [a, b] : cover) {
    uint64_t from = std::max(a, reach);
    if (b > from) {
      covered += b - from;
      reach = b;
    }
  }
  return gone.length - covered;
}

namespace {

mx::Strides row_major(const mx::Shape& shape) {
  mx::Strides strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    strides[i] = strides[i + 1] * shape[i + 1];
  return strides;
}

// An array whose Data is `data` at byte `offset`, row major, ready to read.
mx::array placed_array(mx::allocator::Data data, size_t offset, mx::Shape shape,
                       mx::Dtype dtype) {
  mx::array a(std::move(shape), dtype, nullptr, {});
  mx::Strides strides = row_major(a.shape());
  size_t max_dim = 0;
  for (int d : a.shape()) max_dim = std::max(max_dim, static_cast<size_t>(d));
  mx::array::Flags flags;
  flags.contiguous = true;
  flags.row_contiguous = true;
  flags.col_contiguous = a.size() <= 1 || a.size() == max_dim;
  a.set_data(std::move(data), a.size(), std::move(strides), flags,
             static_cast<int64_t>(offset));
  a.set_status(mx::array::Status::available);
  return a;
}

}  // namespace

std::optional<mx::array> view_of(ZeroCopy mode, std::shared_ptr<const void> owner, uint8_t* base,
                                 uint64_t region_bytes, uint64_t offset, uint64_t nbytes,
                                 mx::Shape shape, mx::Dtype dtype) {
  uint8_t* first = base + offset;
  if (mode == ZeroCopy::Header) {
    // Only ever under the CPU allocator (parse_zero_copy refuses it
    // elsewhere), whose raw_ptr() skips an 8-byte size header: a Buffer 8
    // bytes before the tensor makes the array's data the tensor itself. The
    // 8 bytes in front lie inside the region (a safetensors tensor starts
    // after the 8-byte header length) and are never written: unowned Data is
    // never donated. The deleter only drops `owner`.
    if (buffer_owner() != BufferOwner::Cpu || offset < sizeof(size_t)) return std::nullopt;
    mx::allocator::Buffer buffer(static_cast<void*>(first - sizeof(size_t)));
    mx::array a(mx::allocator::Data(buffer, [owner = std::move(owner)](mx::allocator::Buffer) {}),
                std::move(shape), dtype);
    // Never hand out a view that points elsewhere (a CPU allocator laid out
    // differently): the caller copies instead.
    if (a.data<uint8_t>() != first) return std::nullopt;
    return a;
  }
  if (mode != ZeroCopy::MakeBuffer) return std::nullopt;
  // One buffer per tensor, never per file: Metal's make_buffer puts it in
  // MLX's residency set (wired) and counts it in the active memory until
  // release(). Its span is the tensor's whole pages; neighbours sharing a page
  // each wrap it.
  auto span = page_span(reinterpret_cast<uintptr_t>(base), region_bytes, offset, nbytes,
                        page_size(), platform().kernel_page);
  if (!span || span->length == 0) return std::nullopt;
  mx::allocator::Buffer buffer = mx::allocator::make_buffer(base + span->begin, span->length);
  if (!buffer.ptr()) return std::nullopt;  // this backend cannot wrap it (CPU, CUDA)
  return placed_array(mx::allocator::Data(buffer,
                                          [owner = std::move(owner)](mx::allocator::Buffer b) {
                                            mx::allocator::release(b);
                                          }),
                      span->offset, std::move(shape), dtype);
}

mx::array region_array(std::shared_ptr<const void> owner, mx::allocator::Buffer buffer,
                       size_t offset, mx::Shape shape, mx::Dtype dtype) {
  return placed_array(
      mx::allocator::Data(buffer, [owner = std::move(owner)](mx::allocator::Buffer) {}), offset,
      std::move(shape), dtype);
}

}  // namespace pyloader
