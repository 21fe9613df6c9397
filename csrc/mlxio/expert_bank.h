// Expert banks: the experts of one mixture-of-experts layer that are in memory,
// in fixed slots, and the reader that fills them.
//
// A checkpoint saved by mlx-lm stores each MoE layer's experts stacked: every
// projection's weight (and scales, biases, bias) is one tensor [E, ...], so
// expert e is the byte range [offset + e * stride, + stride) of each tensor.
// An ExpertBank holds `slots` experts of every such tensor of one layer as
// MLX arrays of fixed shape [slots + 1, ...] over one preallocated, pre-faulted
// buffer (the extra slot is scratch, kept zero); ExpertReader reads experts
// into slots with positional reads, merged where consecutive experts go to
// consecutive slots, in parallel (thread pool or io_uring).
//
// The arrays are regions of one buffer of MLX's allocator (valid on every
// backend) and are written in place, through the host's view of that buffer:
// a slot may only be refilled once nothing that reads it is still to run.
// pyloader's expert hook refills the slots of a layer only after evaluating
// that layer's routing, which depends on every earlier use of the bank. On
// Metal this ordering is the only guard: MLX's buffers are
// MTLHazardTrackingModeUntracked, so neither Metal nor MLX would stop a GPU
// kernel still reading a slot from seeing the refill; evaluating the routing
// waits for those kernels to complete.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/file.h"
#include "core/read_chunks.h"
#include "core/safetensors_index.h"
#include "core/thread_pool.h"
#include "mlx/array.h"
#include "mlxio/arena_memory.h"

namespace pyloader {

// (expert, slot): bring expert `expert` into slot `slot`.
using ExpertMove = std::pair<uint32_t, uint32_t>;

class ExpertBank : public std::enable_shared_from_this<ExpertBank> {
 public:
  // `tensors`: the stacked expert tensors of one layer (same first dimension,
  // the number of experts). Throws std::invalid_argument for an empty list, a
  // tensor without an expert dimension, differing expert counts or a dtype
  // MLX cannot hold, AllocationError when the memory cannot be committed.
  static std::shared_ptr<ExpertBank> create(const TensorIndex& index,
                                            const std::vector<std::string>& tensors,
                                            uint32_t slots, bool populate = true);
  // Bytes create() allocates for tensors whose one-expert sizes are `strides`,
  // with `slots` slots (scratch slot and layout included), without allocating:
  // what a memory budget must cover.
  static uint64_t layout_bytes(const std::vector<uint64_t>& strides, uint32_t slots);
  ExpertBank(const ExpertBank&) = delete;
  ExpertBank& operator=(const ExpertBank&) = delete;

  uint32_t num_experts() const { return experts_; }
  uint32_t num_slots() const { return slots_; }  // usable slots (scratch excluded)
  size_t num_tensors() const { return tensors_.size(); }
  const std::string& tensor_name(size_t t) const { return tensors_.at(t).name; }
  uint64_t expert_bytes() const { return expert_bytes_; }  // one expert, every tensor
  uint64_t allocated_bytes() const { return memory_.size(); }
  uint32_t scratch_slot() const { return slots_; }

  // Tensor t's slots as an array [slots + 1, ...] over the bank (shares its lifetime).
  mlx::core::array array(size_t t) const;

  // The reads that perform `moves`: per tensor, one range per maximal run of
  // consecutive experts going to consecutive slots. Throws std::out_of_range
  // naming the bank's first tensor for an expert >= num_experts() or a slot
  // >= num_slots(), std::invalid_argument for a slot given twice.
  struct Span {
    uint32_t file;
    uint64_t offset;
    uint8_t* dst;
    uint64_t len;
  };
  std::vector<Span> spans(const std::vector<ExpertMove>& moves) const;

  // The checkpoint index the bank was made from (identity only: the bank keeps
  // no reference to it, so arrays freed on any thread never touch Python).
  const TensorIndex* index() const { return index_; }

 private:
  struct Tensor {
    std::string name;
    uint32_t file;
    uint64_t file_offset;  // of expert 0 in the file
    uint64_t stride;       // bytes of one expert
    size_t offset;         // of slot 0 in the buffer
    mlx::core::Shape shape;  // [slots + 1, ...]
    mlx::core::Dtype dtype;
  };
  ExpertBank(const TensorIndex* index, std::vector<Tensor> tensors, uint32_t experts,
             uint32_t slots, uint64_t expert_bytes, size_t total, bool populate);

  const TensorIndex* index_;
  std::vector<Tensor> tensors_;
  uint32_t experts_, slots_;
  uint64_t expert_bytes_;
  ArenaMemory memory_;
};

struct ExpertReaderOptions {
  size_t threads = 0;                // 0: one per core
  ReadBackend backend = ReadBackend::Threads;
  size_t chunk_bytes = 4ull << 20;   // largest single read (spreads a big expert over threads)
  bool drop_cache = false;           // evict the ranges from the page cache once read
};

// What reads did (one call, or the reader's totals).
struct ExpertReadStats {
  uint64_t calls = 0;
  uint64_t experts = 0;   // experts brought into slots
  uint64_t bytes = 0;
  uint64_t reads = 0;     // positional reads issued (after merging and chunking)
  double seconds = 0;     // wall time of the reads
};

class ExpertReader {
 public:
  ExpertReader(std::shared_ptr<const TensorIndex> index, ExpertReaderOptions options = {});
  ExpertReader(const ExpertReader&) = delete;
  ExpertReader& operator=(const ExpertReader&) = delete;

  // Reads `moves` into `bank` (blocking; meant to be called without the GIL).
  // A file truncated, rewritten or replaced since its header was read raises
  // IoError (ESTALE); a failed read IoError with path, offset and errno (the
  // slots it was writing then hold unspecified bytes).
  ExpertReadStats load(ExpertBank& bank, const std::vector<ExpertMove>& moves);

  ExpertReadStats stats() const;
  size_t threads() const { return pool_.size() + 1; }
  ReadBackend backend() const { return options_.backend; }

 private:
  const File& file(uint32_t id);

  std::shared_ptr<const TensorIndex> index_;
  ExpertReaderOptions options_;
  ThreadPool pool_;
  std::unique_ptr<UringReader> uring_;
  std::mutex io_mutex_;  // one read at a time (pool, ring and files are shared)
  std::vector<std::unique_ptr<File>> files_;  // opened on first use, kept open
  mutable std::mutex stats_mutex_;
  ExpertReadStats stats_;
};

}  // namespace pyloader
