#include "mlxio/overlapped_read.h"

#include <algorithm>
#include <new>

#include "core/errors.h"
#include "core/read_chunks.h"
#include "mlxio/mlx_buffers.h"
#include "mlxio/tensor_reads.h"

namespace mx = mlx::core;

namespace pyloader {

OverlappedRead::OverlappedRead(std::shared_ptr<const TensorIndex> index,
                               std::vector<const TensorInfo*> wanted, size_t threads,
                               size_t chunk_bytes, bool direct,
                               std::shared_ptr<SharedStats> stats)
    : index_(std::move(index)),
      stats_(std::move(stats)),
      pool_(pool_threads(ReadBackend::Threads, threads)) {
  if (chunk_bytes == 0) chunk_bytes = 2ull << 20;
  files_.resize(index_->files().size());
  direct_files_.resize(index_->files().size());
  tensors_.reserve(wanted.size());
  uint64_t total = 0;
  for (const TensorInfo* t : wanted) {
    const std::string& path = index_->files()[t->file].path;
    auto tensor = std::make_unique<Tensor>();
    tensor->info = t;
    tensor->shape = to_mlx_shape(*t, path);
    tensor->dtype = to_mlx_dtype(*t, path);
    if (!files_[t->file]) {
      files_[t->file] = std::make_unique<File>(File::open_read(path));
      files_[t->file]->check_unchanged(index_->files()[t->file].identity);
      if (direct) direct_files_[t->file] = open_direct_or_null(path);
    }
    tensors_.push_back(std::move(tensor));
    total += t->nbytes;
  }
  // Every buffer before any read, as the eager load does.
  std::vector<ReadChunk> reads;
  uint64_t direct_bytes = 0;
  for (size_t k = 0; k < tensors_.size(); ++k) {
    Tensor& t = *tensors_[k];
    const uint32_t file = t.info->file;
    reads.clear();
    ReadTarget target = place_tensor_read(
        *t.info, {files_[file].get(), direct_files_[file].get()}, chunk_bytes, reads);
    t.buffer = std::move(target.data);
    t.offset = target.offset;
    direct_bytes += target.direct_bytes;
    for (const ReadChunk& r : reads) chunks_.push_back({k, r.file, r.offset, r.dst, r.len});
    t.chunks_left.store(reads.size());
    t.done = reads.empty();  // empty: nothing to read
  }
  std::sort(chunks_.begin(), chunks_.end(), [this](const Chunk& a, const Chunk& b) {
    uint32_t fa = tensors_[a.tensor]->info->file, fb = tensors_[b.tensor]->info->file;
    return fa != fb ? fa < fb : a.offset < b.offset;
  });
  {
    std::lock_guard<std::mutex> lk(stats_->mutex);
    stats_->stats.tensors += tensors_.size();
    stats_->stats.bytes += total;
    stats_->stats.direct_bytes += direct_bytes;  // the direct reads planned
    for (const auto& t : tensors_) stats_->stats.copied_tensors += t->done;  // empty ones
  }
  driver_ = std::thread([this] { run(); });
}

OverlappedRead::~OverlappedRead() {
  stop_.store(true);
  if (driver_.joinable()) driver_.join();
}

NamedArrays OverlappedRead::arrays(const std::shared_ptr<OverlappedRead>& self) {
  // On the CPU stream, as mx.load's arrays are: the primitive does no compute.
  const mx::Stream stream = mx::default_stream(mx::Device::cpu);
  NamedArrays out;
  out.reserve(self->tensors_.size());
  for (size_t k = 0; k < self->tensors_.size(); ++k) {
    const Tensor& t = *self->tensors_[k];
    out.emplace_back(t.info->name, mx::array(t.shape, t.dtype,
                                             std::make_shared<AwaitRead>(stream, self, k),
                                             std::vector<mx::array>{}));
  }
  return out;
}

void OverlappedRead::run() {
  // As read_chunks_threaded: ask for the next chunks ahead (WILLNEED), so a
  // few threads keep the device queue deep.
  constexpr size_t kLookahead = 4;
  auto ask = [&](const Chunk& c) {  // not for direct reads: no page cache to fill
    if (!c.file->direct()) c.file->advise(c.offset, c.len, Advice::WillNeed);
  };
  for (size_t j = 0; j < std::min(kLookahead, chunks_.size()); ++j) ask(chunks_[j]);
  // Every job catches its own error: one failed tensor must not skip the
  // others' reads (ThreadPool::run skips the rest after a throw).
  pool_.run(chunks_.size(), [&](size_t i) {
    const Chunk& c = chunks_[i];
    Tensor& t = *tensors_[c.tensor];
    const File& file = *c.file;
    if (stop_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lk(t.error_mutex);
      if (!t.error) t.error = std::make_exception_ptr(Interrupted("read cancelled"));
    } else {
      try {
        if (i + kLookahead < chunks_.size()) ask(chunks_[i + kLookahead]);
        if (!file.direct()) prefault_for_write(c.dst, c.len);  // a direct read faults them in
        file.read_exact(c.dst, c.len, c.offset);
      } catch (...) {
        std::lock_guard<std::mutex> lk(t.error_mutex);
        if (!t.error) t.error = std::current_exception();
      }
    }
    if (t.chunks_left.fetch_sub(1) != 1) return;
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lk(t.error_mutex);
      error = t.error;
    }
    // A file truncated or rewritten under the read: say what changed
    // (ESTALE) rather than the symptom, and never hand out mixed bytes.
    try {
      file.check_unchanged(index_->files()[t.info->file].identity);
    } catch (...) {
      error = std::current_exception();
    }
    finish(c.tensor, error);
  });
}

void OverlappedRead::finish(size_t k, std::exception_ptr error) {
  Tensor& t = *tensors_[k];
  {
    std::lock_guard<std::mutex> lk(stats_->mutex);
    if (error) {
      stats_->stats.failed_tensors++;
    } else {
      stats_->stats.bytes_read += t.info->nbytes;
      stats_->stats.copied_tensors++;
      stats_->stats.copied_bytes += t.info->nbytes;
    }
  }
  {
    std::lock_guard<std::mutex> lk(mutex_);
    t.error = std::move(error);
    t.done = true;
  }
  done_cv_.notify_all();
}

std::pair<std::shared_ptr<mx::allocator::Data>, size_t> OverlappedRead::wait(size_t k) {
  Tensor& t = *tensors_[k];
  std::unique_lock<std::mutex> lk(mutex_);
  done_cv_.wait(lk, [&] { return t.done; });
  if (t.error) std::rethrow_exception(t.error);
  return {t.buffer, t.offset};
}

void AwaitRead::take(mx::array& out) {
  auto [data, offset] = reads_->wait(tensor_);
  // The array's data is the buffer the reads filled (a region of it at the
  // tensor's offset, keeping it alive), not a copy.
  mx::allocator::Buffer buffer = data->buffer();
  out.copy_shared_buffer(region_array(std::move(data), buffer, offset, out.shape(), out.dtype()));
}

void AwaitRead::eval_cpu(const std::vector<mx::array>&, mx::array& out) { take(out); }

// Evaluation waits on the host either way: the reads fill allocator memory the
// GPU then uses as is (Metal: unified memory; CUDA: managed memory).
void AwaitRead::eval_gpu(const std::vector<mx::array>&, mx::array& out) { take(out); }

}  // namespace pyloader
