// RAII private view of a whole file through mmap.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/file.h"
#include "core/platform.h"

namespace pyloader {

class Mapping {
 public:
  // Maps all of `file`, private. The mapping stays valid after the File is
  // closed. It keeps a descriptor of its own (a duplicate) only where pages
  // are released by mapping the file over them again
  // (platform().drop_by_remap); a release maps them with the same protection.
  // `writable`: for memory a consumer may write through (a CPU array exported
  // to NumPy gets copy-on-write pages instead of a crash; the file itself is
  // never modified); read-only where nothing writes, so that no one (a GPU
  // buffer wrapping the pages) can.
  Mapping(const File& file, bool writable);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  uint8_t* mutable_data() const { return static_cast<uint8_t*>(addr_); }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool writable() const { return writable_; }

  // Hints on the pages (page_size()) covering [offset, offset + len) of the
  // file. Read-ahead hints and Populate round outward to whole pages; DontNeed
  // (release_mapped: the pages leave RSS, private copies are discarded) rounds
  // inward so that it never drops a page shared with bytes outside the range.
  // Evict is not a mapping operation (see File::advise) and returns false.
  // Advisory: returns false when the kernel refuses.
  bool advise(uint64_t offset, uint64_t len, Advice advice) const;

  // Bytes of this mapping's pages in [offset, offset + len) (rounded out to
  // page_size()) resident in memory (mincore).
  uint64_t resident_bytes(uint64_t offset, uint64_t len) const;

 private:
  void* addr_ = nullptr;
  uint64_t size_ = 0;
  bool writable_;
  int guard_slot_ = -1;  // sigbus_guard registration
  std::string path_;
  std::optional<File> remap_source_;  // the file to map again over released pages
};

// Bytes of the file at `path` in the page cache (File::cached_bytes: mincore
// over a temporary mapping, which maps nothing in; whole pages, at most the
// file's size).
uint64_t cached_bytes_of_file(const std::string& path);

}  // namespace pyloader
