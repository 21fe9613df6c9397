// Reusable read buffers for streamed units: a few equal slots in one
// pre-faulted buffer, lent out whole and returned when the last array made
// from a slot is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "mlxio/arena_memory.h"

namespace pyloader {

// One resource: the slots' memory (ArenaMemory, pages committed at
// construction) and which slots are lent. Leases keep the ring alive, so
// arrays over a slot stay valid after the reader that made them is gone.
class BufferRing : public std::enable_shared_from_this<BufferRing> {
 public:
  // Throws AllocationError (naming "streaming buffers") when the memory
  // cannot be committed.
  static std::shared_ptr<BufferRing> create(size_t slots, size_t slot_bytes);
  BufferRing(const BufferRing&) = delete;
  BufferRing& operator=(const BufferRing&) = delete;

  // A free slot, page aligned and `slot_bytes()` long, returned to the ring
  // when the last copy of the pointer is destroyed; nullptr when every slot
  // is lent (the caller then uses fresh memory).
  std::shared_ptr<uint8_t> acquire();

  // The slots' memory: a slot's arrays are regions of memory().buffer() at
  // their offset from memory().data().
  const ArenaMemory& memory() const { return memory_; }
  size_t slots() const { return free_.size(); }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t lent() const;

 private:
  BufferRing(size_t slots, size_t slot_bytes);
  void give_back(size_t slot);

  size_t slot_bytes_;
  ArenaMemory memory_;
  mutable std::mutex mutex_;
  std::vector<bool> free_;
};

}  // namespace pyloader
