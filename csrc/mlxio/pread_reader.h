// Parallel positional reads into fresh MLX-owned buffers, synchronous or
// queued on a background worker (the prefetcher's read backend).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/read_chunks.h"
#include "core/safetensors_index.h"
#include "core/thread_pool.h"
#include "core/trace_buffer.h"
#include "core/work_queue.h"
#include "mlxio/buffer_ring.h"
#include "mlxio/overlapped_read.h"
#include "mlxio/tensor_arrays.h"

namespace pyloader {

// The largest single read of a bulk load: the fastest cold size in
// bench/pread_sweep.py (larger reads lose cold, and warm loads do not care).
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
  // true: a cold tensor of at least kDirectReadMin bytes is read with direct
  // I/O into a buffer that may use huge pages (mlxio/tensor_reads.h), warm
  // ones and small ones through the page cache; false: every read through
  // the page cache (which then holds the file for the next load).
  bool direct = true;
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
  // `reuse`: into a free reserve_buffers() slot when the tensors fit one.
  NamedArrays load(const std::vector<std::string>& names,
                   const std::atomic<bool>* stop = nullptr, bool reuse = false);
  NamedArrays load_all(const std::atomic<bool>* stop = nullptr);

  // Returns at once with arrays whose bytes are still arriving: reads of
  // every named tensor (all of them for nullopt) start now, in file order,
  // on threads of their own (as many as this reader's); evaluating an array
  // waits for that tensor's reads only, and throws the IoError its read ended
  // with (mlxio/overlapped_read.h). The arrays outlive the reader. Fresh
  // buffers only (no ring); io_uring readers read with threads.
  NamedArrays load_overlapped(const std::optional<std::vector<std::string>>& names);

  // Queues a read of the named tensors on the background worker and returns
  // a ticket; take() waits for it and hands over the arrays (rethrowing the
  // read's error). cancel() drops a read that has not started.
  uint64_t submit(const std::vector<std::string>& names, bool reuse = false);
  NamedArrays take(uint64_t ticket);
  bool ready(uint64_t ticket) const;
  bool cancel(uint64_t ticket);

  // Streamed units: `slots` reusable buffers of `slot_bytes` (layout_bytes()
  // of the largest unit), committed now. A read whose tensors fit a free slot
  // (each one contiguous range) lands there instead of in fresh buffers, and
  // the slot is reused once every array made from it is gone; otherwise it
  // takes fresh buffers (counted: buffer_misses). `direct`: read into the
  // slots with O_DIRECT (no page cache filled, none to evict), where the
  // file system allows it. slots == 0 drops the ring (lent slots stay valid).
  // Throws AllocationError when the memory cannot be committed,
  // UnsupportedError when one slot exceeds the allocator's largest buffer.
  void reserve_buffers(size_t slots, size_t slot_bytes, bool direct);
  // The slot bytes the named tensors take (each on its own pages, at its
  // file offset's position within a page, so O_DIRECT can read it in place).
  uint64_t layout_bytes(const std::vector<std::string>& names) const;
  // Slots in the ring, and how many are lent out now.
  size_t buffer_slots() const;
  // The allocator buffers the ring's slots are split into (BufferRing).
  size_t ring_buffers() const;
  size_t buffers_lent() const;
  // Whether reads into the ring bypass the page cache.
  bool direct() const;

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
                   const std::atomic<bool>* stop = nullptr, uint64_t ticket = 0,
                   bool reuse = false);
  // read() into a ring slot; an empty result when it does not apply (no
  // ring, a strided tensor, too large, no free slot).
  bool read_into_slot(const std::vector<const TensorInfo*>& wanted,
                      const std::atomic<bool>* stop, uint64_t ticket, NamedArrays& out);
  // Where a read landed, for the stats: no ring asked for, a ring slot, or
  // fresh buffers beside a ring (a miss).
  enum class Into { Plain, Slot, Fresh };
  void count_read(size_t tensors, uint64_t bytes, Into into, uint64_t direct);
  // Reads chunks with the pool or io_uring (io_mutex_ held by the caller); an
  // IoError from a file that changed meanwhile becomes the ESTALE naming it.
  void read_checked(const std::vector<ReadChunk>& chunks, const std::atomic<bool>* stop,
                    const std::vector<int>& file_used);

  std::shared_ptr<const TensorIndex> index_;
  PreadOptions options_;
  std::vector<std::unique_ptr<File>> files_;  // one per checkpoint file, opened at construction
  // Direct-read descriptors, opened at construction when options.direct (null
  // where the file system has none).
  std::vector<std::unique_ptr<File>> direct_files_;
  mutable std::mutex ring_mutex_;
  std::shared_ptr<BufferRing> ring_;
  bool ring_direct_ = false;  // reads into the ring use direct_files_
  ThreadPool pool_;
  std::unique_ptr<UringReader> uring_;
  std::mutex io_mutex_;  // one bulk read at a time (pool and ring are shared)
  mutable std::mutex stats_mutex_;
  ReaderStats stats_;
  // What the overlapped loads did (they may outlive this reader).
  std::shared_ptr<SharedStats> overlapped_stats_ = std::make_shared<SharedStats>();
  mutable std::mutex results_mutex_;
  std::unordered_map<uint64_t, NamedArrays> results_;
  TraceBuffer trace_;  // recorded into by the worker too
  std::unique_ptr<WorkQueue> queue_;  // background reads; joined first on destruction
};

}  // namespace pyloader
