#include "mlxio/expert_bank.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "core/checked.h"
#include "core/errors.h"
#include "mlxio/mlx_buffers.h"
#include "mlxio/tensor_arrays.h"

namespace mx = mlx::core;

namespace pyloader {

// ---------------------------------------------------------------------------
// ExpertBank

ExpertBank::ExpertBank(const TensorIndex* index, std::vector<Tensor> tensors, uint32_t experts,
                       uint32_t slots, uint64_t expert_bytes, size_t total, bool populate)
    : index_(index),
      tensors_(std::move(tensors)),
      experts_(experts),
      slots_(slots),
      expert_bytes_(expert_bytes),
      memory_(total, populate, "an expert bank",
              "Give the expert cache fewer slots (experts=) or free memory.") {}

namespace {

// The bank's layout: one region per tensor, each [slots + 1] experts of
// `strides[t]` bytes, starting on a kRegionAlign boundary of the buffer.
// Returns the total bytes; fills `offsets` when given.
uint64_t place(const std::vector<uint64_t>& strides, uint32_t slots,
               std::vector<size_t>* offsets) {
  uint64_t offset = 0;
  for (uint64_t stride : strides) {
    auto bytes = checked_mul(stride, static_cast<uint64_t>(slots) + 1);
    auto end = bytes ? checked_add(offset, *bytes) : std::nullopt;
    auto next = end ? checked_add(*end, kRegionAlign - 1) : std::nullopt;
    if (!next) throw AllocationError("[ExpertBank] bank size overflows");
    if (offsets) offsets->push_back(static_cast<size_t>(offset));
    offset = *next / kRegionAlign * kRegionAlign;
  }
  return offset;
}

}  // namespace

uint64_t ExpertBank::layout_bytes(const std::vector<uint64_t>& strides, uint32_t slots) {
  return place(strides, slots, nullptr);
}

std::shared_ptr<ExpertBank> ExpertBank::create(const TensorIndex& index,
                                               const std::vector<std::string>& names,
                                               uint32_t slots, bool populate) {
  if (names.empty()) throw std::invalid_argument("[ExpertBank] no tensors");
  if (slots == 0) throw std::invalid_argument("[ExpertBank] a bank needs at least one slot");
  std::vector<Tensor> tensors;
  std::vector<uint64_t> strides;
  uint32_t experts = 0;
  for (const auto& name : names) {
    const TensorInfo& t = index.at(name);
    const std::string& file = index.files()[t.file].path;
    if (t.shape.empty() || t.shape[0] == 0)
      throw std::invalid_argument("[ExpertBank] " + file + ": tensor '" + name +
                                  "' has no expert dimension (shape " +
                                  std::to_string(t.shape.size()) + "-D)");
    if (!t.extents.empty())
      throw std::invalid_argument("[ExpertBank] " + file + ": tensor '" + name +
                                  "' is a strided slice; an expert must be one byte range");
    if (experts == 0) experts = static_cast<uint32_t>(t.shape[0]);
    if (t.shape[0] != experts)
      throw std::invalid_argument("[ExpertBank] " + file + ": tensor '" + name + "' stacks " +
                                  std::to_string(t.shape[0]) + " experts, the layer's first " +
                                  "tensor " + std::to_string(experts));
    mx::Shape shape = to_mlx_shape(t, file);
    shape[0] = static_cast<int>(slots) + 1;
    uint64_t stride = t.nbytes / t.shape[0];
    tensors.push_back({name, t.file, t.offset, stride, 0, std::move(shape),
                       to_mlx_dtype(t, file)});
    strides.push_back(stride);
  }
  std::vector<size_t> offsets;
  uint64_t total = place(strides, slots, &offsets);
  uint64_t expert_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].offset = offsets[i];
    expert_bytes += strides[i];
  }
  auto bank = std::shared_ptr<ExpertBank>(new ExpertBank(
      &index, std::move(tensors), experts, slots, expert_bytes, total, populate));
  for (const auto& t : bank->tensors_) {
    // The scratch slot (routing that must not reach a real expert) reads zeros.
    std::memset(bank->memory_.data() + t.offset + t.stride * slots, 0, t.stride);
  }
  return bank;
}

mx::array ExpertBank::array(size_t t) const {
  const Tensor& x = tensors_.at(t);
  return region_array(shared_from_this(), memory_.buffer(), x.offset, x.shape, x.dtype);
}

