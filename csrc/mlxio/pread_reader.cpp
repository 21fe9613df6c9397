#include "mlxio/pread_reader.h"

#include <algorithm>
#include <cerrno>
#include <new>

#include "core/errors.h"
#include "core/file.h"
#include "mlxio/mlx_buffers.h"
#include "mlxio/tensor_reads.h"

namespace mx = mlx::core;

namespace pyloader {

PreadReader::PreadReader(std::shared_ptr<const TensorIndex> index, PreadOptions options)
    : index_(std::move(index)),
      options_(options),
      pool_(pool_threads(options.backend, options.threads)) {
  if (options_.chunk_bytes == 0) options_.chunk_bytes = kDefaultPreadChunk;
  if (options_.backend == ReadBackend::IoUring) uring_ = std::make_unique<UringReader>(64);
  // Every file is opened now and kept: reads go through these descriptors even
  // once the files' paths are gone (a temporary directory deleted under a
  // streamed model), as a fully read model would not notice either.
  files_.reserve(index_->files().size());
  for (const auto& f : index_->files()) {
    files_.push_back(std::make_unique<File>(File::open_read(f.path)));
    files_.back()->check_unchanged(f.identity);
    if (!options_.readahead) files_.back()->advise(0, 0, Advice::Random);
    direct_files_.push_back(options_.direct ? open_direct_or_null(f.path) : nullptr);
  }
  queue_ = std::make_unique<WorkQueue>(1);
}

PreadReader::~PreadReader() { queue_.reset(); }

std::vector<const TensorInfo*> PreadReader::lookup(const std::vector<std::string>& names) const {
  std::vector<const TensorInfo*> wanted;
  wanted.reserve(names.size());
  for (const auto& n : names) wanted.push_back(&index_->at(n));
  return wanted;
}

NamedArrays PreadReader::load(const std::vector<std::string>& names,
                              const std::atomic<bool>* stop, bool reuse) {
  return read(lookup(names), stop, 0, reuse);
}

NamedArrays PreadReader::load_all(const std::atomic<bool>* stop) {
  std::vector<const TensorInfo*> wanted;
  wanted.reserve(index_->tensors().size());
  for (const auto& t : index_->tensors()) wanted.push_back(&t);
  return read(wanted, stop);
}

NamedArrays PreadReader::load_overlapped(
    const std::optional<std::vector<std::string>>& names) {
  std::vector<const TensorInfo*> wanted;
  if (names) {
    wanted = lookup(*names);
  } else {
    wanted.reserve(index_->tensors().size());
    for (const auto& t : index_->tensors()) wanted.push_back(&t);
  }
  auto reads = std::make_shared<OverlappedRead>(index_, std::move(wanted), options_.threads,
                                                options_.chunk_bytes, options_.direct,
                                                overlapped_stats_);
  return OverlappedRead::arrays(reads);
}

NamedArrays PreadReader::read(const std::vector<const TensorInfo*>& wanted,
                              const std::atomic<bool>* stop, uint64_t ticket, bool reuse) {
  NamedArrays out;
  if (reuse && read_into_slot(wanted, stop, ticket, out)) return out;
  uint64_t total = 0;
  for (const TensorInfo* t : wanted) total += t->nbytes;
  TraceSpan reading(trace_, "read", ticket, total);
  // Allocate every destination first so a failure happens before any I/O.
  out.reserve(wanted.size());
  std::vector<int> file_used(index_->files().size(), 0);
  std::vector<ReadChunk> chunks;
  uint64_t direct_bytes = 0;
  for (const TensorInfo* t : wanted) {
    const std::string& path = index_->files()[t->file].path;
    ReadTarget target = place_tensor_read(
        *t, {files_[t->file].get(), direct_files_[t->file].get()}, options_.chunk_bytes, chunks);
    direct_bytes += target.direct_bytes;
    mx::allocator::Buffer buffer = target.data->buffer();
    out.emplace_back(t->name, region_array(std::move(target.data), buffer, target.offset,
                                           to_mlx_shape(*t, path), to_mlx_dtype(*t, path)));
    file_used[t->file] = 1;
  }

  for (size_t i = 0; i < files_.size(); ++i)
    if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
  // Read in file order: sequential runs per file help readahead.
  std::sort(chunks.begin(), chunks.end(), [](const ReadChunk& a, const ReadChunk& b) {
    return a.file->path() != b.file->path() ? a.file->path() < b.file->path()
                                            : a.offset < b.offset;
  });
  {
    std::lock_guard<std::mutex> io(io_mutex_);
    read_checked(chunks, stop, file_used);
  }
  // A rewrite during the read would have mixed two versions' bytes.
  for (size_t i = 0; i < files_.size(); ++i)
    if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
  reading.finish();
  if (options_.drop_cache && direct_bytes < total) {
    TraceSpan evicting(trace_, "evict", ticket, total - direct_bytes);
    for (const ReadChunk& c : chunks)
      if (!c.file->direct()) c.file->advise(c.offset, c.len, Advice::Evict);
  }

  bool missed;
  {
    std::lock_guard<std::mutex> rl(ring_mutex_);
    missed = reuse && ring_ != nullptr;
  }
  count_read(wanted.size(), total, missed ? Into::Fresh : Into::Plain, direct_bytes);
  return out;
}

void PreadReader::count_read(size_t tensors, uint64_t bytes, Into into, uint64_t direct) {
  std::lock_guard<std::mutex> lk(stats_mutex_);
  stats_.tensors += tensors;
  stats_.bytes += bytes;
  stats_.bytes_read += bytes;
  stats_.copied_tensors += tensors;
  stats_.copied_bytes += bytes;
  stats_.buffer_reuses += into == Into::Slot;
  stats_.buffer_misses += into == Into::Fresh;
  stats_.direct_bytes += direct;
}

void PreadReader::read_checked(const std::vector<ReadChunk>& chunks,
                               const std::atomic<bool>* stop,
                               const std::vector<int>& file_used) {
  try {
    if (uring_) uring_->read(chunks);
    else read_chunks_threaded(pool_, chunks, stop);
  } catch (const IoError&) {
    // A file truncated under the read ends it early (EIO, end of file): say
    // what changed (ESTALE) rather than the symptom.
    for (size_t i = 0; i < files_.size(); ++i)
      if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
    throw;
  }
}

namespace {

constexpr uint64_t kAlign = kDirectAlign;

uint64_t align_down(uint64_t x) { return x / kAlign * kAlign; }
uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Where each tensor goes in a slot: its bytes start at `data`, at the same
// position within a page as in the file, on pages of its own (the bytes
// before it in its first page are read along by O_DIRECT); `end` is past its
// last page.
struct Placement {
  uint64_t data, end;
};

std::vector<Placement> place(const std::vector<const TensorInfo*>& wanted) {
  std::vector<Placement> out;
  out.reserve(wanted.size());
  uint64_t pos = 0;
  for (const TensorInfo* t : wanted) {
    uint64_t page = align_up(pos);
    uint64_t data = page + (t->offset - align_down(t->offset));
    uint64_t end = page + (align_up(t->offset + t->nbytes) - align_down(t->offset));
    out.push_back({data, end});
    pos = end;
  }
  return out;
}

}  // namespace

uint64_t PreadReader::layout_bytes(const std::vector<std::string>& names) const {
  auto placed = place(lookup(names));
  return placed.empty() ? 0 : placed.back().end;
}

void PreadReader::reserve_buffers(size_t slots, size_t slot_bytes, bool direct) {
  std::shared_ptr<BufferRing> ring;
  if (slots > 0 && slot_bytes > 0) ring = BufferRing::create(slots, slot_bytes);
  bool any_direct = false;
  for (const auto& f : direct_files_) any_direct = any_direct || f != nullptr;
  std::lock_guard<std::mutex> io(io_mutex_);  // no read is using the old ring
  std::lock_guard<std::mutex> lk(ring_mutex_);
  ring_direct_ = ring && direct && any_direct;
  ring_ = std::move(ring);
}

size_t PreadReader::buffer_slots() const {
  std::lock_guard<std::mutex> lk(ring_mutex_);
  return ring_ ? ring_->slots() : 0;
}

size_t PreadReader::ring_buffers() const {
  std::lock_guard<std::mutex> lk(ring_mutex_);
  return ring_ ? ring_->buffers() : 0;
}

size_t PreadReader::buffers_lent() const {
  std::lock_guard<std::mutex> lk(ring_mutex_);
  return ring_ ? ring_->lent() : 0;
}

bool PreadReader::direct() const {
  std::lock_guard<std::mutex> lk(ring_mutex_);
  return ring_direct_;
}

bool PreadReader::read_into_slot(const std::vector<const TensorInfo*>& wanted,
                                 const std::atomic<bool>* stop, uint64_t ticket,
                                 NamedArrays& out) {
  std::shared_ptr<BufferRing> ring;
  bool direct;
  {
    std::lock_guard<std::mutex> lk(ring_mutex_);
    ring = ring_;
    direct = ring_direct_;
  }
  if (!ring || wanted.empty()) return false;
  for (const TensorInfo* t : wanted)
    if (extents_of(*t).size() != 1 || t->nbytes == 0) return false;
  auto placed = place(wanted);
  if (placed.back().end > ring->slot_bytes()) return false;
  BufferRing::Lease lease = ring->acquire();
  if (!lease.data) return false;
  const std::shared_ptr<uint8_t>& slot = lease.data;

  uint64_t total = 0;
  for (const TensorInfo* t : wanted) total += t->nbytes;
  TraceSpan reading(trace_, "read", ticket, total);
  std::vector<int> file_used(index_->files().size(), 0);
  for (const TensorInfo* t : wanted) file_used[t->file] = 1;
  for (size_t i = 0; i < files_.size(); ++i)
    if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);

