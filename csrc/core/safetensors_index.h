// The table of a checkpoint's tensors, built from safetensors headers alone:
// name -> file, dtype, shape, absolute offset, byte length, alignment.
// Every rule of the format is enforced with checked arithmetic; any
// violation throws FormatError naming the file, the tensor and the rule.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/file.h"

namespace pyloader {

enum class DType : uint8_t {
  BOOL, U8, I8, F8_E4M3, F8_E5M2, F8_E8M0, I16, U16, F16, BF16,
  I32, U32, F32, F64, I64, U64, C64, F4, F6_E2M3, F6_E3M2,
  F8_E4M3FNUZ, F8_E5M2FNUZ,  // safetensors >= 0.8
};

const char* dtype_name(DType d);
// Bits per element (4 and 6 for the sub-byte float types).
unsigned dtype_bits(DType d);
// Bytes an element's start must be aligned to for a zero-copy view
// (1 for sub-byte types).
unsigned dtype_alignment(DType d);

// One contiguous byte range of a file.
struct Extent {
  uint64_t offset = 0;  // absolute
  uint64_t len = 0;
};

struct TensorInfo {
  std::string name;
  uint32_t file = 0;         // index into TensorIndex::files()
  DType dtype = DType::U8;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;       // absolute byte offset in the file
  uint64_t nbytes = 0;
  bool aligned = true;       // offset % dtype_alignment(dtype) == 0
  // A slice (TensorIndex::with_slices) whose bytes are not one range: its
  // ranges in element order (nbytes in total, the first at offset). Empty for
  // a tensor stored as [offset, offset + nbytes).
  std::vector<Extent> extents;
};

// The byte ranges of a tensor or slice, in element order.
std::vector<Extent> extents_of(const TensorInfo& t);

// A block of a checkpoint tensor: along `axis`, the indices [start, stop) of
// each range in turn; every other axis whole. A block of rows (axis 0) is one
// byte range; a block of columns is one range per row (strided).
struct TensorSlice {
  std::string name;    // the slice's name in the new index
  std::string tensor;  // the checkpoint tensor it is cut from
  uint32_t axis = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

// A tensor's bytes in a file another format describes (TensorIndex::of_regions).
struct TensorRegion {
  std::string name;
  std::string dtype;  // a safetensors dtype name ("U8", "F32", ...)
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // absolute
  uint64_t nbytes = 0;
};

struct FileInfo {
  std::string path;
  uint64_t size = 0;
  uint64_t header_bytes = 0;  // N, the JSON header's length
  uint64_t data_start = 0;    // 8 + N
  FileIdentity identity;      // the version whose header this is
  std::vector<std::pair<std::string, std::string>> metadata;
};

class TensorIndex {
 public:
  // `path` is a .safetensors file, a directory with
  // model.safetensors.index.json and its shards, or a directory with one or
  // more *.safetensors files. A missing path throws IoError(ENOENT).
  static TensorIndex open(const std::string& path);

  // An index over byte regions of one file whose own format another reader
  // checked (a GGUF file: pyloader/io/gguf_header.py). Each region is checked
  // again against the file as opened: a known whole-byte dtype, shape x item
  // size == nbytes, inside the file, names unique. FormatError names the file,
  // the region and the rule. `data_start` is where the format's data begins.
  static TensorIndex of_regions(const std::string& path, uint64_t data_start,
                                const std::vector<TensorRegion>& regions);

  // Parses one file's header (used by open; public for tools and tests).
  static FileInfo parse_file(const std::string& path, uint32_t file_id,
                             std::vector<TensorInfo>& out);

  const std::vector<FileInfo>& files() const { return files_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // A copy of this index that also finds each slice by its name (tensors()
  // still lists the checkpoint's own tensors only). Throws
  // std::invalid_argument naming the file, the slice and its tensor for an
  // axis or range out of the tensor's bounds, no range, an empty tensor, a
  // sub-byte dtype or a name already taken; TensorNotFound for an unknown tensor.
  TensorIndex with_slices(const std::vector<TensorSlice>& slices) const;
  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& at(const std::string& name) const;  // throws out_of_range
  uint64_t total_nbytes() const { return total_nbytes_; }
  const std::string& root() const { return root_; }
  // The index file's own "metadata" object (sharded checkpoints), if any.
  const std::vector<std::pair<std::string, std::string>>& index_metadata() const {
    return index_metadata_;
  }

 private:
  void add_file(const std::string& path);
  void finish();

  std::string root_;
  std::vector<FileInfo> files_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<TensorInfo> slices_;  // with_slices(): found by name, not listed
  std::unordered_map<std::string, size_t> slice_by_name_;
  std::vector<std::pair<std::string, std::string>> index_metadata_;
  uint64_t total_nbytes_ = 0;
};

}  // namespace pyloader
