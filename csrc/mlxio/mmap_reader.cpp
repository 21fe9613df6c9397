#include "mlxio/mmap_reader.h"

#include <algorithm>
#include <cerrno>
#include <functional>
#include <new>
#include <thread>
#include <utility>

#include "core/errors.h"
#include "core/platform.h"
#include "mlx/allocator.h"
#include "mlxio/mlx_buffers.h"

namespace mx = mlx::core;

namespace pyloader {

std::shared_ptr<const void> ViewedRanges::view(uint64_t begin, uint64_t end) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    id = next_id_++;
    views_.emplace(id, std::make_pair(begin, end));
  }
  return std::shared_ptr<const void>(nullptr, [self = shared_from_this(), id](const void*) {
    self->unview(id);
  });
}

bool ViewedRanges::overlaps_locked(uint64_t begin, uint64_t end) const {
  for (const auto& [id, r] : views_)
    if (r.first < end && begin < r.second) return true;
  return false;
}

bool ViewedRanges::release(uint64_t begin, uint64_t end, std::function<void()> release) {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (overlaps_locked(begin, end)) {
      waiting_.push_back({begin, end, std::move(release)});
      return false;
    }
  }
  release();
  return true;
}

void ViewedRanges::unview(uint64_t id) {
  std::vector<std::function<void()>> ready;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    views_.erase(id);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (overlaps_locked(it->begin, it->end)) {
        ++it;
      } else {
        ready.push_back(std::move(it->release));
        it = waiting_.erase(it);
      }
    }
  }
  for (auto& r : ready) {
    try {
      r();
    } catch (...) {
      // Advisory, like every release; a deleter must not throw.
    }
  }
}

size_t ViewedRanges::live() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return views_.size();
}

size_t ViewedRanges::waiting() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return waiting_.size();
}

MmapReader::MmapReader(std::shared_ptr<const TensorIndex> index, MmapOptions options)
    : index_(std::move(index)),
      options_(options),
      mode_(zero_copy_mode()),
      maps_(index_->files().size()),
      viewed_(index_->files().size()),
      files_(index_->files().size()),
      exact_files_(index_->files().size()),
      pool_(std::max<size_t>(std::thread::hardware_concurrency(), 1) - 1),
      drops_(std::make_unique<WorkQueue>(1)),
      queue_(std::make_unique<WorkQueue>(1)) {
  // Every file is opened now: the reader keeps reading through these
  // descriptors even once the files' paths are gone (a temporary directory
  // deleted under a streamed model), as a fully read model would.
  for (uint32_t i = 0; i < files_.size(); ++i) open_file(i);
  for (auto& v : viewed_) v = std::make_shared<ViewedRanges>();
}

MmapReader::~MmapReader() {
  queue_.reset();  // a running prefetch may wait for a drop: drops_ still runs them
  drops_.reset();
}

void MmapReader::open_file(uint32_t file) {
  auto f = std::make_shared<File>(File::open_read(index_->files()[file].path));
  f->check_unchanged(index_->files()[file].identity);
  files_[file] = std::move(f);
  // A second description of the file for exact-range reads (populate): no
  // readahead past the requested range into neighbouring tensors, while
  // copies through files_ keep the kernel's readahead.
  auto exact = std::make_shared<File>(File::open_read(index_->files()[file].path));
  exact->advise(0, 0, Advice::Random);
  exact_files_[file] = std::move(exact);
}

std::shared_ptr<Mapping> MmapReader::mapping(uint32_t file) {
  // Called with mutex_ held.
  auto& m = maps_.at(file);
  if (!m) {
    if (!files_[file]) open_file(file);  // after release()
    files_[file]->check_unchanged(index_->files()[file].identity);
    // Writable only for the CPU allocator's views, which NumPy may write
    // through; Metal's wrapped buffers and the copy modes never write.
    m = std::make_shared<Mapping>(*files_[file], /*writable=*/mode_ == ZeroCopy::Header);
  }
  return m;
}

