// Arrays handed out while their bytes are still being read: the overlapped
// load (PreadReader::load_overlapped).
//
// An OverlappedRead allocates every tensor's buffer (place_tensor_read), then
// reads all of them in file order on its own threads, starting at once. Each
// array it hands out carries an AwaitRead primitive: evaluating the array
// waits for that tensor's last chunk (not the whole load) and then gives the
// array the buffer the reads filled, without a copy (mx.load's Load primitive
// is the model: a primitive with no inputs whose evaluation makes the bytes
// available). A failed read is kept per tensor and thrown by the evaluation of
// that tensor's array, the IoError an eager read gives; no array ever sees
// bytes that were not read.
//
// Lifetime: every AwaitRead holds the OverlappedRead (shared_ptr), which owns
// its descriptors, threads and buffers, so the arrays outlive the reader that
// made them. Once the last unevaluated array is gone, the destructor stops the
// reads not yet started (within one chunk per thread) and joins the threads;
// the buffers are freed with the last array that uses one.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/file.h"
#include "core/safetensors_index.h"
#include "core/thread_pool.h"
#include "mlx/allocator.h"
#include "mlx/primitives.h"
#include "mlxio/tensor_arrays.h"

namespace pyloader {

// Stats shared between a reader and the overlapped loads it started (which
// may outlive it).
struct SharedStats {
  std::mutex mutex;
  ReaderStats stats;
};

class OverlappedRead {
 public:
  // Opens its own descriptors for the files of `wanted` (checked against the
  // identity the index recorded), allocates every buffer (AllocationError /
  // bad_alloc before any read) and starts reading. `threads` readers (0: one
  // per core), reads of at most `chunk_bytes`; `direct`: cold tensors read
  // with direct I/O (mlxio/tensor_reads.h).
  OverlappedRead(std::shared_ptr<const TensorIndex> index,
                 std::vector<const TensorInfo*> wanted, size_t threads, size_t chunk_bytes,
                 bool direct, std::shared_ptr<SharedStats> stats);
  OverlappedRead(const OverlappedRead&) = delete;
  OverlappedRead& operator=(const OverlappedRead&) = delete;
  ~OverlappedRead();

  // The arrays, in the order of `wanted`; each waits for its own reads when
  // evaluated. `self` is this object (the arrays keep it alive).
  static NamedArrays arrays(const std::shared_ptr<OverlappedRead>& self);

  // Blocks until tensor `k` is read, then returns its buffer and the
  // tensor's offset in it, or throws the error its read ended with.
  std::pair<std::shared_ptr<mlx::core::allocator::Data>, size_t> wait(size_t k);

 private:
  void run();  // the driver thread: every chunk, in file order, on pool_
  // Records the end of tensor `k`'s last chunk (error: the first failure).
  void finish(size_t k, std::exception_ptr error);

  struct Tensor {
    const TensorInfo* info;
    mlx::core::Shape shape;
    mlx::core::Dtype dtype = mlx::core::uint8;
    std::shared_ptr<mlx::core::allocator::Data> buffer;
    size_t offset = 0;  // of the tensor's first byte in buffer
    std::atomic<size_t> chunks_left{0};
    // The first failure among its chunks (under error_mutex while they run;
    // final, and read under mutex_, once done).
    std::exception_ptr error;
    std::mutex error_mutex;
    bool done = false;  // under mutex_
  };
  struct Chunk {
    size_t tensor;
    const File* file;
    uint64_t offset;
    uint8_t* dst;
    size_t len;
  };

  std::shared_ptr<const TensorIndex> index_;
  std::vector<std::unique_ptr<File>> files_;  // by file id; null for files not read
  std::vector<std::unique_ptr<File>> direct_files_;  // by file id; null: none
  std::vector<std::unique_ptr<Tensor>> tensors_;
  std::vector<Chunk> chunks_;  // in file order
  std::shared_ptr<SharedStats> stats_;
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  std::atomic<bool> stop_{false};
  ThreadPool pool_;
  std::thread driver_;  // last member: started once everything above exists
};

// The primitive of an overlapped array: its evaluation waits for the tensor's
// reads and makes the filled buffer the array's data. CPU and GPU evaluate
// alike (the buffer comes from allocator::malloc, which the host can write on
// every backend: MLX's CPU heap, Metal's unified memory, CUDA's managed memory).
class AwaitRead : public mlx::core::UnaryPrimitive {
 public:
  AwaitRead(mlx::core::Stream stream, std::shared_ptr<OverlappedRead> reads, size_t tensor)
      : UnaryPrimitive(stream), reads_(std::move(reads)), tensor_(tensor) {}

  void eval_cpu(const std::vector<mlx::core::array>& inputs, mlx::core::array& out) override;
  void eval_gpu(const std::vector<mlx::core::array>& inputs, mlx::core::array& out) override;
  const char* name() const override { return "AwaitRead"; }

 private:
  void take(mlx::core::array& out);

  std::shared_ptr<OverlappedRead> reads_;
  size_t tensor_;
};

}  // namespace pyloader
