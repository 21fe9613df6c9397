#include "mlxio/arena_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "core/errors.h"
#include "core/mapping.h"
#include "core/platform.h"
#include "mlxio/mlx_buffers.h"

namespace mx = mlx::core;

namespace pyloader {

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  std::ostringstream os;
  os.precision(u ? 1 : 0);
  os << std::fixed << v << " " << units[u];
  return os.str();
}

mx::allocator::Data ArenaMemory::checked_size(size_t bytes, const std::string& purpose,
                                              const std::string& hint) {
  // MLX's generic error otherwise (Metal's malloc throws above maxBufferLength).
  const uint64_t limit = max_buffer_bytes();
  if (bytes > limit)
    throw UnsupportedError("one buffer of " + std::to_string(bytes) + " bytes (" +
                           human_bytes(bytes) + ") for " + purpose +
                           " exceeds this device's largest buffer (maxBufferLength), " +
                           std::to_string(limit) + " bytes (" + human_bytes(limit) + "). " +
                           hint);
  return mx::allocator::malloc(bytes);
}

ArenaMemory::ArenaMemory(size_t bytes, bool populate, const std::string& purpose,
                         const std::string& hint, bool huge_pages)
    : buffer_(checked_size(bytes, purpose, hint)), data_(nullptr), size_(bytes) {
  if (!buffer_.buffer().ptr())
    throw AllocationError("could not allocate " + human_bytes(bytes) + " for " + purpose + ". " +
                          hint);
  data_ = static_cast<uint8_t*>(buffer_.buffer().raw_ptr());
  if (huge_pages && buffer_owner() == BufferOwner::Cpu) advise_huge_pages(data_, bytes);
  if (!populate || bytes == 0) return;
  // Commit the whole pages inside the buffer (the partial ones at its ends are
  // shared with the allocator's bookkeeping and committed anyway).
  const size_t page = page_size();
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data_) + page - 1) / page * page;
  uintptr_t end = (reinterpret_cast<uintptr_t>(data_) + bytes) / page * page;
  if (end <= begin) return;
  if (populate_for_write(reinterpret_cast<void*>(begin), end - begin)) return;
  int err = errno;
  if (err != EINVAL && err != ENOSYS)
    throw AllocationError("could not commit " + human_bytes(bytes) + " for " + purpose + ": " +
                          std::strerror(err) + ". " + hint);
  // No populate call here (older kernels, other systems, the portable path):
  // one write per kernel page (the contents do not matter; page_size() may be a
  // multiple of the kernel's page under PYLOADER_PAGE_SIZE, and a write commits one).
  const size_t step = platform().kernel_page;
  for (uintptr_t p = begin; p < end; p += step) *reinterpret_cast<volatile uint8_t*>(p) = 0;
}

size_t ArenaMemory::resident_bytes() const {
  const size_t page = page_size();
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data_) + page - 1) / page * page;
  uintptr_t end = (reinterpret_cast<uintptr_t>(data_) + size_) / page * page;
  if (end <= begin) return 0;
  uint64_t bytes = 0;  // mincore counts kernel pages, which page_size() may exceed
  if (!resident_bytes_of(reinterpret_cast<void*>(begin), end - begin, &bytes))
    throw std::runtime_error(std::string("[ArenaMemory] mincore failed: ") + std::strerror(errno));
  return static_cast<size_t>(bytes);
}

MemoryLock::MemoryLock(void* addr, size_t bytes) : addr_(addr), size_(bytes) {
  if (bytes == 0 || ::mlock(addr, bytes) == 0) {
    locked_ = bytes > 0;
    return;
  }
  int err = errno;
  std::ostringstream os;
  os << "mlock of " << human_bytes(bytes) << " failed (" << std::strerror(err) << ")";
  struct rlimit rl;
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    if (rl.rlim_cur == RLIM_INFINITY)
      os << "; RLIMIT_MEMLOCK is unlimited, so the system is short of memory";
    else
      os << "; RLIMIT_MEMLOCK is " << human_bytes(rl.rlim_cur)
         << ": raise it (`ulimit -l`, LimitMEMLOCK= in a systemd unit, or memlock in "
            "/etc/security/limits.conf) or run with CAP_IPC_LOCK";
  }
  os << ". The memory stays unlocked and may be swapped out.";
  error_ = os.str();
}

MemoryLock::~MemoryLock() {
  if (locked_) ::munlock(addr_, size_);
}

}  // namespace pyloader
