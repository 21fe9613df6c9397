// Where a pread load puts one tensor, and the reads that fill it: shared by
// the eager load (PreadReader::read) and the overlapped one (OverlappedRead).
//
// Each tensor gets a buffer of its own from allocator::malloc (freed with the
// last array over it). A tensor of at least kDirectReadMin bytes whose pages
// are not all in the page cache is read with direct I/O (O_DIRECT: no page
// cache, no copy through it) when the file has a direct descriptor (none
// outside MLX's CPU allocator: open_direct_or_null): the tensor then sits in its buffer at the same position within a page as in
// the file, its whole pages are read straight in, and the file's last
// partial page (if the tensor reaches it) through the page cache. Everything
// else is read through the page cache, which serves a warm file at memory
// speed. On MLX's CPU allocator a direct read of 16 MiB or more gets a
// buffer that starts on a huge page and asks for huge pages
// (advise_huge_pages, PYLOADER_HUGE_PAGES). Measured on this VM, 1 GiB float16 file, 2
// threads of 2 MiB reads, cold: O_DIRECT into huge pages 0.47 s, into 4 KiB
// pages 0.78 s, page-cache reads into 4 KiB pages 0.70 s. Warm page-cache
// reads gain nothing from huge pages (0.15 s either way) and sometimes stall
// on compaction, so they get none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/file.h"
#include "core/read_chunks.h"
#include "core/safetensors_index.h"
#include "mlx/allocator.h"

namespace pyloader {

// Tensors below this are always read through the page cache: their direct
// reads would be small requests plus a page of padding each.
inline constexpr uint64_t kDirectReadMin = 1ull << 20;

// The descriptors a tensor's reads may use.
struct ReadFiles {
  const File* buffered;  // through the page cache; always set
  const File* direct;    // O_DIRECT / F_NOCACHE; null where the file system has none
};

// A tensor's destination: its bytes start `offset` bytes into `data`'s buffer.
struct ReadTarget {
  std::shared_ptr<mlx::core::allocator::Data> data;
  size_t offset = 0;
  uint64_t direct_bytes = 0;  // of the chunks appended, bytes read with direct I/O
};

// Allocates tensor `t`'s buffer and appends the chunks that fill it to
// `chunks` (at most `chunk_bytes` each; direct ones in whole kDirectAlign
// blocks). Throws std::bad_alloc when the allocator returns nothing.
ReadTarget place_tensor_read(const TensorInfo& t, const ReadFiles& files, size_t chunk_bytes,
                             std::vector<ReadChunk>& chunks);

// Appends the reads of tensor `t` (one contiguous range) into `dst`, where its
// first byte goes; the buffer holds the bytes of its first block before it
// too, at the same position within the block as in the file. Whole
// kDirectAlign blocks are read from `files.direct` (when set) up to the
// file's last whole block, into `direct_out`; the rest (all of it without a
// direct descriptor) through `files.buffered`, into `buffered_out` (which may
// be the same vector). Reads of at most `chunk_bytes`, in whole blocks.
// Returns the bytes read direct.
uint64_t append_contiguous_reads(const TensorInfo& t, uint8_t* dst, const ReadFiles& files,
                                 size_t chunk_bytes, std::vector<ReadChunk>& direct_out,
                                 std::vector<ReadChunk>& buffered_out);

// A direct descriptor for reads of `path` into MLX's buffers, or null where
// the file system or platform has no direct reads (tmpfs,
// PYLOADER_PORTABLE_IO=1) or the buffers are not the CPU allocator's
// (direct_reads_into_buffers, mlxio/mlx_buffers.h).
std::unique_ptr<File> open_direct_or_null(const std::string& path);

}  // namespace pyloader
