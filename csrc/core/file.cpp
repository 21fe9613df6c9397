#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
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
  return "";
}

namespace {

constexpr uint64_t kBlock = 4096;
constexpr uint64_t kHeaderCap = 1u << 20;  // header bytes fingerprinted at most
constexpr uint64_t kHygieneChunk = 64u << 10;

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdULL;
}

// Reads up to kBlock bytes at `offset` (a multiple of kBlock) into `buf` (kBlock
// aligned); returns the bytes read (short at the end of the file).
size_t read_block(int fd, unsigned char* buf, uint64_t offset, const std::string& path) {
  // One aligned read: a regular file returns less only at its end.
  ssize_t got;
  do {
    got = ::pread(fd, buf, kBlock, static_cast<off_t>(offset));
  } while (got < 0 && errno == EINTR);
  if (got < 0) throw IoError("pread (fingerprint)", path, errno, static_cast<int64_t>(offset));
  return static_cast<size_t>(got);
}

// The shared state of one version of a file (keyed by the identity its header
// was read at): the fingerprint taken at its first check, and the times last
// verified to leave its bytes as they were.
struct VersionState {
  std::mutex mutex;
  bool have_fingerprint = false;
  uint64_t fingerprint = 0;
  FileIdentity accepted;
};

std::shared_ptr<VersionState> version_state(const FileIdentity& id) {
  static std::mutex registry_mutex;
  static std::map<std::tuple<uint64_t, uint64_t, uint64_t, int64_t, int64_t>,
                  std::shared_ptr<VersionState>>
      registry;
  std::lock_guard<std::mutex> lk(registry_mutex);
  auto& slot = registry[{id.dev, id.ino, id.size, id.mtime_ns, id.ctime_ns}];
  if (!slot) {
    slot = std::make_shared<VersionState>();
    slot->accepted = id;
  }
  return slot;
}

}  // namespace

uint64_t fingerprint_file(int fd, uint64_t size, const std::string& path) {
  std::unique_ptr<unsigned char, decltype(&std::free)> buf(
      static_cast<unsigned char*>(std::aligned_alloc(kBlock, kBlock)), &std::free);
  if (!buf) throw std::bad_alloc();
  std::vector<uint64_t> blocks;
  // The header: its 8-byte length (read from the first block, the same way
  // whatever the descriptor), then the JSON (capped).
  uint64_t header_end = std::min<uint64_t>(size, 8);
  if (size >= 8 && read_block(fd, buf.get(), 0, path) >= 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | buf.get()[i];
    header_end = std::min<uint64_t>(size, n > kHeaderCap - 8 ? kHeaderCap : 8 + n);
  }
  for (uint64_t off = 0; off < header_end; off += kBlock) blocks.push_back(off);
  if (size > 0) {
    uint64_t last = (size - 1) / kBlock * kBlock;
    uint64_t stride = std::max<uint64_t>(kBlock, (size / kFingerprintBlocks) / kBlock * kBlock);
    for (uint64_t off = 0; off <= last; off += stride) blocks.push_back(off);
    blocks.push_back(last);
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  uint64_t h = mix(0, size);
  uint64_t chunk_start = UINT64_MAX, chunk_cached = 0;
  for (uint64_t off : blocks) {
    // Leave the page cache as it was: a block whose pages were not cached is
    // dropped again once read (a pipeline rank must not cache other ranks' layers).
    uint64_t chunk = off / kHygieneChunk * kHygieneChunk;
    if (chunk != chunk_start) {
      chunk_start = chunk;
      if (!cached_bytes_of_range(fd, chunk, std::min(kHygieneChunk, size - chunk),
                                 &chunk_cached))
        chunk_cached = UINT64_MAX;  // unknown: keep what is read
    }
    uint64_t len = std::min(kBlock, size - off);
    bool was_cached = true;
    if (chunk_cached == 0) {
      was_cached = false;
    } else if (chunk_cached != UINT64_MAX &&
               chunk_cached < std::min(kHygieneChunk, size - chunk)) {
      uint64_t page_cached = 0;
      was_cached = !cached_bytes_of_range(fd, off, len, &page_cached) || page_cached >= len;
    }
    size_t got = read_block(fd, buf.get(), off, path);
    h = mix(h, off);
    h = mix(h, got);
    for (size_t i = 0; i + 8 <= got; i += 8) {
      uint64_t w;
      std::memcpy(&w, buf.get() + i, 8);
      h = mix(h, w);
    }
    for (size_t i = got / 8 * 8; i < got; ++i) h = mix(h, buf.get()[i]);
    if (!was_cached) advise_file(fd, off, len, Advice::Evict);
  }
  return h;
}

namespace {

// open(2) of `path` with `flags` | O_CLOEXEC | O_NONBLOCK, again after EINTR;
// -1 and errno when it fails. O_NONBLOCK: opening a FIFO for reading waits for
// a writer, and a device's open may wait too.
int open_without_waiting(const std::string& path, int flags) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Clears fd's O_NONBLOCK (reads wait for data again): 0, or the errno.
int make_blocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  return flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 ? errno : 0;
}

// fingerprint_file through a description of its own when the path still names
// this file, with readahead off: readahead around a sampled block would bring
// in pages the eviction does not know of, and the reader's descriptor keeps
// its own advice.
uint64_t fingerprint_quietly(int fd, uint64_t size, const std::string& path,
                             const FileIdentity& id) {
  int own = open_without_waiting(path, O_RDONLY);
  if (own >= 0) {
    struct stat st;
    if (::fstat(own, &st) == 0 && static_cast<uint64_t>(st.st_dev) == id.dev &&
        static_cast<uint64_t>(st.st_ino) == id.ino) {
      advise_file(own, 0, 0, Advice::Random);
      try {
        uint64_t h = fingerprint_file(own, size, path);
        ::close(own);
        return h;
      } catch (...) {
        ::close(own);
        throw;
      }
    }
    ::close(own);
  }
  return fingerprint_file(fd, size, path);
}

}  // namespace

