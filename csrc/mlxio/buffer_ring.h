// Reusable read buffers for streamed units: a few equal slots in pre-faulted
// buffers of MLX's allocator, lent out whole and returned when the last array
// made from a slot is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "mlx/allocator.h"
#include "mlxio/arena_memory.h"

namespace pyloader {

// One resource: the slots' memory (ArenaMemory, pages committed at
// construction) and which slots are lent. Leases keep the ring alive, so
// arrays over a slot stay valid after the reader that made them is gone.
// Slots share a buffer as long as it stays under the largest buffer MLX's
// allocator makes (max_buffer_bytes: Metal's maxBufferLength); more slots
// take more buffers.
class BufferRing : public std::enable_shared_from_this<BufferRing> {
 public:
  // Throws AllocationError (naming "streaming buffers") when the memory
  // cannot be committed, UnsupportedError (with the sizes) when one slot is
  // larger than the largest buffer the allocator makes.
  static std::shared_ptr<BufferRing> create(size_t slots, size_t slot_bytes);
  BufferRing(const BufferRing&) = delete;
  BufferRing& operator=(const BufferRing&) = delete;

  // A lent slot: page aligned and `slot_bytes()` long, returned to the ring
  // when the last copy of `data` is destroyed. Its arrays are regions of
  // `buffer` at `offset` (of data's first byte) plus their own offset.
  struct Lease {
    std::shared_ptr<uint8_t> data;
    mlx::core::allocator::Buffer buffer{nullptr};
    size_t offset = 0;
  };
  // A free slot; data is null when every slot is lent (the caller then uses
  // fresh memory).
  Lease acquire();

  size_t slots() const { return free_.size(); }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t lent() const;
  // The allocator buffers the slots are split into.
  size_t buffers() const { return memory_.size(); }

 private:
  BufferRing(size_t slots, size_t slot_bytes);
  void give_back(size_t slot);

  size_t slot_bytes_;
  size_t per_buffer_;  // slots in each buffer (the last may hold fewer)
  std::vector<std::unique_ptr<ArenaMemory>> memory_;
  mutable std::mutex mutex_;
  std::vector<bool> free_;
};

}  // namespace pyloader
