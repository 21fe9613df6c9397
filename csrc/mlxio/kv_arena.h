// A preallocated key/value arena for attention caches.
//
// Buffers of MLX's allocator hold every slot (a layer's keys, values, or the
// packed parts of a quantized cache) at full capacity, laid out like mlx-lm's
// KVCache buffers: (batch, heads, capacity, dim), row-major. One buffer takes
// as many slots, in order, as fit under the largest buffer this allocator
// makes (max_buffer_bytes: Metal's maxBufferLength), so a long context is a
// few buffers on a Mac and one elsewhere; a slot never spans two. MLX sees
// each slot as an array at the slot's byte offset in its buffer (region_array: an unowned allocator::Data over the real
// buffer), valid on the CPU, Metal and CUDA allocators alike. A custom
// primitive writes new tokens into it in place: MLX itself would never write
// there, because unowned buffers (and slices sharing one) are not donatable,
// so its SliceUpdate would copy the whole slot every token.
//
// Ordering. MLX runs a graph in a BFS order over independent nodes, so
// in-place writes need explicit edges:
//   * each write takes the previous write's output as an input (a chain per
//     sequence), so writes run in the order they were made, and every view
//     a later step reads has all earlier writes before it;
//   * a write that would change positions still visible through a live
//     array (a view handed out earlier, or one not yet evaluated) is
//     redirected to a fresh arena instead (copy on write). Views carry a
//     token in their buffer's deleter, so "live" is exact: a view, and any
//     array sharing its buffer, keeps its token alive. Appends never change
//     visible positions, so in normal decoding no copy is ever made.
// Devices. The write is a CPU kernel and always runs on the calling thread's
// default CPU stream; the model may run on any device and stream (on a Mac,
// the GPU): MLX orders the cross-stream dependencies, and the arena, a buffer
// of MLX's allocator, is what the GPU reads (a shared MTLBuffer on Apple
// silicon). Appends write positions no earlier view shows, so a GPU still
// reading the previous step's views never races the write. Only a Mac can
// confirm this on Metal; on Linux every mlx-lm generation already writes
// across streams (the model runs on mlx-lm's generation stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "mlxio/arena_memory.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace pyloader {

// Data pointers the cache's writes have taken (in their task, elsewhere), for
// the check that every one is taken on the task, never at graph build time.
std::pair<uint64_t, uint64_t> kv_pointers_taken();

struct KvSlotSpec {
  mlx::core::Shape shape;  // (batch, heads, capacity, dim)
  mlx::core::Dtype dtype;
};

struct KvArenaOptions {
  bool populate = true;  // commit all pages at creation
  bool lock = false;     // mlock the arena (see lock_error())
};

class KvArena : public std::enable_shared_from_this<KvArena> {
 public:
  static std::shared_ptr<KvArena> create(std::vector<KvSlotSpec> slots,
                                         KvArenaOptions options = {});
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;

  size_t num_slots() const { return slots_.size(); }
  const KvSlotSpec& spec(size_t slot) const { return slots_.at(slot).spec; }
  size_t slot_bytes(size_t slot) const { return slots_.at(slot).bytes; }
  size_t payload_bytes() const { return payload_; }  // sum of slot bytes
  size_t allocated_bytes() const;                    // of every buffer
  size_t resident_bytes() const;
  // The allocator buffers the slots are split into, and each one's bytes.
  size_t num_buffers() const { return memory_.size(); }
  size_t buffer_bytes(size_t buffer) const { return memory_.at(buffer)->size(); }
  bool populated() const { return options_.populate; }
  bool locked() const;
  std::string lock_error() const;

  // The whole slot as an array over the arena (shares the arena's lifetime).
  mlx::core::array slot(size_t slot) const;

 private:
  struct Slot {
    KvSlotSpec spec;
    size_t buffer;  // which of memory_
    size_t offset;  // of the slot's first byte in that buffer
    size_t bytes;
  };
  KvArena(std::vector<Slot> slots, size_t payload, const std::vector<size_t>& buffers,
          KvArenaOptions options);

  std::vector<Slot> slots_;
  size_t payload_;
  KvArenaOptions options_;
  std::vector<std::unique_ptr<ArenaMemory>> memory_;
  std::vector<std::unique_ptr<MemoryLock>> locks_;  // released before the memory is freed
};

// One cache layer's slots with one write cursor: the keys and values of a
// layer (2 slots) or their packed parts (6 slots for a quantized cache).
class KvSequence {
 public:
  KvSequence(std::shared_ptr<KvArena> arena, std::vector<size_t> slots);
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  // Writes xs[i] (batch, heads, n, dim_i) at positions [start, start + n)
  // of slot i and returns views of positions [0, start + n). xs are cast to
  // the slot dtype when they differ. Lazy: nothing runs until evaluated.
  std::vector<mlx::core::array> write(std::vector<mlx::core::array> xs, int start,
                                      mlx::core::StreamOrDevice s = {});
  // Views of positions [0, end) without writing.
  std::vector<mlx::core::array> view(int end, mlx::core::StreamOrDevice s = {});

  int capacity() const { return capacity_; }
  size_t num_slots() const { return slots_.size(); }
  const KvSlotSpec& spec(size_t i) const { return arena_->spec(slots_.at(i)); }
  size_t nbytes() const;  // arena bytes of this sequence's slots
  // Writes redirected to a fresh arena because live arrays still showed
  // the positions they overwrite.
  uint64_t copy_on_write_count() const { return cow_count_; }
  size_t live_views();  // views (or pending writes) still alive
  const std::shared_ptr<KvArena>& arena() const { return arena_; }

 private:
  std::vector<mlx::core::array> record(std::vector<mlx::core::array> xs, int start, int end,
                                       mlx::core::StreamOrDevice s);
  int max_live_end();

  std::shared_ptr<KvArena> arena_;
  std::vector<size_t> slots_;
  int capacity_;
  std::vector<mlx::core::array> states_;  // latest whole-slot arrays (the chain)
  std::vector<std::pair<int, std::weak_ptr<void>>> live_;  // (end, token)
  uint64_t cow_count_ = 0;
};

}  // namespace pyloader