  std::unique_lock<std::mutex> io(io_mutex_);
  std::vector<ReadChunk> chunks, buffered;
  uint64_t direct_bytes = 0;
  for (size_t k = 0; k < wanted.size(); ++k) {
    const TensorInfo& t = *wanted[k];
    direct_bytes += append_contiguous_reads(
        t, slot.get() + placed[k].data,
        {files_[t.file].get(), direct ? direct_files_[t.file].get() : nullptr},
        options_.chunk_bytes, chunks, buffered);
  }
  chunks.insert(chunks.end(), buffered.begin(), buffered.end());
  read_checked(chunks, stop, file_used);
  io.unlock();
  for (size_t i = 0; i < files_.size(); ++i)
    if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
  reading.finish();
  if (options_.drop_cache && !buffered.empty()) {
    TraceSpan evicting(trace_, "evict", ticket, total - direct_bytes);
    for (const ReadChunk& c : buffered) c.file->advise(c.offset, c.len, Advice::Evict);
  }

  // Every array holds the slot: it returns to the ring when the last is gone.
  // The arrays are regions of the slot's allocator buffer, at their offsets.
  out.reserve(wanted.size());
  for (size_t k = 0; k < wanted.size(); ++k) {
    const TensorInfo& t = *wanted[k];
    const std::string& path = index_->files()[t.file].path;
    out.emplace_back(t.name, region_array(slot, lease.buffer, lease.offset + placed[k].data,
                                          to_mlx_shape(t, path), to_mlx_dtype(t, path)));
  }
  count_read(wanted.size(), total, Into::Slot, direct_bytes);
  return true;
}