bool MmapReader::apply(const File& file, const FileIdentity& expected, const Mapping& map,
                       uint64_t offset, uint64_t len, Advice advice,
                       std::atomic<uint64_t>& populated) {
  if (advice == Advice::Evict) return file.advise(offset, len, Advice::Evict);
  if (advice == Advice::Populate) {
    // Queue the exact range's reads in large pieces (posix_fadvise WILLNEED
    // starts them and returns: the kernel caps one call at the device's
    // largest request, so one call per piece keeps them all in flight), then
    // map it: the faults wait for those reads instead of issuing small ones or
    // reading around the range. No byte passes through user space.
    file.check_unchanged(expected);
    constexpr uint64_t kPiece = 4u << 20;
    for (uint64_t done = 0; done < len; done += kPiece)
      file.advise(offset + done, std::min<uint64_t>(kPiece, len - done), Advice::WillNeed);
    return map_in(file, expected, map, offset, len, populated);
  }
  return map.advise(offset, len, advice);
}

bool MmapReader::map_in(const File& file, const FileIdentity& expected, const Mapping& map,
                        uint64_t offset, uint64_t len, std::atomic<uint64_t>& populated) {
  // Mapping pages of a truncated file would fault (SIGBUS on access), and
  // pages of a rewritten one hold other bytes: check before touching them.
  file.check_unchanged(expected);
  file.check_read_fault(offset, len);  // the fault-injection test hook
  populated.fetch_add(len, std::memory_order_relaxed);
  bool ok = map.advise(offset, len, Advice::Populate);  // MADV_POPULATE_READ
  int err = errno;
  file.check_unchanged(expected);  // changed while we read it (ESTALE first)
  errno = err;
  return ok;
}

void MmapReader::check_unchanged() {
  std::vector<std::pair<std::shared_ptr<File>, FileIdentity>> open;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    for (size_t i = 0; i < files_.size(); ++i)
      if (files_[i]) open.emplace_back(files_[i], index_->files()[i].identity);
  }
  for (const auto& [f, id] : open) f->check_unchanged(id);
}

void MmapReader::read_copies(const std::vector<ReadChunk>& copies,
                             const std::atomic<bool>* stop) {
  if (copies.empty()) return;
  {
    uint64_t bytes = 0;
    for (const ReadChunk& c : copies) bytes += c.len;
    TraceSpan span(trace_, "copy", 0, bytes);
    read_chunks_threaded(pool_, copies, stop);
  }
  // A rewrite during the read would have mixed two versions' bytes.
  const File* last = nullptr;
  for (const ReadChunk& c : copies) {
    if (c.file == last) continue;
    last = c.file;
    for (size_t i = 0; i < files_.size(); ++i)
      if (files_[i].get() == c.file) c.file->check_unchanged(index_->files()[i].identity);
  }
}

