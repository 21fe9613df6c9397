#include "core/work_queue.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pyloader {

WorkQueue::WorkQueue(size_t workers) {
  workers = std::max<size_t>(workers, 1);
  for (size_t i = 0; i < workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    stop_ = true;
    for (uint64_t t : queue_) slots_.erase(t);
    queue_.clear();
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

uint64_t WorkQueue::submit(std::function<void(uint64_t)> job) {
  uint64_t t;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    t = next_ticket_++;
    slots_[t].job = std::move(job);
    queue_.push_back(t);
  }
  wake_.notify_one();
  return t;
}

void WorkQueue::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    uint64_t t = next_ticket_++;
    Slot& slot = slots_[t];
    slot.job = [job = std::move(job)](uint64_t) { job(); };
    slot.detached = true;
    queue_.push_back(t);
  }
  wake_.notify_one();
}

void WorkQueue::settle() { wait(submit([](uint64_t) {})); }

void WorkQueue::worker_loop() {
  for (;;) {
    std::function<void(uint64_t)> job;
    uint64_t t;
    {
      std::unique_lock<std::mutex> lk(mutex_);
      wake_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      t = queue_.front();
      queue_.pop_front();
      auto& slot = slots_.at(t);
      slot.state = State::Running;
      job = std::move(slot.job);
    }
    std::exception_ptr err;
    try {
      job(t);
    } catch (...) {
      err = std::current_exception();
    }
    job = nullptr;  // release captures before signalling completion
    {
      std::lock_guard<std::mutex> lk(mutex_);
      auto it = slots_.find(t);
      if (it != slots_.end() && it->second.detached) {
        slots_.erase(it);  // nobody waits for it; its error is dropped
      } else if (it != slots_.end()) {
        it->second.state = State::Done;
        // Moved, not copied: the waiter then holds the only reference and
        // frees the exception itself, instead of this thread releasing it
        // while the waiter may still be reading it (TSan cannot see
        // libstdc++'s atomic refcount, and it need not be relied on).
        it->second.error = std::move(err);
      }
    }
    finished_.notify_all();
  }
}

void WorkQueue::wait(uint64_t ticket) {
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mutex_);
    auto it = slots_.find(ticket);
    if (it == slots_.end() || it->second.detached)
      throw std::invalid_argument("unknown or cancelled prefetch ticket " +
                                  std::to_string(ticket));
    finished_.wait(lk, [&] { return slots_.at(ticket).state == State::Done; });
    err = slots_.at(ticket).error;
    slots_.erase(ticket);
  }
  if (err) std::rethrow_exception(err);
}

bool WorkQueue::done(uint64_t ticket) const {
  std::lock_guard<std::mutex> lk(mutex_);
  auto it = slots_.find(ticket);
  return it != slots_.end() && it->second.state == State::Done;
}

bool WorkQueue::cancel(uint64_t ticket) {
  std::lock_guard<std::mutex> lk(mutex_);
  auto it = slots_.find(ticket);
  if (it == slots_.end() || it->second.detached) return false;
  if (it->second.state == State::Queued) {
    queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
    slots_.erase(it);
    return true;
  }
  if (it->second.state == State::Done) slots_.erase(it);
  return false;
}

size_t WorkQueue::pending() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return queue_.size();
}

}  // namespace pyloader
