// Memory for MLX arrays that pyloader writes in place (the KV arena, the
// expert banks): one MLX-allocator buffer, an optional mlock, and arrays over
// regions of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mlx/allocator.h"
#include "mlx/array.h"

namespace pyloader {

// "1.5 GiB".
std::string human_bytes(uint64_t n);

// One buffer from MLX's CPU allocator, freed on destruction. MLX's allocator
// (not a private mmap) so that the arena counts in mx.get_active_memory() and
// in mlx-lm's peak-memory reports, exactly like mlx-lm's own cache buffers,
// and comes from the same place they do (measured: a fresh private mapping
// read ~3% slower on this machine than recycled allocator memory).
class ArenaMemory {
 public:
  // `populate` commits every page now (MADV_POPULATE_WRITE, or a write per
  // page on older kernels), so memory that cannot be backed fails here and
  // not halfway through a run. The contents are not zeroed. A failure throws
  // AllocationError naming `purpose` ("the KV cache") and ending with `hint`.
  ArenaMemory(size_t bytes, bool populate, const std::string& purpose, const std::string& hint);
  ArenaMemory(const ArenaMemory&) = delete;
  ArenaMemory& operator=(const ArenaMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Bytes of the whole pages inside the buffer that are resident (mincore).
  size_t resident_bytes() const;

 private:
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

// Every region starts on a cache line and has room for MLX's 8-byte buffer
// size header in front of it: MLX 0.32's CPU Buffer::raw_ptr() is ptr + 8.
constexpr size_t kRegionAlign = 64;

// Writes a region's byte size into the 8 bytes in front of it (where MLX's
// CPU allocator keeps it; the layout leaves that room free).
void write_size_header(uint8_t* data, size_t bytes);

// An array over `data` (a region laid out as above), keeping `owner` alive.
mlx::core::array region_array(std::shared_ptr<const void> owner, uint8_t* data,
                              const mlx::core::Shape& shape, mlx::core::Dtype dtype);

// Throws UnsupportedError (prefixed with `where`, naming `feature`) unless the
// array sees `data` as its first byte: if MLX's buffer layout ever changes,
// refuse rather than hand out arrays that point elsewhere.
void check_region_array(const mlx::core::array& a, const uint8_t* data, const std::string& where,
                        const std::string& feature);

}  // namespace pyloader