void File::check_unchanged(const FileIdentity& expected) const {
  FileIdentity now = identity();
  std::string what = describe_change(expected, now);
  if (what.empty()) {
    auto state = version_state(expected);
    std::lock_guard<std::mutex> lk(state->mutex);
    const FileIdentity& seen = state->accepted;
    bool moved = now.mtime_ns != seen.mtime_ns || now.ctime_ns != seen.ctime_ns;
    if (!state->have_fingerprint) {
      if (moved || now.mtime_ns != expected.mtime_ns) {
        what = "its modification or status-change time moved before its contents were "
               "first checked";
      } else {
        state->fingerprint = fingerprint_quietly(fd_, now.size, path_, now);
        state->have_fingerprint = true;
      }
    } else if (moved) {
      if (fingerprint_quietly(fd_, now.size, path_, now) == state->fingerprint) {
        state->accepted = now;  // a touch, chmod, link or unlink: the same bytes
      } else if (now.mtime_ns != seen.mtime_ns) {
        what = "rewritten (modification time changed) and its contents differ";
      } else {
        what = "rewritten in place (status-change time changed, modification time kept) "
               "and its contents differ";
      }
    }
  }
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

int open_for_python(const std::string& path, int flags) {
  if (path.find('\0') != std::string::npos) throw IoError("open", path, EINVAL);
  int fd = open_without_waiting(path, flags);
  if (fd < 0) throw IoError("open", path, errno);
  if (!(flags & O_NONBLOCK)) {
    if (int err = make_blocking(fd)) {
      ::close(fd);
      throw IoError("fcntl(F_SETFL)", path, err);
    }
  }
  return fd;
}

File File::open_read(const std::string& path, bool direct) {
  // The check below refuses FIFOs and devices, so their open must not wait.
  // A NUL would cut the name the kernel sees: another file would be opened.
  if (path.find('\0') != std::string::npos) throw_not_regular("open", path);
  int fd = open_without_waiting(path, O_RDONLY);
  if (fd < 0) {
    if (errno == ENOENT || errno == ELOOP || errno == ENOTDIR) throw_not_regular("open", path);
    throw IoError("open", path, errno);
  }
  File file(fd, 0, path, false);  // closes the descriptor on every error below
  struct stat st;
  if (::fstat(fd, &st) != 0) throw IoError("fstat", path, errno);
  if (!S_ISREG(st.st_mode)) throw_not_regular("open", path);
  if (int err = make_blocking(fd)) throw IoError("fcntl(F_SETFL)", path, err);
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
