#include "core/mapping.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "core/errors.h"
#include "core/sigbus_guard.h"

namespace pyloader {

Mapping::Mapping(const File& file, bool writable)
    : size_(file.size()), writable_(writable), path_(file.path()) {
  if (size_ == 0) return;  // nothing to map; data() stays null
  if (platform().drop_by_remap) remap_source_.emplace(file.duplicate());
  addr_ = ::mmap(nullptr, size_, writable ? PROT_READ | PROT_WRITE : PROT_READ,
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
  // The mapping ends at the kernel's page past the file's end, which a larger
  // page_size() (PYLOADER_PAGE_SIZE) may round beyond.
  const uint64_t kernel_page = platform().kernel_page;
  const uint64_t mapped = (size_ + kernel_page - 1) / kernel_page * kernel_page;
  uint64_t begin, end;
  if (advice == Advice::DontNeed) {
    begin = (offset + page - 1) / page * page;
    end = (offset + len) / page * page;
    // The last page of the file is whole from the mapping's point of view.
    if (offset + len == size_) end = mapped;
  } else {
    begin = offset / page * page;
    end = std::min((offset + len + page - 1) / page * page, mapped);
  }
  if (end <= begin) return true;
  char* start = static_cast<char*>(addr_) + begin;
  switch (advice) {
    case Advice::DontNeed:
      return release_mapped(start, end - begin, remap_source_ ? remap_source_->fd() : -1, begin,
                            writable_);
    case Advice::Populate:
      return populate_for_read(start, end - begin, static_cast<char*>(addr_) + offset + len);
    default:
      return advise_mapped(start, end - begin, advice);
  }
}

uint64_t Mapping::resident_bytes(uint64_t offset, uint64_t len) const {
  if (!addr_ || offset >= size_) return 0;
  len = std::min(len, size_ - offset);
  const uint64_t page = page_size();
  uint64_t begin = offset / page * page;
  uint64_t end = std::min((offset + len + page - 1) / page * page, size_);
  uint64_t bytes = 0;
  if (!resident_bytes_of(static_cast<char*>(addr_) + begin, end - begin, &bytes))
    throw IoError("mincore", path_, errno);
  return bytes;
}

uint64_t cached_bytes_of_file(const std::string& path) {
  File f = File::open_read(path);
  return std::min(f.cached_bytes(0, f.size()), f.size());
}

}  // namespace pyloader
