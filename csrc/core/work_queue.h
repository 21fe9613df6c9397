// Asynchronous jobs with tickets: the engine under the prefetcher. One
// resource: its worker threads, joined (after dropping unstarted jobs) on
// destruction.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace pyloader {

class WorkQueue {
 public:
  explicit WorkQueue(size_t workers = 1);
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;
  ~WorkQueue();

  // Queues `job`, which is called with its own ticket; jobs start in
  // submission order.
  uint64_t submit(std::function<void(uint64_t ticket)> job);
  // Queues `job` and forgets it: no ticket to wait for, its exception is
  // dropped (advisory work such as dropping pages).
  void post(std::function<void()> job);
  // Blocks until every job queued before this call has run.
  void settle();
  // Blocks until the job has run, then forgets the ticket. Rethrows the
  // job's exception. A cancelled or unknown ticket throws invalid_argument.
  void wait(uint64_t ticket);
  // True once the job has finished (successfully or not).
  bool done(uint64_t ticket) const;
  // Drops a job that has not started; returns false if it already started
  // (it then runs to completion and must still be waited for or cancelled
  // again after it finished, which forgets it).
  bool cancel(uint64_t ticket);
  size_t pending() const;

 private:
  enum class State { Queued, Running, Done };
  struct Slot {
    State state = State::Queued;
    std::function<void(uint64_t)> job;
    std::exception_ptr error;
    bool detached = false;  // post(): erased when done, never waited for
  };
  void worker_loop();

  mutable std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::deque<uint64_t> queue_;
  std::unordered_map<uint64_t, Slot> slots_;
  uint64_t next_ticket_ = 1;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace pyloader
