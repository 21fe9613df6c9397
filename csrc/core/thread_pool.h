// A fixed pool of worker threads running indexed jobs. One resource: the
// threads, joined on destruction.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pyloader {

class ThreadPool {
 public:
  // `spin`: how long an idle worker (and a caller waiting for the last jobs)
  // polls before it sleeps on the condition variable. Zero for pools whose
  // batches are rare (reads); compute kernels called back to back use a few
  // hundred microseconds so a batch does not wait for a thread to wake.
  explicit ThreadPool(size_t threads, std::chrono::microseconds spin = {});
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  size_t size() const { return workers_.size(); }

  // Runs job(0) .. job(n - 1) on the workers and the calling thread and
  // returns when all are done. After the first job throws, jobs not yet
  // started are skipped and that exception is rethrown here. One batch at a
  // time: concurrent callers are serialized.
  void run(size_t n, const std::function<void(size_t)>& job);

 private:
  void worker_loop();
  void drain();  // take jobs of the current batch until none remain

  std::mutex run_mutex_;  // serializes run()
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t n_ = 0, next_ = 0, finished_ = 0;
  size_t generation_ = 0;
  // Mirrors of generation_ and finished_ == n_ that spinning threads poll
  // without the mutex.
  std::atomic<size_t> generation_seen_{0};
  std::atomic<bool> batch_done_{true};
  const std::chrono::microseconds spin_;
  std::exception_ptr error_;
  bool stop_ = false;
};

}  // namespace pyloader
