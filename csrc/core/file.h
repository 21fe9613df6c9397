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

// What identifies one version of a file: a replacement (rename over it)
// changes the inode, a rewrite in place the size, the modification time, or
// (when the writer restored the modification time) the status-change time,
// which no unprivileged call can set back.
struct FileIdentity {
  uint64_t dev = 0, ino = 0, size = 0, nlink = 0;
  int64_t mtime_ns = 0, ctime_ns = 0;
};

// What changed from `expected` to `now` that no metadata change can do
// ("truncated from ...", "grown ...", "replaced by another file"), or "" when
// it is the same inode with the same size. Whether the bytes changed when only
// the modification or status-change time moved (a touch, a chmod, a hard link,
// a deletion; or a rewrite in place) is File::check_unchanged's question.
std::string describe_change(const FileIdentity& expected, const FileIdentity& now);

// Why `path` cannot be opened as a regular file, for a message: "a directory",
// "a FIFO", "a character device", "a symbolic link loop", "a symbolic link to 'x',
// which does not exist", "no such file or directory", ... (links followed), with
// the errno that fits (EISDIR, EINVAL, ELOOP, ENOENT, ENOTDIR); {"a regular
// file", 0} for one.
struct PathKind {
  std::string what;
  int err = 0;
};
PathKind describe_path(const std::string& path);

// The identity of the file `path` names (links followed); a path that is not a
// regular file throws IoError saying what it is (describe_path).
FileIdentity regular_file_identity(const std::string& path);

// A 64-bit fingerprint of a file's bytes: the safetensors header (up to its
// first MiB) and kFingerprintBlocks blocks of 4096 bytes spread evenly over
// the file, the last block included (every block when the file is small).
// Reads through `fd` (aligned, so O_DIRECT descriptors work) and leaves the
// page cache as it found it (pages it brought in are dropped again).
inline constexpr uint64_t kFingerprintBlocks = 256;
uint64_t fingerprint_file(int fd, uint64_t size, const std::string& path);

// The alignment O_DIRECT reads use: 4096, a multiple of the logical block size
// of every device Linux has (it is the device's block, not the memory page, that
// O_DIRECT requires, so this stays 4096 under 16 KiB pages; Darwin's F_NOCACHE
// has no alignment rule).
inline constexpr uint64_t kDirectAlign = 4096;

// An opener for Python's open(): opens `path` with `flags` plus O_CLOEXEC and,
// for the open itself only, O_NONBLOCK (a FIFO's open would wait for a writer),
// and returns the descriptor. Whether it is a regular file is the caller's check.
// Python's open() stores the descriptor in its file object without running
// Python code in between, so a Ctrl-C cannot land where nothing owns it (it can
// after os.open returns). Throws IoError naming the path.
int open_for_python(const std::string& path, int flags);

class File {
 public:
  // Opens `path` read-only. Anything but a regular file (missing, a FIFO, a
  // device, a directory, a socket, a symbolic link loop or to nothing, a name
  // with a NUL byte) throws IoError saying what it is (describe_path), without
  // blocking (a FIFO's open would wait for a writer).
  // `direct`: reads bypass the page cache (enable_direct_reads: O_DIRECT, whose
  // offsets, lengths and destinations must be multiples of kDirectAlign, or
  // F_NOCACHE); a file system or platform without them throws IoError (EINVAL).
  static File open_read(const std::string& path, bool direct = false);

  // A second descriptor for the same open file (dup): the same version of the
  // file even if its path has been replaced since.
  File duplicate() const;

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const { return fd_; }
  bool direct() const { return direct_; }  // reads bypass the page cache
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads exactly `n` bytes at `offset`: loops on EINTR and short reads, at
  // most platform().pread_cap bytes per call (XNU refuses more than INT_MAX);
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
  //
  // The rule: another inode or another size is a change. The same inode and
  // size with the same modification and status-change times is the same
  // version. When either time moved (touch, chmod, chown, a hard link made or
  // removed, a rewrite in place), the file's fingerprint (fingerprint_file)
  // decides: the one taken at the first check of this version (shared by every
  // File of the process) equal to the one now is not a change, and the new
  // times are accepted; different is a rewrite.
  void check_unchanged(const FileIdentity& expected) const;

  // Cache hints on [offset, offset + len) (advise_file); len 0 means "to the
  // end". Advisory: returns false (and does not throw) when nothing was done.
  bool advise(uint64_t offset, uint64_t len, Advice advice) const;

  // Bytes of [offset, offset + len) (rounded out to kernel pages) in the page
  // cache now (cached_bytes_of_range). Throws IoError when mincore fails.
  uint64_t cached_bytes(uint64_t offset, uint64_t len) const;

 private:
  File(int fd, uint64_t size, std::string path, bool direct)
      : fd_(fd), size_(size), path_(std::move(path)), direct_(direct) {}
  int fd_ = -1;
  uint64_t size_ = 0;
  std::string path_;
  bool direct_ = false;
};

// Drops the clean page-cache pages of a whole file (posix_fadvise DONTNEED,
// or msync(MS_INVALIDATE) where there is none): how benchmarks get a cold start
// without root.
void evict_file_from_page_cache(const std::string& path);

// pread calls made by File::read_exact so far (a test hook for the per-call cap).
uint64_t pread_calls();

// Test hook (fault injection): File::read_exact fails with `err` whenever a
// read of `path` covers byte `offset`. Costs one relaxed atomic load per read
// when nothing is armed.
void set_read_fault(const std::string& path, uint64_t offset, int err);
void clear_read_faults();

}  // namespace pyloader
