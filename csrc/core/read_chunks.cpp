#include "core/read_chunks.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "core/errors.h"
#include "core/mapping.h"

#include "core/platform.h"

#ifdef PYLOADER_HAVE_URING
#include <liburing.h>
#endif

namespace pyloader {

size_t pool_threads(ReadBackend backend, size_t requested) {
  if (backend == ReadBackend::IoUring) return 0;
  size_t n = requested ? requested : std::max<size_t>(std::thread::hardware_concurrency(), 1);
  return n - 1;  // the calling thread reads too
}

void prefault_for_write(uint8_t* dst, size_t len) {
  // Fresh buffers fault once per page inside the kernel's copy to user
  // memory, which dominates a read from the page cache; one madvise maps the
  // whole range in a single pass. Advisory: on failure the copy faults as usual.
  const uint64_t page = page_size();
  auto begin = (reinterpret_cast<uintptr_t>(dst) + page - 1) / page * page;
  auto end = (reinterpret_cast<uintptr_t>(dst) + len) / page * page;
  if (end > begin) populate_for_write(reinterpret_cast<void*>(begin), end - begin);
}

void read_chunks_threaded(ThreadPool& pool, const std::vector<ReadChunk>& chunks,
                          const std::atomic<bool>* stop) {
  // A pread from a cold file is read in readahead-window pieces, so a few
  // threads keep few disk requests in flight. Asking for the next chunks
  // (WILLNEED: asynchronous, exact range) keeps the device queue deep while
  // the threads copy what has arrived. Not for O_DIRECT descriptors: that
  // would fill the page cache the direct reads exist to bypass.
  constexpr size_t kLookahead = 4;
  auto ask = [&](const ReadChunk& c) {
    if (!c.file->direct()) c.file->advise(c.offset, c.len, Advice::WillNeed);
  };
  for (size_t j = 0; j < std::min(kLookahead, chunks.size()); ++j) ask(chunks[j]);
  pool.run(chunks.size(), [&](size_t i) {
    if (stop && stop->load(std::memory_order_relaxed)) throw Interrupted("read interrupted");
    if (i + kLookahead < chunks.size()) ask(chunks[i + kLookahead]);
    const ReadChunk& c = chunks[i];
    if (!c.file->direct()) prefault_for_write(c.dst, c.len);  // a direct read faults them in
    c.file->read_exact(c.dst, c.len, c.offset);
  });
}

#ifdef PYLOADER_HAVE_URING

struct UringReader::Impl {
  io_uring ring;
  unsigned depth;
};

UringReader::UringReader(unsigned queue_depth) : impl_(std::make_unique<Impl>()) {
  if (platform().portable_io)
    throw UnsupportedError("io_uring reads are off (PYLOADER_PORTABLE_IO=1: the path of a "
                           "platform without io_uring); use the threads backend");
  impl_->depth = queue_depth;
  int rc = io_uring_queue_init(queue_depth, &impl_->ring, 0);
  if (rc < 0) {
    impl_.reset();
    throw IoError("io_uring_queue_init", "(io_uring)", -rc);
  }
}

UringReader::~UringReader() {
  if (impl_) io_uring_queue_exit(&impl_->ring);
}

void UringReader::read(const std::vector<ReadChunk>& chunks) {
  struct Pending {
    const ReadChunk* chunk;
    size_t done;
  };
  std::vector<Pending> state(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) state[i] = {&chunks[i], 0};
  io_uring* ring = &impl_->ring;
  size_t next = 0, in_flight = 0;
  std::vector<size_t> retry;  // chunks with a short read to resubmit
  IoError* failure = nullptr;
  std::unique_ptr<IoError> failure_holder;

  auto submit_one = [&](size_t i) -> bool {
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    if (!sqe) return false;
    Pending& p = state[i];
    const ReadChunk& c = *p.chunk;
    size_t want = c.len - p.done;
    // A single read is capped well below 2 GiB (the kernel's per-call limit).
    if (want > (1u << 30)) want = 1u << 30;
    io_uring_prep_read(sqe, c.file->fd(), c.dst + p.done, static_cast<unsigned>(want),
                       c.offset + p.done);
    io_uring_sqe_set_data64(sqe, i);
    ++in_flight;
    return true;
  };

  while (next < chunks.size() || in_flight > 0 || !retry.empty()) {
    if (!failure) {
      while (!retry.empty() && in_flight < impl_->depth) {
        if (!submit_one(retry.back())) break;
        retry.pop_back();
      }
      while (next < chunks.size() && in_flight < impl_->depth) {
        if (chunks[next].len == 0) { ++next; continue; }
        if (!submit_one(next)) break;
        ++next;
      }
    } else {
      next = chunks.size();
      retry.clear();
    }
    if (in_flight == 0) break;
    int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR) throw IoError("io_uring_submit_and_wait", "(io_uring)", -rc);
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      --in_flight;
      size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      Pending& p = state[i];
      int res = cqe->res;
      if (res == -EINTR || res == -EAGAIN) {
        retry.push_back(i);
      } else if (res < 0 || res == 0) {
        if (!failure_holder) {
          failure_holder = std::make_unique<IoError>(
              res == 0 ? "io_uring read (unexpected end of file: was it truncated while open?)"
                       : "io_uring read",
              p.chunk->file->path(), res == 0 ? EIO : -res,
              static_cast<int64_t>(p.chunk->offset + p.done));
          failure = failure_holder.get();
        }
      } else {
        p.done += static_cast<size_t>(res);
        if (p.done < p.chunk->len) retry.push_back(i);
      }
    }
    io_uring_cq_advance(ring, seen);
  }
  if (failure) throw *failure;
}

bool uring_available() {
  static const bool ok = [] {
    if (platform().portable_io) return false;
    io_uring ring;
    if (io_uring_queue_init(2, &ring, 0) < 0) return false;
    io_uring_queue_exit(&ring);
    return true;
  }();
  return ok;
}

bool uring_built() { return true; }

#else  // !PYLOADER_HAVE_URING

struct UringReader::Impl {};

UringReader::UringReader(unsigned) {
  throw UnsupportedError("pyloader was built without liburing: io_uring reads are unavailable "
                         "(install liburing-dev and rebuild)");
}
UringReader::~UringReader() = default;
void UringReader::read(const std::vector<ReadChunk>&) {}
bool uring_available() { return false; }
bool uring_built() { return false; }

#endif

}  // namespace pyloader
