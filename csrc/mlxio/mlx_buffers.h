// How bytes become MLX arrays, on every backend libmlx may be built for.
//
// What an mlx::core::allocator::Buffer holds depends on the allocator libmlx
// was built with, and only MLX's own allocator may make one:
//   * the CPU allocator (mlx-cpu, mlx/backend/no_gpu): a pointer to
//     [size_t size][data...]; Buffer::raw_ptr() is that pointer + 8;
//   * Metal (macOS): an MTL::Buffer*; raw_ptr() is its `contents`. The
//     allocator is Metal's even for arrays on mx.cpu (unified memory);
//   * CUDA: a cu::CudaBuffer*; raw_ptr() may first migrate it to unified
//     memory.
// So pyloader makes arrays in exactly two ways:
//   * regions of a buffer from allocator::malloc (the KV arena, the expert
//     banks, the streaming buffers): an unowned Data over the real buffer and
//     a byte offset into it (region_array), valid on every backend;
//   * views of bytes it mapped itself (mmap'd checkpoints): view_of, by the
//     mode PYLOADER_ZERO_COPY selects (zero_copy_mode); the caller copies
//     into allocator::malloc where it returns nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"

namespace pyloader {

// Who owns MLX's buffers in the libmlx this process runs
// (mlx::core::metal::is_available(), mlx::core::cu::is_available()), or the
// owner PYLOADER_BUFFER_OWNER names (parse_buffer_owner), read once per
// process.
enum class BufferOwner { Cpu, Metal, Cuda };
BufferOwner buffer_owner();
const char* buffer_owner_name(BufferOwner owner);  // "cpu" | "metal" | "cuda"
// The owner pyloader acts for when PYLOADER_BUFFER_OWNER=`value` under a
// libmlx whose buffers belong to `real` ("" or "auto": `real`). Another owner
// may only be named over the CPU allocator: its buffers are plain memory, so
// taking Metal's or CUDA's paths there (copies, no direct reads, split arenas)
// is correct, only slower; the reverse would hand the CPU allocator's tricks a
// Metal or CUDA buffer. Throws UnsupportedError for that, std::invalid_argument
// for an unknown value.
BufferOwner parse_buffer_owner(const std::string& value, BufferOwner real);

// The one rule for direct reads (O_DIRECT, F_NOCACHE) into MLX's buffers: only
// into the CPU allocator's memory. CUDA's buffers are managed memory, which a
// driver may refuse to pin for the kernel's DMA (EFAULT) or pin against
// migration; Metal's are the driver's too. Neither has been tried on a GPU:
// reads into them go through the page cache until a run there proves them.
bool direct_reads_into_buffers();

// The largest single buffer MLX's allocator hands out here: Metal's
// maxBufferLength (mx::device_info(gpu)["max_buffer_length"]; its malloc
// throws above it), no limit elsewhere, or PYLOADER_MAX_BUFFER_LENGTH (bytes),
// which stands in for Metal's limit in tests. Read once per process.
uint64_t max_buffer_bytes();

// How mapped bytes become arrays.
enum class ZeroCopy {
  // An allocator::Buffer 8 bytes before the tensor, so that the CPU
  // allocator's raw_ptr() (ptr + 8) is the tensor: no copy. CPU allocator only.
  Header,
  // allocator::make_buffer over the tensor's page-rounded span (Metal: a
  // no-copy MTLBuffer, wired in MLX's residency set and counted in its active
  // memory until the array dies). Where make_buffer returns null (the CPU and
  // CUDA allocators, a span Metal refuses), the tensor is copied.
  MakeBuffer,
  // A copy into allocator::malloc (CUDA).
  Copy,
};
const char* zero_copy_name(ZeroCopy mode);  // "header" | "make_buffer" | "copy"

// The value of PYLOADER_ZERO_COPY ("auto" when unset or empty; "header",
// "make_buffer" or "copy") for `owner`: auto is header on the CPU allocator,
// make_buffer on Metal, copy otherwise. Throws UnsupportedError for "header"
// under another allocator, std::invalid_argument for any other value.
ZeroCopy parse_zero_copy(const std::string& value, BufferOwner owner);
// parse_zero_copy(getenv("PYLOADER_ZERO_COPY"), buffer_owner()), read once
// per process (a bad value throws at every call).
ZeroCopy zero_copy_mode();

// The whole pages make_buffer wraps for the bytes [offset, offset + nbytes)
// of a mapped region starting at `region_address` (`region_bytes` long).
struct PageSpan {
  uint64_t begin;   // first byte, relative to the region; a multiple of `page`
  uint64_t length;  // a multiple of `page` (but at the mapping's end); 0 for an empty range
  uint64_t offset;  // of the range's first byte within the span (the array's offset)
};
// nullopt when the range cannot be wrapped: `page` is not a power of two, the
// region does not start on a page (a mapping always does), or the range
// leaves the region. The span may run past the region's end, to the end of
// its last page, but never past the mapping: the kernel maps the region's last
// `kernel_page` whole (zeros past the file) and nothing after it, so where
// `page` exceeds `kernel_page` (PYLOADER_PAGE_SIZE) the span stops at the
// mapping's end and its length is not a multiple of `page`.
std::optional<PageSpan> page_span(uint64_t region_address, uint64_t region_bytes,
                                  uint64_t offset, uint64_t nbytes, uint64_t page,
                                  uint64_t kernel_page);
// The bytes that stop being wrapped when the buffer over `gone` is released
// while the buffers over `live` stay: its pages that no live span shares. (MLX
// counts every buffer's whole length in its active memory, so neighbours that
// share a page count it twice while both live.)
uint64_t released_bytes(const PageSpan& gone, const std::vector<PageSpan>& live);

// A view of [offset, offset + nbytes) of the mapped region at `base`
// (`region_bytes` long, page aligned), `shape`/`dtype` row major, keeping
// `owner` (the mapping) alive as long as the array's buffer lives. `mode` is
// Header or MakeBuffer. Returns nullopt where this backend will not wrap the
// bytes (make_buffer returned null; a header view whose data pointer is not
// the tensor): the caller copies.
std::optional<mlx::core::array> view_of(ZeroCopy mode, std::shared_ptr<const void> owner,
                                        uint8_t* base, uint64_t region_bytes, uint64_t offset,
                                        uint64_t nbytes, mlx::core::Shape shape,
                                        mlx::core::Dtype dtype);

// A row-major array of `shape`/`dtype` at byte `offset` of `buffer`, a buffer
// from allocator::malloc that `owner` keeps alive (its Data is unowned: MLX
// never donates or frees it; the array keeps `owner`).
mlx::core::array region_array(std::shared_ptr<const void> owner,
                              mlx::core::allocator::Buffer buffer, size_t offset,
                              mlx::core::Shape shape, mlx::core::Dtype dtype);

}  // namespace pyloader