mx::array MmapReader::make_array(const TensorInfo& t, std::vector<ReadChunk>* deferred,
                                 std::shared_ptr<const void> keep, bool* viewed) {
  if (viewed) *viewed = false;
  const std::string& path = index_->files()[t.file].path;
  auto dtype = to_mlx_dtype(t, path);
  auto shape = to_mlx_shape(t, path);
  auto map = mapping(t.file);
  stats_.tensors++;
  stats_.bytes += t.nbytes;

  // A slice of several ranges (a column block) is always a copy, and so is
  // every tensor in the copy mode (the CUDA allocator, or PYLOADER_ZERO_COPY).
  // A misaligned view only where the CPU reads it: a make_buffer view is
  // bound to GPU kernels at its byte offset, which must be a multiple of the
  // element they load, so there misaligned tensors are copied whatever
  // allow_misaligned says.
  const bool misaligned_ok = options_.allow_misaligned && mode_ == ZeroCopy::Header;
  bool view_ok = t.nbytes > 0 && t.extents.empty() && (t.aligned || misaligned_ok) &&
                 mode_ != ZeroCopy::Copy;
  if (view_ok) {
    // The view keeps the mapping alive (its deleter holds `map`), and `keep`;
    // a wrapped buffer also holds its range against releases (ViewedRanges).
    std::shared_ptr<const void> owner = map;
    if (mode_ == ZeroCopy::MakeBuffer) {
      auto held = viewed_[t.file]->view(t.offset, t.offset + t.nbytes);
      keep = keep ? std::make_shared<std::pair<std::shared_ptr<const void>,
                                               std::shared_ptr<const void>>>(std::move(keep),
                                                                             std::move(held))
                  : std::move(held);
    }
    if (keep)
      owner = std::make_shared<std::pair<std::shared_ptr<Mapping>, std::shared_ptr<const void>>>(
          map, std::move(keep));
    if (auto view = view_of(mode_, std::move(owner), map->mutable_data(), map->size(), t.offset,
                            t.nbytes, shape, dtype)) {
      stats_.zero_copy_tensors++;
      stats_.zero_copy_bytes += t.nbytes;
      if (viewed) *viewed = true;
      return std::move(*view);
    }
    // This MLX would not wrap it (make_buffer returned null, or a header
    // view that points elsewhere): never hand out a view that is not the
    // tensor. Copy instead, and say so in the stats.
    stats_.zero_copy_verified = false;
  }
  mx::array a(mx::allocator::malloc(t.nbytes), std::move(shape), dtype);
  uint8_t* dst = a.data<uint8_t>();
  if (t.nbytes && !dst) throw std::bad_alloc();
  // Huge pages for a copy in host memory (its 2 MiB-aligned part; PYLOADER_HUGE_PAGES=0
  // turns them off): each decode step streams every weight once, and over 4 KiB pages
  // it misses the TLB where a view of the page cache's 2 MiB folios does not.
  if (buffer_owner() == BufferOwner::Cpu) advise_huge_pages(dst, t.nbytes);
  // Copies are read from the file, not the mapping: the mapping's pages would
  // otherwise stay in this process's RSS beside the copy. In a batch they are
  // queued and read in parallel chunks by load()/load_all().
  constexpr uint64_t kChunk = 16ull << 20;
  if (t.nbytes && deferred) {
    for (const Extent& e : extents_of(t)) {
      for (uint64_t done = 0; done < e.len; done += kChunk)
        deferred->push_back({files_[t.file].get(), e.offset + done, dst + done,
                             static_cast<size_t>(std::min(kChunk, e.len - done))});
      dst += e.len;
    }
  } else if (t.nbytes) {
    for (const Extent& e : extents_of(t)) {
      files_[t.file]->read_exact(dst, e.len, e.offset);
      dst += e.len;
    }
    files_[t.file]->check_unchanged(index_->files()[t.file].identity);
  }
  if (t.nbytes) {
    stats_.copied_tensors++;
    stats_.copied_bytes += t.nbytes;
    stats_.bytes_read += t.nbytes;
  } else {
    stats_.zero_copy_tensors++;  // empty: nothing to copy
  }
  return a;
}

mx::array MmapReader::get(const std::string& name) {
  const TensorInfo& t = index_->at(name);
  std::lock_guard<std::mutex> lk(mutex_);
  return make_array(t);
}

NamedArrays MmapReader::load(const std::vector<std::string>& names,
                             const std::atomic<bool>* stop) {
  NamedArrays out;
  out.reserve(names.size());
  std::vector<ReadChunk> copies;
  std::lock_guard<std::mutex> lk(mutex_);
  for (const auto& n : names) out.emplace_back(n, make_array(index_->at(n), &copies));
  read_copies(copies, stop);
  return out;
}

NamedArrays MmapReader::load_all(const std::atomic<bool>* stop) {
  NamedArrays out;
  out.reserve(index_->tensors().size());
  std::vector<ReadChunk> copies;
  std::lock_guard<std::mutex> lk(mutex_);
  for (const auto& t : index_->tensors()) out.emplace_back(t.name, make_array(t, &copies));
  read_copies(copies, stop);
  return out;
}

bool MmapReader::advise_tensor(const std::string& name, Advice advice) {
  const TensorInfo& t = index_->at(name);
  bool ok = true;
  for (const Extent& e : extents_of(t)) ok = advise_range(t.file, e.offset, e.len, advice) && ok;
  return ok;
}

