// Overflow-checked unsigned arithmetic: every size computed from file
// contents goes through these, so a hostile header cannot wrap a length.
#pragma once

#include <cstdint>
#include <optional>

namespace pyloader {

inline std::optional<uint64_t> checked_add(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace pyloader
