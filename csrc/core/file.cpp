#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/platform.h"

namespace pyloader {

Advice advice_from_string(const std::string& name) {
  if (name == "normal") return Advice::Normal;
  if (name == "sequential") return Advice::Sequential;
  if (name == "random") return Advice::Random;
  if (name == "willneed") return Advice::WillNeed;
  if (name == "populate") return Advice::Populate;
  if (name == "dontneed") return Advice::DontNeed;
  if (name == "evict") return Advice::Evict;
  throw std::invalid_argument(
      "unknown advice '" + name +
      "' (expected normal, sequential, random, willneed, populate, dontneed or evict)");
}

const char* advice_name(Advice advice) {
  switch (advice) {
    case Advice::Normal: return "normal";
    case Advice::Sequential: return "sequential";
    case Advice::Random: return "random";
    case Advice::WillNeed: return "willneed";
    case Advice::Populate: return "populate";
    case Advice::DontNeed: return "dontneed";
    case Advice::Evict: return "evict";
  }
  return "unknown";
}

namespace {

FileIdentity identity_of(const struct stat& st) {
  FileIdentity id;
  id.dev = static_cast<uint64_t>(st.st_dev);
  id.ino = static_cast<uint64_t>(st.st_ino);
  id.size = static_cast<uint64_t>(st.st_size);
  id.nlink = static_cast<uint64_t>(st.st_nlink);
  id.mtime_ns = mtime_ns(st);
  id.ctime_ns = ctime_ns(st);
  return id;
}

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The IoError for a path that is not a regular file, saying what it is.
[[noreturn]] void throw_not_regular(const std::string& op, const std::string& path) {
  PathKind kind = describe_path(path);
  if (kind.what == "no such file or directory") throw IoError(op, path, ENOENT);
  if (kind.err == ENOENT) throw IoError(op + " (" + kind.what + ")", path, ENOENT);
  throw IoError(op + " (" + kind.what + ", not a regular file: a checkpoint's files must be "
                "regular files)", path, kind.err ? kind.err : EINVAL);
}

std::atomic<uint64_t> g_pread_calls{0};

struct ReadFault {
  std::string path;
  uint64_t offset;
  int err;
};
std::atomic<bool> g_faults_armed{false};
std::mutex g_faults_mutex;
std::vector<ReadFault> g_faults;

}  // namespace

PathKind describe_path(const std::string& path) {
  if (path.find('\0') != std::string::npos) return {"a name containing a NUL byte", EINVAL};
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISREG(st.st_mode)) return {"a regular file", 0};
    return {file_kind(st.st_mode), S_ISDIR(st.st_mode) ? EISDIR : EINVAL};
  }
  int err = errno;
  if (err == ELOOP) return {"a symbolic link loop", err};
  if (err == ENOTDIR) return {"unreachable: a component of the path is not a directory", err};
  if (err == ENOENT) {
    std::string target(4096, '\0');
    ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
    if (n < 0) return {"no such file or directory", err};
    target.resize(static_cast<size_t>(n));
    return {"a symbolic link to '" + target + "', which does not exist", err};
  }
  return {std::strerror(err), err};
}

FileIdentity regular_file_identity(const std::string& path) {
  struct stat st;
  if (path.find('\0') != std::string::npos || ::stat(path.c_str(), &st) != 0 ||
      !S_ISREG(st.st_mode))
    throw_not_regular("open", path);
  return identity_of(st);
}

void set_read_fault(const std::string& path, uint64_t offset, int err) {
  std::lock_guard<std::mutex> lk(g_faults_mutex);
  g_faults.push_back({path, offset, err});
  g_faults_armed.store(true, std::memory_order_release);
}

void clear_read_faults() {
  std::lock_guard<std::mutex> lk(g_faults_mutex);
  g_faults.clear();
  g_faults_armed.store(false, std::memory_order_release);
}

FileIdentity File::identity() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw IoError("fstat", path_, errno);
  return identity_of(st);
}

std::string describe_change(const FileIdentity& expected, const FileIdentity& now) {
  if (now.size < expected.size)
    return "truncated from " + std::to_string(expected.size) + " to " +
           std::to_string(now.size) + " bytes";
  if (now.size != expected.size)
    return "grown from " + std::to_string(expected.size) + " to " + std::to_string(now.size) +
           " bytes";
  if (now.dev != expected.dev || now.ino != expected.ino) return "replaced by another file";
  if (now.mtime_ns != expected.mtime_ns) return "rewritten (modification time changed)";
  // A deleted file (no links left) keeps its bytes behind our descriptors: its
  // unlink moved ctime, and that alone is not a change. Any other ctime move is,
  // a new hard link included (a link made after a rewrite would otherwise hide it).
  if (now.ctime_ns != expected.ctime_ns && now.nlink != 0)
    return "rewritten in place or its metadata changed (status-change time changed, "
           "modification time kept)";
  return "";
}

