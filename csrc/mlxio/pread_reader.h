// Parallel positional reads into fresh MLX-owned buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/safetensors_index.h"
#include "core/thread_pool.h"
#include "mlxio/tensor_arrays.h"

namespace pyloader {

struct PreadOptions {
  size_t threads = 0;                // 0: one per core
  size_t chunk_bytes = 16ull << 20;  // largest single pread
};

class PreadReader {
 public:
  PreadReader(std::shared_ptr<const TensorIndex> index, PreadOptions options = {});
  PreadReader(const PreadReader&) = delete;
  PreadReader& operator=(const PreadReader&) = delete;

  // Reads the named tensors. Blocking; meant to be called without the GIL.
  // Every array is fully read when it returns.
  NamedArrays load(const std::vector<std::string>& names);
  NamedArrays load_all();

  ReaderStats stats() const;
  size_t threads() const { return pool_.size() + 1; }

 private:
  NamedArrays read(const std::vector<const TensorInfo*>& wanted);

  std::shared_ptr<const TensorIndex> index_;
  PreadOptions options_;
  ThreadPool pool_;
  mutable std::mutex stats_mutex_;
  ReaderStats stats_;
};

}  // namespace pyloader
