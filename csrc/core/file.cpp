#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/errors.h"

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
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return id;
}

struct ReadFault {
  std::string path;
  uint64_t offset;
  int err;
};
std::atomic<bool> g_faults_armed{false};
std::mutex g_faults_mutex;
std::vector<ReadFault> g_faults;

}  // namespace

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

void File::check_unchanged(const FileIdentity& expected) const {
  FileIdentity now = identity();
  std::string what;
  if (now.size < expected.size) {
    what = "truncated from " + std::to_string(expected.size) + " to " +
           std::to_string(now.size) + " bytes";
  } else if (now.size != expected.size) {
    what = "grown from " + std::to_string(expected.size) + " to " + std::to_string(now.size) +
           " bytes";
  } else if (now.dev != expected.dev || now.ino != expected.ino) {
    what = "replaced by another file";
  } else if (now.mtime_ns != expected.mtime_ns) {
    what = "rewritten (modification time changed)";
  } else {
    // The descriptor's file is intact; has the path been pointed elsewhere
    // (a new version renamed over it)? A path that is gone is fine: nothing
    // can change the file through it, and the descriptor still reads it.
    struct stat st;
    if (::stat(path_.c_str(), &st) != 0) {
      if (errno != ENOENT) throw IoError("stat", path_, errno);
    } else if (identity_of(st) != expected) {
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
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw IoError("open", path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw IoError("fstat", path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError("open (not a regular file)", path, S_ISDIR(st.st_mode) ? EISDIR : EINVAL);
  }
  return File(fd, static_cast<uint64_t>(st.st_size), path, direct);
}

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
  while (n > 0) {
    ssize_t got = ::pread(fd_, out, n, static_cast<off_t>(offset));
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
  int a;
  switch (advice) {
    case Advice::Normal: a = POSIX_FADV_NORMAL; break;
    case Advice::Sequential: a = POSIX_FADV_SEQUENTIAL; break;
    case Advice::Random: a = POSIX_FADV_RANDOM; break;
    case Advice::WillNeed:
    case Advice::Populate: a = POSIX_FADV_WILLNEED; break;
    case Advice::DontNeed:
    case Advice::Evict: a = POSIX_FADV_DONTNEED; break;
    default: return false;
  }
  // The kernel itself rounds DONTNEED inward to whole pages, so partial
  // pages shared with neighbouring tensors are never dropped.
  return ::posix_fadvise(fd_, static_cast<off_t>(offset),
                         static_cast<off_t>(len), a) == 0;
}

void evict_file_from_page_cache(const std::string& path) {
  File f = File::open_read(path);
  if (::fdatasync(f.fd()) != 0 && errno != EINVAL && errno != EROFS)
    throw IoError("fdatasync", path, errno);
  if (!f.advise(0, 0, Advice::Evict))
    throw IoError("posix_fadvise(DONTNEED)", path, errno);
}

}  // namespace pyloader