bool MmapReader::advise_range(uint32_t file, uint64_t offset, uint64_t len,
                              Advice advice) {
  if (file >= index_->files().size())
    throw std::out_of_range("file index " + std::to_string(file) + " out of range");
  std::shared_ptr<Mapping> map;
  std::shared_ptr<File> f;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    map = mapping(file);
    f = exact_files_[file];
  }
  return apply(*f, index_->files()[file].identity, *map, offset, len, advice, populate_bytes_);
}

uint64_t MmapReader::resident_bytes(const std::string& name) {
  const TensorInfo& t = index_->at(name);
  std::lock_guard<std::mutex> lk(mutex_);
  auto map = mapping(t.file);
  uint64_t n = 0;
  for (const Extent& e : extents_of(t)) n += map->resident_bytes(e.offset, e.len);
  return n;
}

namespace {

// A thread running `work` (which polls the flag it is given), told to stop
// and joined on destruction.
class StoppableThread {
 public:
  explicit StoppableThread(std::function<void(const std::atomic<bool>&)> work)
      : thread_([this, work = std::move(work)] { work(stop_); }) {}
  StoppableThread(const StoppableThread&) = delete;
  StoppableThread& operator=(const StoppableThread&) = delete;
  ~StoppableThread() {
    stop_.store(true);
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;  // after stop_: started once it exists
};

// Holds a StoppableThread that does not exist yet (the views must hold it
// before the ranges they cover are known).
struct PopulateHolder {
  std::unique_ptr<StoppableThread> thread;
};

}  // namespace

NamedArrays MmapReader::load_overlapped(const std::optional<std::vector<std::string>>& names) {
  std::vector<const TensorInfo*> wanted;
  if (names) {
    for (const auto& n : *names) wanted.push_back(&index_->at(n));
  } else {
    for (const auto& t : index_->tensors()) wanted.push_back(&t);
  }
  auto holder = std::make_shared<PopulateHolder>();
  NamedArrays out;
  out.reserve(wanted.size());
  std::vector<Range> ranges;
  {
    std::vector<ReadChunk> copies;
    std::lock_guard<std::mutex> lk(mutex_);
    for (const TensorInfo* t : wanted) {
      bool viewed = false;
      out.emplace_back(t->name, make_array(*t, &copies, holder, &viewed));
      if (viewed)
        ranges.push_back({mapping(t->file), viewed_[t->file], exact_files_[t->file],
                          index_->files()[t->file].identity, t->offset, t->nbytes});
    }
    read_copies(copies, nullptr);
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.map != b.map ? a.map->path() < b.map->path() : a.offset < b.offset;
  });
  // Started only now, so an error above leaves no thread behind; the
  // holder dies with the last view (joining the thread), never on the thread.
  holder->thread = std::make_unique<StoppableThread>(
      [ranges = std::move(ranges), counter = overlapped_populate_bytes_](
          const std::atomic<bool>& stop) {
        // MADV_POPULATE_READ alone, 8 MiB at a time: its faults take the
        // kernel's own readahead, which reads in large folios, while a
        // WILLNEED ahead of it (posix_fadvise, readahead()) reads in single
        // pages. Measured here, 1 GiB cold (bench/first_use.py, 5 runs): every
        // byte used in 0.44 s this way, 0.93 s with WILLNEED pieces first
        // (and 0.60 s with no populate at all).
        constexpr uint64_t kPiece = 8ull << 20;
        try {
          for (const Range& r : ranges)
            for (uint64_t done = 0; done < r.len; done += kPiece) {
              if (stop.load(std::memory_order_relaxed)) return;
              if (!map_in(*r.file, r.identity, *r.map, r.offset + done,
                          std::min(kPiece, r.len - done), *counter))
                return;
            }
        } catch (...) {
          // Advisory: the views' page faults read what was not populated
          // (and the SIGBUS guard covers a truncated file).
        }
      });
  return out;
}

std::vector<MmapReader::Range> MmapReader::ranges_of(const std::vector<std::string>& names) {
  std::vector<Range> ranges;
  std::lock_guard<std::mutex> lk(mutex_);
  for (const auto& n : names) {
    const TensorInfo& t = index_->at(n);
    auto map = mapping(t.file);
    for (const Extent& e : extents_of(t))
      ranges.push_back({map, viewed_[t.file], exact_files_[t.file], index_->files()[t.file].identity,
                        e.offset, e.len});
  }
  return ranges;
}

