#include "core/platform.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/file.h"

#if defined(__linux__)
#include <sys/syscall.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
#elif defined(__APPLE__)
#include <pthread.h>
#endif

namespace pyloader {

namespace {

bool flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

// A positive decimal byte count, or `fallback` when unset or empty.
uint64_t bytes_setting(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(v, &end, 10);
  if (errno || *end || n == 0 || *v == '-')
    throw std::invalid_argument(std::string(name) + "=" + v +
                                ": expected a positive number of bytes");
  return static_cast<uint64_t>(n);
}

PlatformSettings read_settings() {
  PlatformSettings s{};
#if defined(__linux__)
  s.os = "linux";
#elif defined(__APPLE__)
  s.os = "darwin";
#else
  s.os = "other";
#endif
  s.kernel_page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  s.page_size = bytes_setting("PYLOADER_PAGE_SIZE", s.kernel_page);
  if ((s.page_size & (s.page_size - 1)) != 0 || s.page_size % s.kernel_page != 0)
    throw std::invalid_argument(
        "PYLOADER_PAGE_SIZE=" + std::to_string(s.page_size) +
        ": expected a power of two that is a multiple of this kernel's page (" +
        std::to_string(s.kernel_page) + " bytes), e.g. 16384");
  s.portable_io = flag("PYLOADER_PORTABLE_IO");
#if defined(__APPLE__)
  s.drop_by_remap = true;  // MADV_DONTNEED only deactivates pages on XNU
#else
  s.drop_by_remap = false;
#endif
  if (const char* v = std::getenv("PYLOADER_DROP"); v && *v) {
    if (std::strcmp(v, "remap") == 0) s.drop_by_remap = true;
    else if (std::strcmp(v, "madvise") == 0) s.drop_by_remap = false;
    else
      throw std::invalid_argument(std::string("PYLOADER_DROP=") + v +
                                  ": expected remap or madvise");
  }
  s.pread_cap = bytes_setting("PYLOADER_PREAD_CAP", uint64_t{1} << 30);
  s.sigbus_guard = !flag("PYLOADER_NO_SIGBUS_GUARD");
  s.huge_pages = true;
  if (const char* v = std::getenv("PYLOADER_HUGE_PAGES"); v && *v) {
    if (std::strcmp(v, "0") == 0) s.huge_pages = false;
    else if (std::strcmp(v, "1") != 0)
      throw std::invalid_argument(std::string("PYLOADER_HUGE_PAGES=") + v + ": expected 0 or 1");
  }
#if !defined(__linux__) || !defined(MADV_HUGEPAGE)
  s.huge_pages = false;
#endif
  if (s.portable_io) s.huge_pages = false;
  return s;
}

std::atomic<uint64_t> g_remap_releases{0};

uint64_t round_up(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// Drops the clean cached pages of [offset, offset + len) (len 0: to the end)
// through a temporary shared mapping: POSIX, and Darwin's only per-file way.
// Whole pages inside the range, plus the file's partial last page.
bool evict_by_msync(int fd, uint64_t offset, uint64_t len) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  const auto size = static_cast<uint64_t>(st.st_size);
  if (offset >= size) return true;
  const uint64_t end = len == 0 ? size : std::min(size, offset + len);
  const uint64_t page = platform().kernel_page;
  const uint64_t begin = round_up(offset, page);
  const uint64_t stop = end == size ? round_up(size, page) : end / page * page;
  if (stop <= begin) return true;
  void* m = ::mmap(nullptr, stop - begin, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(begin));
  if (m == MAP_FAILED) return false;
  bool ok = ::msync(m, stop - begin, MS_INVALIDATE) == 0;
  int err = errno;
  ::munmap(m, stop - begin);
  errno = err;
  return ok;
}

}  // namespace

const PlatformSettings& platform() {
  static const PlatformSettings settings = read_settings();
  return settings;
}

uint64_t page_size() { return platform().page_size; }

uint64_t current_thread_id() {
#if defined(__linux__)
  // The kernel's thread id, as top, /proc/PID/task and Python report it.
  thread_local const uint64_t tid = static_cast<uint64_t>(::syscall(SYS_gettid));
  return tid;
#elif defined(__APPLE__)
  uint64_t tid = 0;
  pthread_threadid_np(nullptr, &tid);
  return tid;
#else
  return std::hash<std::thread::id>{}(std::this_thread::get_id());
#endif
}

bool enable_tile_registers() {
#if defined(__linux__) && defined(__x86_64__)
  // Linux 5.16's interface (arch/x86/include/uapi/asm/prctl.h).
  constexpr int kReqXcompPerm = 0x1023;
  constexpr int kXfeatureTileData = 18;
  static const bool granted = ::syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return granted;
#else
  return false;
#endif
}

int enable_direct_reads(int fd) {
  if (platform().portable_io) return EINVAL;
#if defined(__linux__)
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_DIRECT) != 0) return errno;
  return 0;
#elif defined(__APPLE__)
  return ::fcntl(fd, F_NOCACHE, 1) == -1 ? errno : 0;
#else
  (void)fd;
  return EINVAL;
#endif
}

bool advise_file(int fd, uint64_t offset, uint64_t len, Advice advice) {
  const bool evict = advice == Advice::DontNeed || advice == Advice::Evict;
#if defined(__linux__)
  if (!platform().portable_io) {
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
    return ::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(len), a) == 0;
  }
