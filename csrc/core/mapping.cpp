#include "core/mapping.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "core/errors.h"
#include "core/sigbus_guard.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace pyloader {

uint64_t page_size() {
  static const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return kPage;
}

Mapping::Mapping(const File& file) : size_(file.size()), path_(file.path()) {
  if (size_ == 0) return;  // nothing to map; data() stays null
  addr_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_NORESERVE, file.fd(), 0);
  if (addr_ == MAP_FAILED) {
    addr_ = nullptr;
    throw IoError("mmap", path_, errno);
  }
  // Pages past the end of a file truncated under us become zero pages
  // instead of a SIGBUS; the readers' identity checks report the truncation.
  guard_slot_ = guard_range(addr_, size_);
}

Mapping::~Mapping() {
  unguard_range(guard_slot_);
  if (addr_) ::munmap(addr_, size_);
}

bool Mapping::advise(uint64_t offset, uint64_t len, Advice advice) const {
  if (!addr_ || offset >= size_) return true;
  len = std::min(len, size_ - offset);
  if (advice == Advice::Evict) return false;  // needs a descriptor: File::advise
  const uint64_t page = page_size();
  uint64_t begin, end;
  if (advice == Advice::DontNeed) {
    begin = (offset + page - 1) / page * page;
    end = (offset + len) / page * page;
    // The last page of the file is whole from the mapping's point of view.
    if (offset + len == size_) end = (size_ + page - 1) / page * page;
  } else {
    begin = offset / page * page;
    end = (offset + len + page - 1) / page * page;
  }
  if (end <= begin) return true;
  int a;
  switch (advice) {
    case Advice::Normal: a = MADV_NORMAL; break;
    case Advice::Sequential: a = MADV_SEQUENTIAL; break;
    case Advice::Random: a = MADV_RANDOM; break;
    case Advice::WillNeed: a = MADV_WILLNEED; break;
    case Advice::DontNeed: a = MADV_DONTNEED; break;
    case Advice::Populate: a = MADV_POPULATE_READ; break;
    default: return false;
  }
  char* start = static_cast<char*>(addr_) + begin;
  if (::madvise(start, end - begin, a) == 0) return true;
  if (advice == Advice::Populate && (errno == EINVAL || errno == ENOSYS)) {
    // Kernels before 5.14: touch one byte per page instead.
    volatile uint8_t sink = 0;
    for (uint64_t p = std::max(begin, offset); p < offset + len; p += page - (p % page))
      sink = sink + static_cast<volatile uint8_t*>(addr_)[p];
    (void)sink;
    return true;
  }
  return false;
}

uint64_t Mapping::resident_bytes(uint64_t offset, uint64_t len) const {
  if (!addr_ || offset >= size_) return 0;
  len = std::min(len, size_ - offset);
  const uint64_t page = page_size();
  uint64_t begin = offset / page * page;
  uint64_t end = (offset + len + page - 1) / page * page;
  std::vector<unsigned char> vec((end - begin) / page);
  if (::mincore(static_cast<char*>(addr_) + begin, end - begin, vec.data()) != 0)
    throw IoError("mincore", path_, errno);
  uint64_t n = 0;
  for (unsigned char v : vec) n += (v & 1);
  return n * page;
}

uint64_t cached_bytes_of_file(const std::string& path) {
  File f = File::open_read(path);
  Mapping m(f);
  return std::min(m.resident_bytes(0, m.size()), m.size());
}

}  // namespace pyloader
