// Parallel positional reads into fresh MLX-owned buffers, synchronous or
// queued on a background worker (the prefetcher's read backend).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/read_chunks.h"
#include "core/safetensors_index.h"
#include "core/thread_pool.h"
#include "core/trace_buffer.h"
#include "core/work_queue.h"
#include "mlxio/tensor_arrays.h"

namespace pyloader {

// The largest single read of a bulk load. Measured on this project's 2-core VM
// (bench/pread_sweep.py, docs/benchmarks.md): a cold whole-checkpoint load with
// 2 MiB reads runs 1.03-1.17x mx.load's speed, with 16 MiB 0.86-0.88x; warm the
// two are within 8% of each other.
inline constexpr size_t kDefaultPreadChunk = 2ull << 20;

struct PreadOptions {
  size_t threads = 0;                       // 0: one per core
  size_t chunk_bytes = kDefaultPreadChunk;  // largest single read (0: the default)
  ReadBackend backend = ReadBackend::Threads;
  // false: read exactly the requested ranges (POSIX_FADV_RANDOM: no readahead
  // into neighbouring tensors), for streaming a few tensors at a time.
  bool readahead = true;
  // true: drop the ranges from the page cache once read (the arrays hold the
  // only copy the process needs).
  bool drop_cache = false;
};

class PreadReader {
 public:
  PreadReader(std::shared_ptr<const TensorIndex> index, PreadOptions options = {});
  PreadReader(const PreadReader&) = delete;
  PreadReader& operator=(const PreadReader&) = delete;
  ~PreadReader();

  // Reads the named tensors. Blocking; meant to be called without the GIL.
  // Every array is fully read when it returns.
  // `stop` (optional): set it from another thread to abandon the read
  // (Interrupted is thrown; the arrays are freed).
  NamedArrays load(const std::vector<std::string>& names,
                   const std::atomic<bool>* stop = nullptr);
  NamedArrays load_all(const std::atomic<bool>* stop = nullptr);

  // Queues a read of the named tensors on the background worker and returns
  // a ticket; take() waits for it and hands over the arrays (rethrowing the
  // read's error). cancel() drops a read that has not started.
  uint64_t submit(const std::vector<std::string>& names);
  NamedArrays take(uint64_t ticket);
  bool ready(uint64_t ticket) const;
  bool cancel(uint64_t ticket);

  ReaderStats stats() const;
  size_t threads() const { return pool_.size() + 1; }
  ReadBackend backend() const { return options_.backend; }

  // Every read while enabled (the streaming timeline): one "read" span (ticket
  // 0 when synchronous) and, with drop_cache, one "evict" span after it.
  TraceBuffer& trace() { return trace_; }

 private:
  std::vector<const TensorInfo*> lookup(const std::vector<std::string>& names) const;
  // `ticket`: the background request it serves (0: synchronous), for the trace.
  NamedArrays read(const std::vector<const TensorInfo*>& wanted,
                   const std::atomic<bool>* stop = nullptr, uint64_t ticket = 0);

  std::shared_ptr<const TensorIndex> index_;
  PreadOptions options_;
  std::vector<std::unique_ptr<File>> files_;  // one per checkpoint file, opened at construction
  ThreadPool pool_;
  std::unique_ptr<UringReader> uring_;
  std::mutex io_mutex_;  // one bulk read at a time (pool and ring are shared)
  mutable std::mutex stats_mutex_;
  ReaderStats stats_;
  mutable std::mutex results_mutex_;
  std::unordered_map<uint64_t, NamedArrays> results_;
  TraceBuffer trace_;  // recorded into by the worker too
  std::unique_ptr<WorkQueue> queue_;  // background reads; joined first on destruction
};

}  // namespace pyloader
