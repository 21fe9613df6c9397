#include "mlxio/buffer_ring.h"

#include <string>

#include "core/errors.h"
#include "core/platform.h"
#include "mlxio/mlx_buffers.h"

namespace pyloader {

namespace {
// page_size() where a size_t is used (read when used: it may come from the environment).
struct { operator size_t() const { return static_cast<size_t>(page_size()); } } const kPage;
}

std::shared_ptr<BufferRing> BufferRing::create(size_t slots, size_t slot_bytes) {
  return std::shared_ptr<BufferRing>(new BufferRing(slots, slot_bytes));
}

BufferRing::BufferRing(size_t slots, size_t slot_bytes)
    : slot_bytes_((slot_bytes + kPage - 1) / kPage * kPage), free_(slots, true) {
  // One page of slack in each buffer: the allocator's buffer need not start
  // on a page.
  const uint64_t limit = max_buffer_bytes();
  const uint64_t room = limit > kPage ? limit - kPage : 0;
  if (slot_bytes_ > room)
    throw UnsupportedError(
        "[streaming buffers] one slot needs " + std::to_string(slot_bytes_ + kPage) +
        " bytes (" + human_bytes(slot_bytes_ + kPage) +
        ": the largest unit's tensors, page aligned, and a page) in one buffer, and this "
        "device's largest buffer (maxBufferLength) is " + std::to_string(limit) + " bytes (" +
        human_bytes(limit) + "). Stream smaller units (sublayer streaming) or turn the "
        "streaming buffers off.");
  per_buffer_ = slots == 0 ? 1 : std::min<size_t>(slots, static_cast<size_t>(room / slot_bytes_));
  for (size_t first = 0; first < slots; first += per_buffer_) {
    const size_t n = std::min(per_buffer_, slots - first);
    // Huge pages: the slots are filled by direct reads, one per unit, over and
    // over, and a direct read into a huge page is a few large DMA segments.
    memory_.push_back(std::make_unique<ArenaMemory>(
        n * slot_bytes_ + kPage, /*populate=*/true, "streaming buffers",
        "stream fewer units at once (prefetch=) or give the process more memory",
        /*huge_pages=*/true));
  }
}

BufferRing::Lease BufferRing::acquire() {
  std::lock_guard<std::mutex> lk(mutex_);
  for (size_t i = 0; i < free_.size(); ++i) {
    if (!free_[i]) continue;
    free_[i] = false;
    const ArenaMemory& m = *memory_[i / per_buffer_];
    auto base = reinterpret_cast<uintptr_t>(m.data());
    auto* slot = reinterpret_cast<uint8_t*>((base + kPage - 1) / kPage * kPage) +
                 (i % per_buffer_) * slot_bytes_;
    Lease lease;
    lease.data = std::shared_ptr<uint8_t>(slot, [ring = shared_from_this(), i](uint8_t*) {
      ring->give_back(i);
    });
    lease.buffer = m.buffer();
    lease.offset = static_cast<size_t>(slot - m.data());
    return lease;
  }
  return {};
}

void BufferRing::give_back(size_t slot) {
  std::lock_guard<std::mutex> lk(mutex_);
  free_[slot] = true;
}

size_t BufferRing::lent() const {
  std::lock_guard<std::mutex> lk(mutex_);
  size_t n = 0;
  for (bool f : free_) n += !f;
  return n;
}

}  // namespace pyloader
