#include "mlxio/pread_reader.h"

#include <algorithm>
#include <cerrno>
#include <new>

#include "core/errors.h"
#include "core/file.h"

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
                              const std::atomic<bool>* stop) {
  return read(lookup(names), stop);
}

NamedArrays PreadReader::load_all(const std::atomic<bool>* stop) {
  std::vector<const TensorInfo*> wanted;
  wanted.reserve(index_->tensors().size());
  for (const auto& t : index_->tensors()) wanted.push_back(&t);
  return read(wanted, stop);
}

NamedArrays PreadReader::read(const std::vector<const TensorInfo*>& wanted,
                              const std::atomic<bool>* stop, uint64_t ticket) {
  uint64_t total = 0;
  for (const TensorInfo* t : wanted) total += t->nbytes;
  TraceSpan reading(trace_, "read", ticket, total);
  // Allocate every destination first so a failure happens before any I/O.
  NamedArrays out;
  out.reserve(wanted.size());
  std::vector<int> file_used(index_->files().size(), 0);
  struct Span { uint32_t file; uint64_t offset; uint8_t* dst; uint64_t len; };
  std::vector<Span> spans;
  for (const TensorInfo* t : wanted) {
    uint8_t* dst = nullptr;
    out.emplace_back(t->name, allocate_array(*t, index_->files()[t->file].path, &dst));
    if (t->nbytes && !dst) throw std::bad_alloc();
    file_used[t->file] = 1;
    for (const Extent& e : extents_of(*t)) {  // a column block: one range per row
      spans.push_back({t->file, e.offset, dst, e.len});
      dst += e.len;
    }
  }

  for (size_t i = 0; i < files_.size(); ++i)
    if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
  std::vector<ReadChunk> chunks;
  for (const Span& s : spans)
    for (uint64_t done = 0; done < s.len; done += options_.chunk_bytes)
      chunks.push_back({files_[s.file].get(), s.offset + done, s.dst + done,
                        static_cast<size_t>(std::min<uint64_t>(options_.chunk_bytes, s.len - done))});
  // Read in file order: sequential runs per file help readahead.
  std::sort(chunks.begin(), chunks.end(), [](const ReadChunk& a, const ReadChunk& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  {
    std::lock_guard<std::mutex> io(io_mutex_);
    if (uring_) uring_->read(chunks);
    else read_chunks_threaded(pool_, chunks, stop);
  }
  // A rewrite during the read would have mixed two versions' bytes.
  for (size_t i = 0; i < files_.size(); ++i)
    if (file_used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
  reading.finish();
  if (options_.drop_cache) {
    TraceSpan evicting(trace_, "evict", ticket, total);
    for (const ReadChunk& c : chunks) c.file->advise(c.offset, c.len, Advice::Evict);
  }

  std::lock_guard<std::mutex> lk(stats_mutex_);
  stats_.tensors += wanted.size();
  stats_.bytes += total;
  stats_.bytes_read += total;
  stats_.copied_tensors += wanted.size();
  stats_.copied_bytes += total;
  return out;
}

uint64_t PreadReader::submit(const std::vector<std::string>& names) {
  auto wanted = lookup(names);  // unknown names fail here, at submit time
  return queue_->submit([this, wanted](uint64_t ticket) {
    NamedArrays arrays = read(wanted, nullptr, ticket);
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
  std::lock_guard<std::mutex> lk(stats_mutex_);
  return stats_;
}

}  // namespace pyloader
