// What reader threads did and when: a bounded record of spans (a background
// request's work, a synchronous read) for the streaming timeline
// (pyloader.trace). Off unless enabled: a span then costs one relaxed atomic
// load. Times are std::chrono::steady_clock nanoseconds, which is
// CLOCK_MONOTONIC on Linux: the clock of Python's time.monotonic_ns(), so
// spans recorded here and in Python share one time axis.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace pyloader {

struct TraceEvent {
  const char* kind;  // a string literal: "populate", "copy", "read", "evict", ...
  uint64_t ticket;   // the background request's ticket; 0 for synchronous work
  uint64_t thread;   // OS thread id of the thread that did the work
  int64_t start_ns;
  int64_t end_ns;
  uint64_t bytes;
};

// steady_clock now, in nanoseconds.
int64_t trace_clock_ns();
// current_thread_id() (core/platform.h) gives the OS id of the calling thread.

// One resource: the recorded events. Recording is lock-protected and bounded:
// past `capacity` events, new ones are counted as dropped instead of stored.
class TraceBuffer {
 public:
  static constexpr size_t kDefaultCapacity = 1u << 16;

  TraceBuffer() = default;
  TraceBuffer(const TraceBuffer&) = delete;
  TraceBuffer& operator=(const TraceBuffer&) = delete;

  // Starts (or stops) recording; starting clears what was recorded before.
  void enable(bool on, size_t capacity = kDefaultCapacity);
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void record(const TraceEvent& event);
  // Hands over the events recorded since the last take and how many were
  // dropped meanwhile (the buffer was full); both start again from empty.
  std::vector<TraceEvent> take(uint64_t* dropped);

 private:
  std::atomic<bool> enabled_{false};
  std::mutex mutex_;
  std::vector<TraceEvent> events_;
  size_t capacity_ = kDefaultCapacity;
  uint64_t dropped_ = 0;
};

// Records one span of `kind` from construction to destruction (an exception
// leaving the scope ends it too), if `buffer` was recording at construction.
class TraceSpan {
 public:
  TraceSpan(TraceBuffer& buffer, const char* kind, uint64_t ticket, uint64_t bytes);
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  ~TraceSpan();
  // Ends the span now (the destructor then records nothing).
  void finish();

 private:
  TraceBuffer* buffer_;  // null when not recording
  TraceEvent event_{};
};

}  // namespace pyloader
