#include "mlxio/tensor_reads.h"

#include <algorithm>
#include <new>

#include "core/errors.h"
#include "core/platform.h"
#include "mlxio/mlx_buffers.h"

namespace mx = mlx::core;

namespace pyloader {

namespace {

constexpr uint64_t kAlign = kDirectAlign;
constexpr uint64_t kHuge = 2ull << 20;
// Huge pages only for direct reads of at least this: their buffer starts on a
// huge page (up to 2 MiB of address space unused before it, which is never
// touched but counts in MLX's active memory: at most 1/8 of the tensor).
constexpr uint64_t kHugeMin = 16ull << 20;

uint64_t align_down(uint64_t x) { return x / kAlign * kAlign; }
uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::shared_ptr<mx::allocator::Data> allocate(uint64_t bytes, bool huge, uint8_t** data) {
  auto buffer = std::make_shared<mx::allocator::Data>(mx::allocator::malloc(bytes));
  *data = static_cast<uint8_t*>(buffer->buffer().raw_ptr());
  if (bytes && !*data) throw std::bad_alloc();
  if (huge) advise_huge_pages(*data, bytes);
  return buffer;
}

uint8_t* align_pointer(uint8_t* p, uint64_t to) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + to - 1) / to * to);
}

// Whole pages of the tensor missing from the page cache: read it direct.
bool cold(const File& file, uint64_t offset, uint64_t len) {
  try {
    const uint64_t page = platform().kernel_page;
    const uint64_t first = offset / page * page;
    const uint64_t span = (std::min(offset + len, file.size()) + page - 1) / page * page - first;
    return file.cached_bytes(offset, len) < span;
  } catch (const IoError&) {
    return true;  // cannot tell: the direct read is right either way
  }
}

}  // namespace

std::unique_ptr<File> open_direct_or_null(const std::string& path) {
  // Every direct read pyloader makes lands in MLX's buffers, read through a
  // descriptor from here: refusing the descriptor keeps them all to the rule.
  if (!direct_reads_into_buffers()) return nullptr;
  try {
    return std::make_unique<File>(File::open_read(path, /*direct=*/true));
  } catch (const IoError&) {
    return nullptr;  // not on this file system: reads go through the page cache
  }
}

uint64_t append_contiguous_reads(const TensorInfo& t, uint8_t* dst, const ReadFiles& files,
                                 size_t chunk_bytes, std::vector<ReadChunk>& direct_out,
                                 std::vector<ReadChunk>& buffered_out) {
  const uint64_t step = std::max<uint64_t>(align_down(chunk_bytes), kAlign);  // 2 MiB default
  const uint64_t end = t.offset + t.nbytes;
  uint64_t begin = t.offset, direct = 0;
  if (files.direct) {
    // Up to the file's last whole block; what is past it is read through the
    // page cache (a direct read there would come back short).
    const uint64_t first = align_down(begin);
    const uint64_t last = std::min(align_up(end), align_down(files.direct->size()));
    for (uint64_t at = first; at < last; at += step) {
      size_t n = static_cast<size_t>(std::min(step, last - at));
      direct_out.push_back({files.direct, at, dst - (t.offset - first) + (at - first), n});
      direct += n;
    }
    begin = std::max(begin, last);
  }
  for (uint64_t at = begin; at < end; at += step)
    buffered_out.push_back({files.buffered, at, dst + (at - t.offset),
                            static_cast<size_t>(std::min(step, end - at))});
  return direct;
}

ReadTarget place_tensor_read(const TensorInfo& t, const ReadFiles& files, size_t chunk_bytes,
                             std::vector<ReadChunk>& chunks) {
  ReadTarget target;
  const std::vector<Extent> extents = extents_of(t);
  // files.direct is null wherever direct reads into MLX's buffers are not
  // allowed (open_direct_or_null).
  const bool direct = files.direct && extents.size() == 1 && t.nbytes >= kDirectReadMin &&
                      cold(*files.buffered, t.offset, t.nbytes);
  uint8_t* data = nullptr;
  if (!direct) {
    target.data = allocate(t.nbytes, /*huge=*/false, &data);
    for (const Extent& e : extents) {  // a column block: one range per row
      for (uint64_t done = 0; done < e.len; done += chunk_bytes)
        chunks.push_back({files.buffered, e.offset + done, data + done,
                          static_cast<size_t>(std::min<uint64_t>(chunk_bytes, e.len - done))});
      data += e.len;
    }
    return target;
  }
  // Whole blocks from the one holding the first byte, started on a block
  // boundary of the buffer; for huge pages on a huge page boundary, so that
  // each 2 MiB read fills exactly one huge page. Huge pages only in MLX's CPU
  // heap: Metal's buffers are the driver's.
  const uint64_t first = align_down(t.offset);
  const uint64_t span = align_up(t.offset + t.nbytes) - first;
  const bool huge = span >= kHugeMin && platform().huge_pages &&
                    buffer_owner() == BufferOwner::Cpu;
  const uint64_t start = huge ? kHuge : kAlign;
  target.data = allocate(span + start, huge, &data);
  uint8_t* block = align_pointer(data, start);
  target.offset = static_cast<size_t>(block - data) + static_cast<size_t>(t.offset - first);
  target.direct_bytes =
      append_contiguous_reads(t, block + (t.offset - first), files, chunk_bytes, chunks, chunks);
  return target;
}

}  // namespace pyloader
