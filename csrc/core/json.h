// A small strict JSON reader for safetensors headers and index files.
// Strict where the format needs it: input must be valid UTF-8, duplicate
// object keys are rejected, nesting is bounded, and integers are kept exact
// (a safetensors offset can exceed 2^53, so doubles would silently round).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pyloader::json {

class ParseError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  // Numbers: the literal text; `is_uint` when it is a plain non-negative
  // integer (no sign, fraction or exponent) that fits in uint64 (`uint`).
  std::string text;
  bool is_uint = false;
  uint64_t uint = 0;
  std::vector<Value> items;                            // Array
  std::vector<std::pair<std::string, Value>> members;  // Object, in order

  const Value* find(std::string_view key) const;
  const char* kind_name() const;
};

// Parses one JSON value; leading and trailing whitespace is accepted,
// anything else after the value is an error.
Value parse(std::string_view input, int max_depth = 64);

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or > U+10FFFF).
bool valid_utf8(std::string_view s);

}  // namespace pyloader::json
