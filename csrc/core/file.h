// RAII read-only file descriptor with exact positional reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyloader {

// Page-cache hints for a byte range of a file or a mapping.
enum class Advice {
  Normal,      // undo an earlier hint
  Sequential,  // aggressive readahead
  Random,      // no readahead
  WillNeed,    // start reading the range in now (asynchronous)
  Populate,    // mapping: read the range in and map it now (synchronous; no later faults)
  DontNeed,    // mapping: drop the range's pages from this process (RSS)
  Evict,       // file: drop the range's clean pages from the page cache
};

Advice advice_from_string(const std::string& name);  // throws invalid_argument
const char* advice_name(Advice advice);               // and back (a string literal)

// What identifies one version of a file: a rewrite in place changes the
// size or the modification time, a replacement (rename over it) the inode.
struct FileIdentity {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileIdentity& o) const {
    return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns;
  }
  bool operator!=(const FileIdentity& o) const { return !(*this == o); }
};

// The alignment O_DIRECT reads use here: the page, a multiple of every
// logical block size Linux devices have.
inline constexpr uint64_t kDirectAlign = 4096;

class File {
 public:
  // Opens `path` read-only. A missing file throws IoError with ENOENT.
  // `direct`: O_DIRECT (reads bypass the page cache; offsets, lengths and
  // destinations must be multiples of kDirectAlign); a file system that
  // refuses it throws IoError (EINVAL).
  static File open_read(const std::string& path, bool direct = false);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const { return fd_; }
  bool direct() const { return direct_; }  // opened with O_DIRECT
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads exactly `n` bytes at `offset`: loops on EINTR and short reads;
  // end of file before `n` bytes throws IoError ("unexpected end of file").
  void read_exact(void* dst, size_t n, uint64_t offset) const;

  // Throws the IoError an armed read fault (set_read_fault) covering
  // [offset, offset + n) gives; read_exact checks it, and so do reads that do
  // not go through it (mmap's populate).
  void check_read_fault(uint64_t offset, size_t n) const;
  // fstat of the open descriptor now.
  FileIdentity identity() const;

  // Throws IoError(ESTALE) naming what changed when the open file, or the
  // file now at its path, is no longer `expected` (the version whose header
  // was read): truncated, extended, rewritten or replaced. Call it before
  // touching a region of the file (and after reading it), so that a changed
  // checkpoint gives an error instead of a SIGBUS or wrong bytes.
  void check_unchanged(const FileIdentity& expected) const;

  // posix_fadvise on [offset, offset + len); len 0 means "to the end".
  // Advisory: returns false (and does not throw) when the kernel refuses.
  bool advise(uint64_t offset, uint64_t len, Advice advice) const;

 private:
  File(int fd, uint64_t size, std::string path, bool direct)
      : fd_(fd), size_(size), path_(std::move(path)), direct_(direct) {}
  int fd_ = -1;
  uint64_t size_ = 0;
  std::string path_;
  bool direct_ = false;
};

// Drops the clean page-cache pages of a whole file (posix_fadvise
// DONTNEED): how benchmarks get a cold start without root.
void evict_file_from_page_cache(const std::string& path);

// Test hook (fault injection): File::read_exact fails with `err` whenever a
// read of `path` covers byte `offset`. Costs one relaxed atomic load per read
// when nothing is armed.
void set_read_fault(const std::string& path, uint64_t offset, int err);
void clear_read_faults();

}  // namespace pyloader