#elif defined(__APPLE__)
  if (!platform().portable_io && !evict) {
    switch (advice) {
      case Advice::Normal:
      case Advice::Sequential: return ::fcntl(fd, F_RDAHEAD, 1) != -1;
      case Advice::Random: return ::fcntl(fd, F_RDAHEAD, 0) != -1;
      case Advice::WillNeed:
      case Advice::Populate: {
        if (len == 0) {
          struct stat st;
          if (::fstat(fd, &st) != 0) return false;
          if (offset >= static_cast<uint64_t>(st.st_size)) return true;
          len = static_cast<uint64_t>(st.st_size) - offset;
        }
        // radvisory's count is an int: one call per GiB.
        constexpr uint64_t kPiece = uint64_t{1} << 30;
        for (uint64_t done = 0; done < len; done += kPiece) {
          struct radvisory ra;
          ra.ra_offset = static_cast<off_t>(offset + done);
          ra.ra_count = static_cast<int>(std::min(kPiece, len - done));
          if (::fcntl(fd, F_RDADVISE, &ra) == -1) return false;
        }
        return true;
      }
      default: return false;
    }
  }
#endif
  // What POSIX offers: eviction through a mapping; no read-ahead hints.
  return evict && evict_by_msync(fd, offset, len);
}

int sync_file_data(int fd) {
#if defined(__linux__)
  return ::fdatasync(fd) == 0 ? 0 : errno;
#else
  return ::fsync(fd) == 0 ? 0 : errno;
#endif
}

namespace {
int64_t ns(const struct timespec& t) {
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}
}  // namespace

#if defined(__APPLE__)
int64_t mtime_ns(const struct stat& st) { return ns(st.st_mtimespec); }
int64_t ctime_ns(const struct stat& st) { return ns(st.st_ctimespec); }
#else
int64_t mtime_ns(const struct stat& st) { return ns(st.st_mtim); }
int64_t ctime_ns(const struct stat& st) { return ns(st.st_ctim); }
#endif

bool advise_mapped(void* addr, size_t len, Advice advice) {
  int a;
  switch (advice) {
    case Advice::Normal: a = MADV_NORMAL; break;
    case Advice::Sequential: a = MADV_SEQUENTIAL; break;
    case Advice::Random: a = MADV_RANDOM; break;
    case Advice::WillNeed: a = MADV_WILLNEED; break;
    default: return false;
  }
  return ::madvise(addr, len, a) == 0;
}

bool populate_for_read(void* addr, size_t len, const void* readable_end) {
#if defined(__linux__)
  if (!platform().portable_io) {
    if (::madvise(addr, len, MADV_POPULATE_READ) == 0) return true;
    if (errno != EINVAL && errno != ENOSYS) return false;  // before 5.14: touch below
  }
#endif
  // One read per kernel page maps the range in (a fault each).
  const uint64_t page = platform().kernel_page;
  auto* p = static_cast<volatile uint8_t*>(addr);
  auto* end = std::min(static_cast<const volatile uint8_t*>(p) + len,
                       static_cast<const volatile uint8_t*>(readable_end));
  uint8_t sink = 0;
  for (; p < end; p += page) sink = static_cast<uint8_t>(sink + *p);
  (void)sink;
  return true;
}

bool populate_for_write(void* addr, size_t len) {
#if defined(__linux__)
  if (!platform().portable_io) return ::madvise(addr, len, MADV_POPULATE_WRITE) == 0;
#endif
  (void)addr;
  (void)len;
  errno = ENOSYS;
  return false;
}

bool release_mapped(void* addr, size_t len, int fd, uint64_t offset, bool writable) {
  if (platform().drop_by_remap && fd >= 0) {
    // The same file range mapped afresh over the old pages: they are unmapped
    // (RSS drops, private copies are discarded) and fault in from the file
    // again. XNU and Linux 6.12+ keep the old mapping when this fails.
    void* r = ::mmap(addr, len, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                     MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, fd, static_cast<off_t>(offset));
    if (r == MAP_FAILED) return false;
    g_remap_releases.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return ::madvise(addr, len, MADV_DONTNEED) == 0;
}

bool advise_huge_pages(void* addr, size_t len) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (platform().huge_pages) {
    constexpr uintptr_t kHuge = 2u << 20;
    uintptr_t begin = round_up(reinterpret_cast<uintptr_t>(addr), kHuge);
    uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + len) / kHuge * kHuge;
    if (end <= begin) return false;
    return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
  }
#endif
  (void)addr;
  (void)len;
  errno = ENOSYS;
  return false;
}

bool cached_bytes_of_range(int fd, uint64_t offset, uint64_t len, uint64_t* bytes) {
  *bytes = 0;
  if (len == 0) return true;
  const uint64_t page = platform().kernel_page;
  const uint64_t begin = offset / page * page;
  const uint64_t span = round_up(offset + len, page) - begin;
  void* addr = ::mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(begin));
  if (addr == MAP_FAILED) return false;
  bool ok = resident_bytes_of(addr, span, bytes);
  int err = errno;
  ::munmap(addr, span);
  errno = err;
  return ok;
}

uint64_t remap_releases() { return g_remap_releases.load(std::memory_order_relaxed); }

bool resident_bytes_of(const void* addr, size_t len, uint64_t* bytes) {
  const uint64_t page = platform().kernel_page;
  auto begin = reinterpret_cast<uintptr_t>(addr) / page * page;
  auto end = round_up(reinterpret_cast<uintptr_t>(addr) + len, page);
  *bytes = 0;
  if (end <= begin) return true;
  std::vector<unsigned char> vec((end - begin) / page);
#if defined(__APPLE__)
  auto* out = reinterpret_cast<char*>(vec.data());  // Darwin's mincore takes char*
#else
  auto* out = vec.data();
#endif
  if (::mincore(reinterpret_cast<void*>(begin), end - begin, out) != 0) return false;
  uint64_t n = 0;
  for (unsigned char v : vec) n += (v & 1);
  *bytes = n * page;
  return true;
}

}  // namespace pyloader
