// Memory for MLX arrays that pyloader writes in place (the KV arena, the
// expert banks, the streaming buffers): one MLX-allocator buffer and an
// optional mlock. Arrays over its regions are region_array(memory.buffer(),
// offset, ...) (mlxio/mlx_buffers.h): offsets into the real buffer, valid on
// every MLX backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mlx/allocator.h"

namespace pyloader {

// "1.5 GiB".
std::string human_bytes(uint64_t n);

// One buffer from MLX's allocator (CPU, Metal or CUDA), freed on destruction. MLX's allocator
// (not a private mmap) so that the arena counts in mx.get_active_memory() and
// in mlx-lm's peak-memory reports, exactly like mlx-lm's own cache buffers,
// and comes from the same place they do (recycled allocator memory is already
// faulted in).
class ArenaMemory {
 public:
  // `populate` commits every page now (MADV_POPULATE_WRITE, or a write per
  // page on older kernels), so memory that cannot be backed fails here and
  // not halfway through a run. The contents are not zeroed. A failure throws
  // AllocationError naming `purpose` ("the KV cache") and ending with `hint`;
  // more bytes than one buffer may hold (max_buffer_bytes) UnsupportedError.
  // `huge_pages`: on MLX's CPU allocator, ask for huge pages first
  // (advise_huge_pages): for memory that direct reads fill again and again,
  // whose requests are then a few large segments instead of 4 KiB pages.
  ArenaMemory(size_t bytes, bool populate, const std::string& purpose, const std::string& hint,
              bool huge_pages = false);
  ArenaMemory(const ArenaMemory&) = delete;
  ArenaMemory& operator=(const ArenaMemory&) = delete;

  // The bytes, as the host sees them (Buffer::raw_ptr(): on Metal the
  // buffer's shared contents, on CUDA after its move to unified memory).
  uint8_t* data() const { return data_; }
  // The allocator's buffer, for arrays over regions of it.
  mlx::core::allocator::Buffer buffer() const { return buffer_.buffer(); }
  size_t size() const { return size_; }
  // Bytes of the whole pages inside the buffer that are resident (mincore).
  size_t resident_bytes() const;

 private:
  static mlx::core::allocator::Data checked_size(size_t bytes, const std::string& purpose,
                                                 const std::string& hint);

  mlx::core::allocator::Data buffer_;
  uint8_t* data_;
  size_t size_;
};

// mlock of a range, released on destruction. Advisory: a refusal (the
// RLIMIT_MEMLOCK limit, no privilege) is reported, not thrown.
class MemoryLock {
 public:
  MemoryLock(void* addr, size_t bytes);
  MemoryLock(const MemoryLock&) = delete;
  MemoryLock& operator=(const MemoryLock&) = delete;
  ~MemoryLock();

  bool locked() const { return locked_; }
  // Why the lock failed, with the limit and a hint; empty when locked.
  const std::string& error() const { return error_; }

 private:
  void* addr_;
  size_t size_;
  bool locked_ = false;
  std::string error_;
};

// Where regions of an ArenaMemory start (their offsets are multiples of it).
constexpr size_t kRegionAlign = 64;

}  // namespace pyloader
