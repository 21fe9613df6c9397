// What Linux and Darwin (XNU) do differently, behind one interface: every
// `#if __linux__ / __APPLE__` of the C++ code is in platform.cpp, and the rest
// asks for an operation, never for the operating system. The table of what
// each call does where, and of the switches below, is docs/platform-switches.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

struct stat;

namespace pyloader {

enum class Advice;  // core/file.h

// The environment switches, read once, here and nowhere else (the first call;
// the extension calls it at import, so a bad value fails the import). Defaults
// are chosen by platform; the switches exist so that every path a platform takes
// can run on Linux in tests.
struct PlatformSettings {
  const char* os;          // "linux", "darwin" or "other"
  uint64_t kernel_page;    // sysconf(_SC_PAGESIZE): what the kernel maps and mincore counts
  uint64_t page_size;      // PYLOADER_PAGE_SIZE (a power-of-two multiple of the kernel's
                           // page, e.g. 16384 on Linux for Apple Silicon's pages), else
                           // kernel_page: the unit every range is rounded to
  bool portable_io;        // PYLOADER_PORTABLE_IO=1: no O_DIRECT/F_NOCACHE, no fadvise,
                           // no MADV_POPULATE_*, no io_uring (a POSIX system's path)
  bool drop_by_remap;      // PYLOADER_DROP=remap|madvise; default remap on Darwin (its
                           // MADV_DONTNEED only deactivates pages), madvise elsewhere
  uint64_t pread_cap;      // PYLOADER_PREAD_CAP: bytes per pread call (default 1 GiB;
                           // XNU refuses more than INT_MAX)
  bool sigbus_guard;       // PYLOADER_NO_SIGBUS_GUARD=1 turns the guard off
  bool huge_pages;         // PYLOADER_HUGE_PAGES=0 turns advise_huge_pages off (default on
                           // where the platform has them: Linux, not the portable path)
};
// Throws std::invalid_argument naming the variable when a switch has a bad value.
const PlatformSettings& platform();

// platform().page_size.
uint64_t page_size();

// The kernel's id of the calling thread (as top, /proc/PID/task and Python
// report it on Linux; pthread_threadid_np on Darwin).
uint64_t current_thread_id();

// Asks the operating system, once per process, to let every thread use the
// CPU's tile registers (Intel AMX): Linux hands out that state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM). Returns whether the process may use them;
// false on other systems.
bool enable_tile_registers();

// ---- Descriptors ----------------------------------------------------------

// Makes reads of `fd` bypass the page cache: O_DIRECT (offsets, lengths and
// buffers aligned to kDirectAlign) on Linux, F_NOCACHE (no alignment rule) on
// Darwin. Returns 0, or the errno (EINVAL where the file system or platform
// has no such reads, and always under PYLOADER_PORTABLE_IO).
int enable_direct_reads(int fd);

// Read-ahead and cache hints for [offset, offset + len) of the file (len 0: to
// its end). Linux: posix_fadvise. Darwin: F_RDAHEAD (Normal, Sequential:
// on; Random: off), F_RDADVISE (WillNeed, Populate), and for DontNeed/Evict
// msync(MS_INVALIDATE) over a temporary mapping of the range's whole pages
// (Darwin has no per-file eviction call); the portable path does only that
// eviction. Ranges round inward for eviction, so a page shared with bytes
// outside the range is kept. Advisory: false when nothing was done.
bool advise_file(int fd, uint64_t offset, uint64_t len, Advice advice);

// Writes the file's dirty pages (fdatasync; fsync where there is none). 0 or errno.
int sync_file_data(int fd);

// Modification and status-change times of `st` in nanoseconds.
int64_t mtime_ns(const struct stat& st);
int64_t ctime_ns(const struct stat& st);

// ---- Mapped memory (addresses and lengths are multiples of page_size()) --

// madvise for Normal, Sequential, Random, WillNeed. Advisory.
bool advise_mapped(void* addr, size_t len, Advice advice);

// Maps the file pages of [addr, addr + len) in now: MADV_POPULATE_READ where
// it exists, else (older Linux, Darwin, portable) one read per kernel page.
// `readable_end` bounds the touched bytes (the file's end inside its last page).
// False only when MADV_POPULATE_READ was refused for another reason (errno
// set): the per-page reads cannot fail (a fault past the end is SIGBUS).
bool populate_for_read(void* addr, size_t len, const void* readable_end);

// Commits [addr, addr + len) of anonymous memory for writing in one call
// (MADV_POPULATE_WRITE, Linux 5.14+). False where unavailable (then nothing is
// done: the caller's writes fault the pages in) or refused (errno set).
bool populate_for_write(void* addr, size_t len);

// Asks for huge pages (Linux: MADV_HUGEPAGE on the 2 MiB-aligned part of the
// range) for anonymous memory not yet touched: its faults then map 2 MiB at a
// time, and a direct read into it is a few large DMA segments instead of 512
// small ones. False where there are none
// (Darwin, the portable path, PYLOADER_HUGE_PAGES=0, a range without a whole
// huge page) or refused.
bool advise_huge_pages(void* addr, size_t len);

// Bytes of the file's pages in [offset, offset + len) (rounded out to kernel
// pages) that are in the page cache, by mincore over a temporary read-only
// mapping that touches nothing. False with errno set when the kernel refused.
bool cached_bytes_of_range(int fd, uint64_t offset, uint64_t len, uint64_t* bytes);

// Releases the pages of [addr, addr + len), a range of a MAP_PRIVATE file
// mapping of `fd` at file offset `offset`, so that RSS really drops and private
// copy-on-write pages are discarded (the file's bytes are seen again):
// MADV_DONTNEED, or with drop_by_remap a new private mapping of the same file
// range put over it (MAP_FIXED; XNU's MADV_DONTNEED only deactivates pages).
// `fd` -1: madvise only. `writable`: the mapping's protection (a remap keeps
// it: read-only stays read-only). Advisory: false when the kernel refused.
bool release_mapped(void* addr, size_t len, int fd, uint64_t offset, bool writable);
// Releases done by remapping so far (a test hook: shows which path ran).
uint64_t remap_releases();

// Bytes of [addr, addr + len) resident in memory (mincore, counted in kernel
// pages). False with errno set when the kernel refused.
bool resident_bytes_of(const void* addr, size_t len, uint64_t* bytes);

}  // namespace pyloader
