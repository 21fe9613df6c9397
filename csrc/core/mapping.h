// RAII read-only view of a whole file through mmap.
#pragma once

#include <cstdint>
#include <string>

#include "core/file.h"

namespace pyloader {

class Mapping {
 public:
  // Maps all of `file`. The descriptor is not kept: the mapping stays valid
  // after the File is closed. The mapping is private and writable so that a
  // consumer which writes through an exported buffer gets copy-on-write pages
  // instead of a crash; the file itself is never modified.
  explicit Mapping(const File& file);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  uint8_t* mutable_data() const { return static_cast<uint8_t*>(addr_); }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // madvise on the pages covering [offset, offset + len) of the file.
  // Read-ahead hints round outward to whole pages; DontNeed rounds inward so
  // that it never drops a page shared with bytes outside the range. Evict is
  // not a mapping operation (see File::advise) and returns false.
  // Advisory: returns false when the kernel refuses.
  bool advise(uint64_t offset, uint64_t len, Advice advice) const;

  // Number of this mapping's pages in [offset, offset + len) resident in
  // memory (mincore).
  uint64_t resident_bytes(uint64_t offset, uint64_t len) const;

 private:
  void* addr_ = nullptr;
  uint64_t size_ = 0;
  int guard_slot_ = -1;  // sigbus_guard registration
  std::string path_;
};

uint64_t page_size();

// Bytes of the file at `path` in the page cache (mincore over a fresh mapping,
// which maps nothing in; whole pages, at most the file's size).
uint64_t cached_bytes_of_file(const std::string& path);

}  // namespace pyloader