uint64_t PreadReader::submit(const std::vector<std::string>& names, bool reuse) {
  auto wanted = lookup(names);  // unknown names fail here, at submit time
  return queue_->submit([this, wanted, reuse](uint64_t ticket) {
    NamedArrays arrays = read(wanted, nullptr, ticket, reuse);
    std::lock_guard<std::mutex> lk(results_mutex_);
    results_[ticket] = std::move(arrays);
  });
}

NamedArrays PreadReader::take(uint64_t ticket) {
  queue_->wait(ticket);
  std::lock_guard<std::mutex> lk(results_mutex_);
  auto it = results_.find(ticket);
  NamedArrays out = std::move(it->second);
  results_.erase(it);
  return out;
}

bool PreadReader::ready(uint64_t ticket) const { return queue_->done(ticket); }

bool PreadReader::cancel(uint64_t ticket) {
  bool dropped = queue_->cancel(ticket);
  if (!dropped && queue_->done(ticket)) {
    queue_->cancel(ticket);  // finished: forget it and its arrays
    std::lock_guard<std::mutex> lk(results_mutex_);
    results_.erase(ticket);
  }
  return dropped;
}

ReaderStats PreadReader::stats() const {
  ReaderStats s;
  {
    std::lock_guard<std::mutex> lk(stats_mutex_);
    s = stats_;
  }
  std::lock_guard<std::mutex> lk(overlapped_stats_->mutex);
  const ReaderStats& o = overlapped_stats_->stats;
  s.tensors += o.tensors;
  s.bytes += o.bytes;
  s.bytes_read += o.bytes_read;
  s.copied_tensors += o.copied_tensors;
  s.copied_bytes += o.copied_bytes;
  s.failed_tensors += o.failed_tensors;
  s.direct_bytes += o.direct_bytes;
  return s;
}

}  // namespace pyloader
