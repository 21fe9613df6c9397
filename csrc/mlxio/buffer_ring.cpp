#include "mlxio/buffer_ring.h"

#include "core/platform.h"

namespace pyloader {

namespace {
// page_size() where a size_t is used (read when used: it may come from the environment).
struct { operator size_t() const { return static_cast<size_t>(page_size()); } } const kPage;
}

std::shared_ptr<BufferRing> BufferRing::create(size_t slots, size_t slot_bytes) {
  return std::shared_ptr<BufferRing>(new BufferRing(slots, slot_bytes));
}

BufferRing::BufferRing(size_t slots, size_t slot_bytes)
    : slot_bytes_((slot_bytes + kPage - 1) / kPage * kPage),
      // One page of slack: the allocator's buffer need not start on a page.
      // Huge pages: the slots are filled by direct reads, one per unit, over and
      // over (measured here, 2 MiB O_DIRECT reads of a cold 1 GiB file into a
      // reused buffer: 0.35 s with a huge page, 0.89-1.06 s with 4 KiB pages).
      memory_(slots * slot_bytes_ + kPage, /*populate=*/true, "streaming buffers",
              "stream fewer units at once (prefetch=) or give the process more memory",
              /*huge_pages=*/true),
      free_(slots, true) {}

std::shared_ptr<uint8_t> BufferRing::acquire() {
  std::lock_guard<std::mutex> lk(mutex_);
  for (size_t i = 0; i < free_.size(); ++i) {
    if (!free_[i]) continue;
    free_[i] = false;
    auto base = reinterpret_cast<uintptr_t>(memory_.data());
    auto* slot = reinterpret_cast<uint8_t*>((base + kPage - 1) / kPage * kPage) +
                 i * slot_bytes_;
    return std::shared_ptr<uint8_t>(slot, [ring = shared_from_this(), i](uint8_t*) {
      ring->give_back(i);
    });
  }
  return nullptr;
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
