#include "core/thread_pool.h"

namespace pyloader {

namespace {

// Polls `ready` for up to `spin`; true when it turned true meanwhile.
template <typename Ready>
bool spin_until(std::chrono::microseconds spin, Ready&& ready) {
  if (spin.count() <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + spin;
  do {
    for (int i = 0; i < 256; i++)
      if (ready()) return true;
    std::this_thread::yield();  // lets a thread waiting for this core run
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

}  // namespace

ThreadPool::ThreadPool(size_t threads, std::chrono::microseconds spin) : spin_(spin) {
  // The caller's thread works too, so `threads` workers means threads + 1
  // runners; a pool of 0 runs everything on the caller.
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain() {
  std::unique_lock<std::mutex> lk(mutex_);
  while (next_ < n_) {
    size_t i = next_++;
    bool skip = static_cast<bool>(error_);
    lk.unlock();
    if (!skip) {
      try {
        (*job_)(i);
      } catch (...) {
        lk.lock();
        if (!error_) error_ = std::current_exception();
        lk.unlock();
      }
    }
    lk.lock();
    if (++finished_ == n_) {
      batch_done_.store(true, std::memory_order_release);
      done_.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
  size_t seen = 0;
  for (;;) {
    spin_until(spin_, [&] { return generation_seen_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lk(mutex_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void ThreadPool::run(size_t n, const std::function<void(size_t)>& job) {
  if (n == 0) return;
  std::lock_guard<std::mutex> serial(run_mutex_);
  {
    std::lock_guard<std::mutex> lk(mutex_);
    job_ = &job;
    n_ = n;
    next_ = 0;
    finished_ = 0;
    error_ = nullptr;
    ++generation_;
    batch_done_.store(false, std::memory_order_relaxed);
    generation_seen_.store(generation_, std::memory_order_release);
  }
  wake_.notify_all();
  drain();
  spin_until(spin_, [&] { return batch_done_.load(std::memory_order_acquire); });
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mutex_);
    done_.wait(lk, [&] { return finished_ == n_; });
    err = error_;
    job_ = nullptr;
    n_ = next_ = finished_ = 0;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace pyloader