void File::check_unchanged(const FileIdentity& expected) const {
  std::string what = describe_change(expected, identity());
  if (what.empty()) {
    // The descriptor's file is intact; has the path been pointed elsewhere
    // (a new version renamed over it)? A path that is gone is fine: nothing
    // can change the file through it, and the descriptor still reads it.
    struct stat st;
    if (::stat(path_.c_str(), &st) != 0) {
      if (errno != ENOENT) throw IoError("stat", path_, errno);
    } else if (FileIdentity at_path = identity_of(st);
               at_path.dev != expected.dev || at_path.ino != expected.ino) {
      what = "replaced by another file";
    }
  }
  if (!what.empty())
    throw IoError("checkpoint check (the file changed on disk since its header was read: " +
                      what + "; a model streamed or mapped from it reads it for as long as "
                             "it lives, so keep its files unchanged on disk; reload the model)",
                  path_, ESTALE);
}

File File::open_read(const std::string& path, bool direct) {
  // O_NONBLOCK: opening a FIFO for reading waits for a writer, and a device's
  // open may wait too; the check below refuses them, so the open must return.
  // A NUL would cut the name the kernel sees: another file would be opened.
  if (path.find('\0') != std::string::npos) throw_not_regular("open", path);
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    if (errno == ENOENT || errno == ELOOP || errno == ENOTDIR) throw_not_regular("open", path);
    throw IoError("open", path, errno);
  }
  File file(fd, 0, path, false);  // closes the descriptor on every error below
  struct stat st;
  if (::fstat(fd, &st) != 0) throw IoError("fstat", path, errno);
  if (!S_ISREG(st.st_mode)) throw_not_regular("open", path);
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    throw IoError("fcntl(F_SETFL)", path, errno);
  if (direct) {
    if (int err = enable_direct_reads(fd))
      throw IoError("open (reads bypassing the page cache)", path, err);
  }
  file.size_ = static_cast<uint64_t>(st.st_size);
  file.direct_ = direct;
  return file;
}

File File::duplicate() const {
  int fd = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw IoError("dup", path_, errno);
  return File(fd, size_, path_, direct_);
}

uint64_t pread_calls() { return g_pread_calls.load(std::memory_order_relaxed); }

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      size_(other.size_),
      path_(std::move(other.path_)),
      direct_(other.direct_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    path_ = std::move(other.path_);
    direct_ = other.direct_;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::check_read_fault(uint64_t offset, size_t n) const {
  if (!g_faults_armed.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lk(g_faults_mutex);
  for (const ReadFault& f : g_faults)
    if (f.path == path_ && f.offset >= offset && f.offset - offset < n)
      throw IoError("pread (injected fault)", path_, f.err, static_cast<int64_t>(f.offset));
}

void File::read_exact(void* dst, size_t n, uint64_t offset) const {
  check_read_fault(offset, n);
  auto* out = static_cast<char*>(dst);
  // XNU's pread refuses more than INT_MAX bytes (EINVAL) where Linux returns
  // a short read: ask for at most the cap (whole kDirectAlign blocks when
  // direct, so every call stays aligned).
  size_t cap = static_cast<size_t>(platform().pread_cap);
  if (direct_) cap = std::max<size_t>(cap / kDirectAlign * kDirectAlign, kDirectAlign);
  while (n > 0) {
    g_pread_calls.fetch_add(1, std::memory_order_relaxed);
    ssize_t got = ::pread(fd_, out, std::min(n, cap), static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw IoError("pread", path_, errno, static_cast<int64_t>(offset));
    }
    if (got == 0)
      throw IoError("pread (unexpected end of file: was it truncated while open?)",
                    path_, EIO, static_cast<int64_t>(offset));
    out += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

bool File::advise(uint64_t offset, uint64_t len, Advice advice) const {
  return advise_file(fd_, offset, len, advice);
}

void evict_file_from_page_cache(const std::string& path) {
  File f = File::open_read(path);
  if (int err = sync_file_data(f.fd()); err != 0 && err != EINVAL && err != EROFS)
    throw IoError("fdatasync", path, err);
  if (!f.advise(0, 0, Advice::Evict)) throw IoError("page-cache eviction", path, errno);
}

uint64_t File::cached_bytes(uint64_t offset, uint64_t len) const {
  uint64_t bytes = 0;
  if (!cached_bytes_of_range(fd_, offset, len, &bytes)) throw IoError("mincore", path_, errno);
  return bytes;
}

}  // namespace pyloader
