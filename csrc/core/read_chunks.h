// Bulk positional reads of many (file, offset, destination, length) chunks,
// by a thread pool or by io_uring.
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/file.h"
#include "core/thread_pool.h"

namespace pyloader {

// Who performs bulk reads: a thread pool doing pread, or one io_uring ring.
enum class ReadBackend { Threads, IoUring };

// The worker threads a reader's pool needs beside the calling thread (0 for
// io_uring, which uses none).
size_t pool_threads(ReadBackend backend, size_t requested);

struct ReadChunk {
  const File* file;
  uint64_t offset;
  uint8_t* dst;
  size_t len;
};

// Maps the whole pages of [dst, dst + len) for writing in one call.
void prefault_for_write(uint8_t* dst, size_t len);

// Reads every chunk with read_exact on the pool's threads (destinations
// prefaulted first). When `stop` becomes true, chunks not yet started are
// skipped and Interrupted is thrown (within one chunk per thread).
void read_chunks_threaded(ThreadPool& pool, const std::vector<ReadChunk>& chunks,
                          const std::atomic<bool>* stop = nullptr);

// True when this build has io_uring support and the kernel lets this
// process create a ring (containers may forbid it).
bool uring_available();

// True when this build was compiled with liburing (whatever the kernel or
// PYLOADER_PORTABLE_IO say now): tells "not built in" from "refused here".
bool uring_built();

// One io_uring instance (the resource), reused across calls.
class UringReader {
 public:
  // Throws UnsupportedError when built without liburing, IoError when the
  // kernel refuses the ring.
  explicit UringReader(unsigned queue_depth = 64);
  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;
  ~UringReader();

  // Reads every chunk exactly: short reads are resubmitted for the rest,
  // 0 bytes is "unexpected end of file", errors throw IoError naming the
  // file, offset and errno (after draining what is in flight).
  void read(const std::vector<ReadChunk>& chunks);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pyloader
