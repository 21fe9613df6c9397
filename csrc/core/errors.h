// Error types of the pyloader core. The core knows nothing of Python: the
// bindings map each class here to one Python exception type.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyloader {

// A tensor name as it appears in messages: control characters (NUL above
// all, which would cut a C-string message short) are written as \xNN.
std::string printable_name(const std::string& name);

// A file that breaks a rule of the safetensors format (or of a model
// directory's index). The message names the file, the tensor when there is
// one, and the rule.
class FormatError : public std::runtime_error {
 public:
  // A rule of the file as a whole.
  FormatError(const std::string& file, const std::string& rule);
  // A rule of one tensor's entry (the name may be any string, even empty).
  FormatError(const std::string& file, const std::string& tensor,
              const std::string& rule);
  const std::string& file() const { return file_; }
  const std::string& tensor() const { return tensor_; }
  bool has_tensor() const { return has_tensor_; }
  const std::string& rule() const { return rule_; }

 private:
  std::string file_, tensor_, rule_;
  bool has_tensor_;
};

// A valid file that asks for something this build cannot represent (a dtype
// MLX has no type for, a dimension beyond MLX's int32 shapes).
class UnsupportedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bulk read stopped early because its caller asked it to (Ctrl-C).
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Memory that could not be reserved or committed (the KV arena, an expert
// bank): maps to MemoryError.
class AllocationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A computation evaluated a stand-in: a streamed parameter read while its
// unit's bytes were not in memory (mlxio/stand_in.h). The message names the
// parameter and a setting that serves the model.
class StandInRead : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A tensor name the checkpoint does not have.
class TensorNotFound : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// A failed system call on a file: carries the path, the byte offset (or -1
// when the call had none) and errno.
class IoError : public std::runtime_error {
 public:
  IoError(const std::string& op, const std::string& path, int err,
          int64_t offset = -1);
  const std::string& path() const { return path_; }
  int err() const { return err_; }
  int64_t offset() const { return offset_; }
  const std::string& detail() const { return detail_; }

 private:
  std::string path_;
  int err_;
  int64_t offset_;
  std::string detail_;  // "op failed: strerror [at offset N]"
};

}  // namespace pyloader
