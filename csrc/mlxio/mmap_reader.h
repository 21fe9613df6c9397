// Zero-copy tensors over file mappings.
//
// Each file is mapped once. The reader keeps descriptors for the copy
// fallback (read from the file, so the mapping's pages do not sit in RSS
// beside the copy), exact-range prefetch and page-cache eviction; arrays keep
// only the mapping, which outlives the reader and its descriptors. A tensor
// whose absolute offset is a multiple of its itemsize becomes an
// mlx::core::array that points into the mapping where this MLX's allocator
// can wrap it (view_of, mlxio/mlx_buffers.h: the CPU allocator's header view,
// or Metal's make_buffer over the tensor's own pages): no bytes are copied,
// and the array's deleter holds a reference to the mapping, so the mapping
// lives as long as the reader or any array does. Otherwise (CUDA, a buffer
// the backend refuses, PYLOADER_ZERO_COPY=copy) and for misaligned tensors,
// unless the caller opts into misaligned views (header mode only), tensors are
// copied into MLX-owned memory (counted in the stats).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/mapping.h"
#include "core/read_chunks.h"
#include "core/thread_pool.h"
#include "core/safetensors_index.h"
#include "core/trace_buffer.h"
#include "core/work_queue.h"
#include "mlxio/mlx_buffers.h"
#include "mlxio/tensor_arrays.h"

namespace pyloader {

// The byte ranges of one mapping that wrapped buffers (make_buffer views)
// still show, and the releases waiting for them. Metal wires a wrapped buffer's
// pages and a command buffer may still read them after Python dropped the
// array (MLX keeps its inputs alive until it completes); releasing those pages
// under it (on Darwin a remap, MAP_FIXED) would swap the memory the GPU reads.
// So a release that shares bytes with a live view runs when the last such view
// is destroyed, on the thread that destroys it.
class ViewedRanges : public std::enable_shared_from_this<ViewedRanges> {
 public:
  ViewedRanges() = default;
  ViewedRanges(const ViewedRanges&) = delete;
  ViewedRanges& operator=(const ViewedRanges&) = delete;

  // Marks [begin, end) as shown by a view until the returned token is
  // destroyed (the view's deleter holds it).
  std::shared_ptr<const void> view(uint64_t begin, uint64_t end);
  // Runs `release` now when no live view shares a byte with [begin, end)
  // (returns true), else once none does (returns false).
  bool release(uint64_t begin, uint64_t end, std::function<void()> release);
  size_t live() const;
  size_t waiting() const;

 private:
  void unview(uint64_t id);
  bool overlaps_locked(uint64_t begin, uint64_t end) const;

  struct Waiting {
    uint64_t begin, end;
    std::function<void()> release;
  };
  mutable std::mutex mutex_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> views_;  // id -> [begin, end)
  std::vector<Waiting> waiting_;
};

struct MmapOptions {
  // Hand out views at offsets not aligned to the dtype instead of copies, in
  // the header mode only (MLX's CPU allocator): a make_buffer view's offset is
  // a GPU binding offset, which Metal kernels need aligned to the type they
  // read, so that mode copies misaligned tensors regardless.
  bool allow_misaligned = false;
};

class MmapReader {
 public:
  MmapReader(std::shared_ptr<const TensorIndex> index, MmapOptions options = {});
  MmapReader(const MmapReader&) = delete;
  MmapReader& operator=(const MmapReader&) = delete;
  ~MmapReader();

  const TensorIndex& index() const { return *index_; }

  mlx::core::array get(const std::string& name);
  // `stop`: as PreadReader::load (only copies are read; views are instant).
  NamedArrays load(const std::vector<std::string>& names,
                   const std::atomic<bool>* stop = nullptr);
  NamedArrays load_all(const std::atomic<bool>* stop = nullptr);

  // load() (every tensor for nullopt), then populates the viewed tensors'
  // ranges in file order on a thread of its own (MADV_POPULATE_READ, 8 MiB at
  // a time: the kernel's readahead, in large folios, on that thread), so that
  // a cold first use finds its pages mapped instead of waiting on each fault. The
  // populate is advisory (an error ends it; the page-fault path still reads),
  // lives as long as any of these views does (each view's owner holds it) and
  // stops within one 8 MiB piece once they are all gone. Counted in
  // stats().populate_bytes.
  NamedArrays load_overlapped(const std::optional<std::vector<std::string>>& names);

  // Page-cache / residency hints for one tensor or a byte range of a file.
  // Populate reads the range with positional reads (exact range, large
  // sequential I/O: no read-around into neighbouring tensors) and then maps
  // it; Evict drops its clean pages from the page cache.
  bool advise_tensor(const std::string& name, Advice advice);
  bool advise_range(uint32_t file, uint64_t offset, uint64_t len, Advice advice);
  uint64_t resident_bytes(const std::string& name);