std::vector<ExpertBank::Span> ExpertBank::spans(const std::vector<ExpertMove>& moves) const {
  std::vector<ExpertMove> sorted(moves);
  for (const auto& [e, s] : sorted) {
    if (e >= experts_ || s >= slots_)
      throw std::out_of_range("[ExpertBank] " + tensors_[0].name + ": expert " +
                              std::to_string(e) + " to slot " + std::to_string(s) +
                              " is outside the bank (" + std::to_string(experts_) +
                              " experts, " + std::to_string(slots_) + " slots)");
  }
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint8_t> taken(slots_, 0);
  for (const auto& [e, s] : sorted) {
    if (taken[s]++) throw std::invalid_argument("[ExpertBank] slot " + std::to_string(s) +
                                                " is the destination of two experts");
  }
  std::vector<Span> out;
  for (const Tensor& t : tensors_) {
    uint8_t* base = memory_.data() + t.offset;
    size_t i = 0;
    while (i < sorted.size()) {
      size_t j = i + 1;  // extend the run: next expert to the next slot
      while (j < sorted.size() && sorted[j].first == sorted[j - 1].first + 1 &&
             sorted[j].second == sorted[j - 1].second + 1)
        ++j;
      uint64_t n = j - i;
      out.push_back({t.file, t.file_offset + sorted[i].first * t.stride,
                     base + sorted[i].second * t.stride, n * t.stride});
      i = j;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// ExpertReader

ExpertReader::ExpertReader(std::shared_ptr<const TensorIndex> index, ExpertReaderOptions options)
    : index_(std::move(index)),
      options_(options),
      pool_(pool_threads(options.backend, options.threads)),
      files_(index_->files().size()) {
  if (options_.chunk_bytes == 0) options_.chunk_bytes = 4ull << 20;
  if (options_.backend == ReadBackend::IoUring) uring_ = std::make_unique<UringReader>(64);
  // Opened now and kept (reads outlive a deleted path, as the other readers').
  for (uint32_t id = 0; id < files_.size(); ++id) {
    files_[id] = std::make_unique<File>(File::open_read(index_->files()[id].path));
    files_[id]->check_unchanged(index_->files()[id].identity);
    files_[id]->advise(0, 0, Advice::Random);  // exactly the experts asked for
  }
}

const File& ExpertReader::file(uint32_t id) { return *files_[id]; }

ExpertReadStats ExpertReader::load(ExpertBank& bank, const std::vector<ExpertMove>& moves) {
  if (bank.index() != index_.get())
    throw std::invalid_argument("[ExpertReader] the bank belongs to another checkpoint");
  auto spans = bank.spans(moves);
  ExpertReadStats r;
  r.calls = 1;
  r.experts = moves.size();
  if (spans.empty()) return r;
  auto t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> io(io_mutex_);
    std::vector<uint8_t> used(files_.size(), 0);
    std::vector<ReadChunk> chunks;
    for (const auto& s : spans) {
      const File& f = file(s.file);
      if (!used[s.file]++) f.check_unchanged(index_->files()[s.file].identity);
      for (uint64_t done = 0; done < s.len; done += options_.chunk_bytes)
        chunks.push_back({&f, s.offset + done, s.dst + done,
                          static_cast<size_t>(std::min<uint64_t>(options_.chunk_bytes,
                                                                 s.len - done))});
      r.bytes += s.len;
    }
    // In file order: neighbouring experts' reads reach the device together.
    std::sort(chunks.begin(), chunks.end(), [](const ReadChunk& a, const ReadChunk& b) {
      return a.file != b.file ? a.file < b.file : a.offset < b.offset;
    });
    if (uring_) uring_->read(chunks);
    else read_chunks_threaded(pool_, chunks);
    // A rewrite during the read would have mixed two versions' bytes.
    for (size_t i = 0; i < files_.size(); ++i)
      if (used[i]) files_[i]->check_unchanged(index_->files()[i].identity);
    if (options_.drop_cache)
      for (const ReadChunk& c : chunks) c.file->advise(c.offset, c.len, Advice::Evict);
    r.reads = chunks.size();
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lk(stats_mutex_);
  stats_.calls += r.calls;
  stats_.experts += r.experts;
  stats_.bytes += r.bytes;
  stats_.reads += r.reads;
  stats_.seconds += r.seconds;
  return r;
}

ExpertReadStats ExpertReader::stats() const {
  std::lock_guard<std::mutex> lk(stats_mutex_);
  return stats_;
}

}  // namespace pyloader