uint64_t MmapReader::prefetch(const std::vector<std::string>& names, Advice advice) {
  std::vector<Range> jobs = ranges_of(names);
  uint64_t bytes = 0;
  for (const auto& n : names) bytes += index_->at(n).nbytes;
  // The queue is joined before the reader's members are destroyed, so the
  // counter and the trace outlive every job.
  uint64_t drops_before;
  {
    std::lock_guard<std::mutex> lk(drops_mutex_);
    drops_before = drops_submitted_;
  }
  return queue_->submit([this, jobs = std::move(jobs), advice, bytes, drops_before,
                         counter = &populate_bytes_, trace = &trace_](uint64_t ticket) {
    {
      // Drops of these pages released before this request must not undo it.
      std::unique_lock<std::mutex> lk(drops_mutex_);
      drops_cv_.wait(lk, [&] { return drops_done_ >= drops_before; });
    }
    TraceSpan span(*trace, advice_name(advice), ticket, bytes);
    for (const auto& j : jobs)
      if (!apply(*j.file, j.identity, *j.map, j.offset, j.len, advice, *counter) &&
          advice == Advice::Populate)
        // Only MADV_POPULATE_READ returns a failure (populate_for_read).
        throw IoError("madvise(MADV_POPULATE_READ)", j.map->path(), errno,
                      static_cast<int64_t>(j.offset));
  });
}

void MmapReader::drop(const std::vector<std::string>& names, bool evict) {
  std::vector<Range> ranges = ranges_of(names);
  uint64_t bytes = 0;
  for (const Range& r : ranges) bytes += r.len;
  {
    std::lock_guard<std::mutex> lk(drops_mutex_);
    ++drops_submitted_;
  }
  // drops_ is joined before the reader's members are destroyed.
  drops_->post([this, ranges = std::move(ranges), evict, bytes] {
    try {
      {
        TraceSpan span(trace_, "release", 0, bytes);
        // Not under a wrapped buffer that still lives: then once it is gone.
        for (const Range& r : ranges)
          r.viewed->release(r.offset, r.offset + r.len, [map = r.map, off = r.offset, len = r.len] {
            map->advise(off, len, Advice::DontNeed);
          });
      }
      if (evict) {
        TraceSpan span(trace_, "release-evict", 0, bytes);
        for (const Range& r : ranges) r.file->advise(r.offset, r.len, Advice::Evict);
      }
    } catch (...) {
      // Advisory (the trace's allocation is all that can throw): still counted below.
    }
    {
      std::lock_guard<std::mutex> lk(drops_mutex_);
      ++drops_done_;
    }
    drops_cv_.notify_all();
  });
}

void MmapReader::settle() {
  queue_->settle();
  drops_->settle();
}

void MmapReader::wait(uint64_t ticket) { queue_->wait(ticket); }
bool MmapReader::ready(uint64_t ticket) const { return queue_->done(ticket); }
bool MmapReader::cancel(uint64_t ticket) { return queue_->cancel(ticket); }

ReaderStats MmapReader::stats() const {
  std::lock_guard<std::mutex> lk(mutex_);
  ReaderStats s = stats_;
  s.zero_copy_mode = zero_copy_name(mode_);
  s.populate_bytes = populate_bytes_.load(std::memory_order_relaxed) +
                     overlapped_populate_bytes_->load(std::memory_order_relaxed);
  return s;
}

size_t MmapReader::live_mappings() const {
  std::lock_guard<std::mutex> lk(mutex_);
  size_t n = 0;
  for (const auto& m : maps_) n += m != nullptr;
  return n;
}

void MmapReader::release() {
  std::lock_guard<std::mutex> lk(mutex_);
  for (auto& m : maps_) m.reset();
  for (auto& f : files_) f.reset();
  for (auto& f : exact_files_) f.reset();
}

}  // namespace pyloader