  // Applies `advice` (typically Populate or WillNeed) to the named tensors on
  // a background worker and returns a ticket; wait() blocks until it is done
  // and rethrows its error; cancel() drops it if it has not started.
  uint64_t prefetch(const std::vector<std::string>& names, Advice advice);
  void wait(uint64_t ticket);
  bool ready(uint64_t ticket) const;
  bool cancel(uint64_t ticket);

  // Drops the named tensors' pages from this process (MADV_DONTNEED) and,
  // with `evict`, from the page cache, on a second background thread, and
  // returns at once: the streaming controller's release, kept off the
  // compute thread and beside (not behind) the prefetch reads. A prefetch
  // submitted after a drop starts only once that drop has run, so a unit
  // released and requested again is dropped first. Failures are advisory
  // and ignored. Traced as "release" / "release-evict" spans (ticket 0).
  void drop(const std::vector<std::string>& names, bool evict);
  // Blocks until everything queued on the worker so far (prefetches, drops)
  // has run.
  void settle();

  // Throws IoError(ESTALE) when a file this reader maps was truncated,
  // rewritten or replaced since its header was read (see File::check_unchanged).
  void check_unchanged();

  ReaderStats stats() const;
  size_t live_mappings() const;  // files this reader currently maps

  // What the prefetch worker did (one "populate" span per request, named by
  // its advice) and the copies of misaligned tensors ("copy", ticket 0),
  // while enabled (the streaming timeline).
  TraceBuffer& trace() { return trace_; }

  // Drops the reader's own references to its mappings; a mapping is unmapped
  // once no array uses it either.
  void release();

 private:
  std::shared_ptr<Mapping> mapping(uint32_t file);
  // One file range of a tensor, with what a background job needs to advise it.
  struct Range {
    std::shared_ptr<Mapping> map;
    std::shared_ptr<ViewedRanges> viewed;
    std::shared_ptr<File> file;  // the exact-range (no readahead) descriptor
    FileIdentity identity;
    uint64_t offset, len;
  };
  std::vector<Range> ranges_of(const std::vector<std::string>& names);
  // Called without mutex_ held; `file` and `map` must come from mapping().
  // Bytes read by Populate are added to `populated`.
  static bool apply(const File& file, const FileIdentity& expected, const Mapping& map,
                    uint64_t offset, uint64_t len, Advice advice,
                    std::atomic<uint64_t>& populated);
  // Populate's second half: maps [offset, offset + len) in (its reads asked
  // for already, or not), checking the file before and after.
  static bool map_in(const File& file, const FileIdentity& expected, const Mapping& map,
                     uint64_t offset, uint64_t len, std::atomic<uint64_t>& populated);
  // Called with mutex_ held: reads the copies queued by make_array, then
  // checks that their files did not change meanwhile.
  void read_copies(const std::vector<ReadChunk>& copies, const std::atomic<bool>* stop);
  // Copies of misaligned tensors are read at once, or queued on `deferred`.
  // A view also keeps `keep` alive; `viewed` (optional) says whether the
  // array is a view of the mapping.
  mlx::core::array make_array(const TensorInfo& t, std::vector<ReadChunk>* deferred = nullptr,
                              std::shared_ptr<const void> keep = nullptr,
                              bool* viewed = nullptr);

  std::shared_ptr<const TensorIndex> index_;
  MmapOptions options_;
  ZeroCopy mode_;  // zero_copy_mode() when the reader was made
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<Mapping>> maps_;  // per file, mapped on first use
  // Per file: the ranges make_buffer views show (releases wait for them).
  std::vector<std::shared_ptr<ViewedRanges>> viewed_;
  // Opens file `file`'s two descriptors (constructor, or mutex_ held).
  void open_file(uint32_t file);

  std::vector<std::shared_ptr<File>> files_;        // descriptors for copies
  std::vector<std::shared_ptr<File>> exact_files_;  // no-readahead ones for populate
  ReaderStats stats_;
  std::atomic<uint64_t> populate_bytes_{0};  // written by the worker too
  // Written by load_overlapped's populates, which may outlive the reader.
  std::shared_ptr<std::atomic<uint64_t>> overlapped_populate_bytes_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  TraceBuffer trace_;                        // recorded into by the worker too
  ThreadPool pool_;  // parallel reads of the copies
  // Drops submitted / run so far; a prefetch waits for the drops before it.
  std::mutex drops_mutex_;
  std::condition_variable drops_cv_;
  uint64_t drops_submitted_ = 0, drops_done_ = 0;
  std::unique_ptr<WorkQueue> drops_;  // drop(); joined after queue_
  std::unique_ptr<WorkQueue> queue_;  // background hints; joined first on destruction
};

}  // namespace pyloader
