// Shared pieces of the readers that produce mlx::core::array objects.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors_index.h"
#include "mlx/array.h"

namespace pyloader {

// What one load did, per reader.
struct ReaderStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  uint64_t zero_copy_tensors = 0;
  uint64_t zero_copy_bytes = 0;
  uint64_t copied_tensors = 0;   // misaligned (or unverified) tensors copied
  uint64_t copied_bytes = 0;
  uint64_t bytes_read = 0;       // bytes moved by pread / memcpy
  uint64_t populate_bytes = 0;   // mmap: bytes read in by populate (prefetch/advise)
  uint64_t buffer_reuses = 0;    // pread: reads served into a reused ring slot
  uint64_t buffer_misses = 0;    // pread: reads that took fresh buffers beside a ring
  uint64_t direct_bytes = 0;     // pread: bytes read with O_DIRECT (no page cache)
  uint64_t failed_tensors = 0;   // pread overlapped: tensors whose read failed
  bool zero_copy_verified = true;  // false once MLX refused a view
  // mmap: how mapped bytes become arrays (zero_copy_name: header,
  // make_buffer or copy); empty for readers that read into fresh memory.
  const char* zero_copy_mode = "";
};

using NamedArrays = std::vector<std::pair<std::string, mlx::core::array>>;

// The MLX dtype a safetensors dtype loads as (F8 types load as raw uint8,
// as mx.load does). Throws UnsupportedError for sub-byte types.
mlx::core::Dtype to_mlx_dtype(const TensorInfo& t, const std::string& file);
// The MLX shape; throws UnsupportedError for a dimension over int32.
mlx::core::Shape to_mlx_shape(const TensorInfo& t, const std::string& file);

}  // namespace pyloader
