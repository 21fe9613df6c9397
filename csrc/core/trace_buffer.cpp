#include "core/trace_buffer.h"

#include <chrono>

#include "core/platform.h"

namespace pyloader {

int64_t trace_clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void TraceBuffer::enable(bool on, size_t capacity) {
  std::lock_guard<std::mutex> lk(mutex_);
  if (on) {
    events_.clear();
    capacity_ = capacity;
    dropped_ = 0;
  }
  enabled_.store(on, std::memory_order_relaxed);
}

void TraceBuffer::record(const TraceEvent& event) {
  std::lock_guard<std::mutex> lk(mutex_);
  if (!enabled_.load(std::memory_order_relaxed)) return;  // stopped meanwhile
  if (events_.size() < capacity_) events_.push_back(event);
  else ++dropped_;
}

std::vector<TraceEvent> TraceBuffer::take(uint64_t* dropped) {
  std::lock_guard<std::mutex> lk(mutex_);
  std::vector<TraceEvent> out;
  out.swap(events_);
  if (dropped) *dropped = dropped_;
  dropped_ = 0;
  return out;
}

TraceSpan::TraceSpan(TraceBuffer& buffer, const char* kind, uint64_t ticket, uint64_t bytes)
    : buffer_(buffer.enabled() ? &buffer : nullptr) {
  if (buffer_)
    event_ = {kind, ticket, current_thread_id(), trace_clock_ns(), 0, bytes};
}

TraceSpan::~TraceSpan() { finish(); }

void TraceSpan::finish() {
  if (!buffer_) return;
  event_.end_ns = trace_clock_ns();
  buffer_->record(event_);
  buffer_ = nullptr;
}

}  // namespace pyloader
