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
constexpr uint64_t kHugeMin = 4ull << 20;  // smaller buffers hold no whole huge page worth asking for

uint64_t align_down(uint64_t x) { return x / kAlign * kAlign; }
uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::shared_ptr<mx::allocator::Data> allocate(uint64_t bytes, bool huge, uint8_t** data) {
  auto buffer = std::make_shared<mx::allocator::Data>(mx::allocator::malloc(bytes));
  *data = static_cast<uint8_t*>(buffer->buffer().raw_ptr());
  if (bytes && !*data) throw std::bad_alloc();
  // Huge pages only in MLX's CPU heap: Metal's buffers are the driver's, and
  // CUDA's managed memory is not ours to advise.
  if (huge && bytes >= kHugeMin && buffer_owner() == BufferOwner::Cpu)
    advise_huge_pages(*data, bytes);
  return buffer;
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
  try {
    return std::make_unique<File>(File::open_read(path, /*direct=*/true));
  } catch (const IoError&) {
    return nullptr;  // not on this file system: reads go through the page cache
  }
}

ReadTarget place_tensor_read(const TensorInfo& t, const ReadFiles& files, size_t chunk_bytes,
                             std::vector<ReadChunk>& chunks) {
  ReadTarget target;
  const std::vector<Extent> extents = extents_of(t);
  // Not into CUDA's managed memory: whether the kernel can pin those pages for
  // a direct read is the driver's business, untested here.
  const bool direct = files.direct && extents.size() == 1 && t.nbytes >= kDirectReadMin &&
                      buffer_owner() != BufferOwner::Cuda &&
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
  // Whole blocks from the one holding the first byte; one block of slack to
  // start them on a block boundary of the buffer.
  const uint64_t begin = t.offset, end = t.offset + t.nbytes;
  const uint64_t first = align_down(begin);
  const uint64_t span = align_up(end) - first;
  target.data = allocate(span + kAlign, /*huge=*/true, &data);
  uint8_t* block = reinterpret_cast<uint8_t*>(align_up(reinterpret_cast<uintptr_t>(data)));
  target.offset = static_cast<size_t>(block - data) + static_cast<size_t>(begin - first);
  // Up to the file's last whole block; what is past it is read through the
  // page cache (a direct read there would come back short).
  const uint64_t last = std::min(align_up(end), align_down(files.direct->size()));
  const uint64_t step = std::max<uint64_t>(align_down(chunk_bytes), kAlign);
  for (uint64_t at = first; at < last; at += step) {
    size_t n = static_cast<size_t>(std::min(step, last - at));
    chunks.push_back({files.direct, at, block + (at - first), n});
    target.direct_bytes += n;
  }
  for (uint64_t at = std::max(begin, last); at < end; at += step)
    chunks.push_back({files.buffered, at, block + (at - first),
                      static_cast<size_t>(std::min(step, end - at))});
  return target;
}

}  // namespace pyloader
