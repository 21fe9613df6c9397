#include "core/errors.h"

#include <cstring>

namespace pyloader {

std::string printable_name(const std::string& name) {
  std::string out;
  out.reserve(name.size());
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) {
      static const char kHex[] = "0123456789ABCDEF";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

namespace {

std::string format_message(const std::string& file, const std::string* tensor,
                           const std::string& rule) {
  std::string msg = file;
  if (tensor) msg += ": tensor '" + printable_name(*tensor) + "'";
  msg += ": " + rule;
  return msg;
}

std::string io_detail(const std::string& op, int err, int64_t offset) {
  std::string d = op + " failed: " + std::strerror(err);
  if (offset >= 0) d += " (at offset " + std::to_string(offset) + ")";
  return d;
}

}  // namespace

FormatError::FormatError(const std::string& file, const std::string& rule)
    : std::runtime_error(format_message(file, nullptr, rule)),
      file_(file),
      rule_(rule),
      has_tensor_(false) {}

FormatError::FormatError(const std::string& file, const std::string& tensor,
                         const std::string& rule)
    : std::runtime_error(format_message(file, &tensor, rule)),
      file_(file),
      tensor_(tensor),
      rule_(rule),
      has_tensor_(true) {}

IoError::IoError(const std::string& op, const std::string& path, int err,
                 int64_t offset)
    : std::runtime_error(path + ": " + io_detail(op, err, offset)),
      path_(path),
      err_(err),
      offset_(offset),
      detail_(io_detail(op, err, offset)) {}

}  // namespace pyloader
