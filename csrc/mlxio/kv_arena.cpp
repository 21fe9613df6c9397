#include "mlxio/kv_arena.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <sstream>

#include "core/checked.h"
#include "core/errors.h"
#include "core/mapping.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlxio/mlx_buffers.h"

namespace mx = mlx::core;

namespace pyloader {

namespace {

std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); i++) os << (i ? ", " : "") << s[i];
  os << ")";
  return os.str();
}

// Flags of a strided view, computed the way MLX defines them.
mx::array::Flags view_flags(const mx::Shape& shape, const mx::Strides& strides,
                            size_t data_size) {
  size_t size = 1;
  for (auto d : shape) size *= static_cast<size_t>(d);
  auto contiguous_from = [&](bool row) {
    int64_t expected = 1;
    int n = static_cast<int>(shape.size());
    for (int k = 0; k < n; k++) {
      int i = row ? n - 1 - k : k;
      if (shape[i] == 1) continue;
      if (strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  };
  mx::array::Flags f;
  f.row_contiguous = size == 0 || contiguous_from(true);
  f.col_contiguous = size == 0 || contiguous_from(false);
  f.contiguous = data_size == size;
  return f;
}

// Writes new tokens into arena slots and outputs views of the written
// prefix plus the whole slots (the next write's inputs).
//   inputs:  states[n], xs[n] (when writing), targets[n] (when redirected)
//   outputs: views[n] (batch, heads, end, dim), states[n] (whole slots)
// A redirected write first copies positions [0, start) from each state to
// its target, a fresh slot, and the outputs then live in the target.
class KvWrite : public mx::Primitive {
 public:
  // The views' end is their shape (the outputs are made with it).
  KvWrite(mx::Stream stream, int n, int start, bool has_x, bool redirect,
          std::shared_ptr<void> token)
      : mx::Primitive(stream),
        n_(n),
        start_(start),
        has_x_(has_x),
        redirect_(redirect),
        token_(std::move(token)) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    // KvSequence::record always puts the write on a CPU stream.
    throw std::runtime_error("[pyloader.kv] KvWrite runs on a CPU stream only.");
  }
  const char* name() const override { return "PyloaderKvWrite"; }

 private:
  int n_, start_;
  bool has_x_, redirect_;
  std::shared_ptr<void> token_;  // moved into the views' buffers at eval
};

struct CopyJob {
  uint8_t* dst;          // slot data
  const uint8_t* prefix;  // redirected: the old slot's data, else null
  const uint8_t* x;       // new tokens, or null
  int64_t B, H, C, D, S, item;
  int64_t xb, xh, xs, xd;  // strides of x in bytes
};

void run_copy(const CopyJob& j, int start) {
  const int64_t row = j.D * j.item;
  const int64_t sh = j.C * row, sb = j.H * sh;  // slot strides in bytes
  for (int64_t b = 0; b < j.B; b++) {
    for (int64_t h = 0; h < j.H; h++) {
      uint8_t* base = j.dst + b * sb + h * sh;
      if (j.prefix && start > 0)
        std::memcpy(base, j.prefix + b * sb + h * sh, static_cast<size_t>(start * row));
      if (!j.x) continue;
      for (int64_t s = 0; s < j.S; s++) {
        uint8_t* d = base + (start + s) * row;
        const uint8_t* p = j.x + b * j.xb + h * j.xh + s * j.xs;
        if (j.xd == j.item) {
          std::memcpy(d, p, static_cast<size_t>(row));
        } else {
          for (int64_t e = 0; e < j.D; e++)
            std::memcpy(d + e * j.item, p + e * j.xd, static_cast<size_t>(j.item));
        }
      }
    }
  }
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) {
  std::vector<CopyJob> jobs;
  for (int i = 0; i < n_; i++) {
    const mx::array& src = inputs[i];
    const mx::array& dst = redirect_ ? inputs[(has_x_ ? 2 : 1) * n_ + i] : src;
    mx::array& view = outputs[i];
    mx::array& state = outputs[n_ + i];
    state.copy_shared_buffer(dst);

    // The view gets its own Data over the same bytes: its deleter keeps the
    // slot's memory alive and carries this write's token, so the sequence
    // can tell whether any array still shows these positions.
    const auto& shape = view.shape();
    const auto& strides = dst.strides();
    size_t data_size = 0;
    if (view.size() > 0) {
      data_size = 1;
      for (int d = 0; d < 4; d++) data_size += static_cast<size_t>((shape[d] - 1) * strides[d]);
    }
    auto flags = view_flags(shape, strides, data_size);
    view.set_data(mx::allocator::Data(dst.buffer(),
                                      [keep = dst.data_shared_ptr(),
                                       token = token_](mx::allocator::Buffer) {}),
                  data_size, strides, flags, dst.offset());

    if (!has_x_ && !redirect_) continue;
    CopyJob j{};
    j.dst = const_cast<mx::array&>(dst).data<uint8_t>();
    j.prefix = redirect_ ? src.data<uint8_t>() : nullptr;
    j.B = dst.shape(0), j.H = dst.shape(1), j.C = dst.shape(2), j.D = dst.shape(3);
    j.item = static_cast<int64_t>(dst.itemsize());
    if (has_x_) {
      const mx::array& x = inputs[n_ + i];
      j.x = x.data<uint8_t>();
      j.S = x.shape(2);
      j.xb = x.strides()[0] * j.item, j.xh = x.strides()[1] * j.item;
      j.xs = x.strides()[2] * j.item, j.xd = x.strides()[3] * j.item;
    }
    jobs.push_back(j);
  }
  if (jobs.empty()) return;
  // Runs on the stream's thread after every kernel already queued, which
  // includes the ones computing xs (MLX's cpu::eval keeps the inputs' and
  // outputs' buffers alive until this task has run).
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.dispatch([jobs = std::move(jobs), start = start_]() {
    for (const auto& j : jobs) run_copy(j, start);
  });
}

}  // namespace

// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------

KvArena::KvArena(std::vector<Slot> slots, size_t payload, size_t total, KvArenaOptions options)
    : slots_(std::move(slots)),
      payload_(payload),
      options_(options),
      memory_(total, options.populate, "the KV cache",
              "Lower max_context, use kv_bits=8, or free memory.") {
  // Under a GPU allocator, MLX's Metal attention may read key/value rows past
  // the written end when their strides show the slot continues (it widens the
  // key length to its block size; masked, so the values do not matter unless
  // they are NaN). mlx-lm's own cache buffers are mx.zeros; so is this arena
  // there. (On the CPU allocator nothing reads past the views.)
  if (buffer_owner() != BufferOwner::Cpu) std::memset(memory_.data(), 0, memory_.size());
  if (options.lock) lock_ = std::make_unique<MemoryLock>(memory_.data(), memory_.size());
}

std::shared_ptr<KvArena> KvArena::create(std::vector<KvSlotSpec> specs, KvArenaOptions options) {
  if (specs.empty()) throw std::invalid_argument("[KvArena] no slots");
  std::vector<Slot> slots;
  uint64_t offset = 0, payload = 0;
  for (auto& spec : specs) {
    if (spec.shape.size() != 4)
      throw std::invalid_argument(
          "[KvArena] slot shape must be (batch, heads, capacity, dim), got " +
          shape_str(spec.shape));
    std::optional<uint64_t> bytes = mx::size_of(spec.dtype);
    for (auto d : spec.shape) {
      if (d <= 0)
        throw std::invalid_argument("[KvArena] slot dimensions must be positive, got " +
                                    shape_str(spec.shape));
      if (bytes) bytes = checked_mul(*bytes, static_cast<uint64_t>(d));
    }
    auto end = bytes ? checked_add(offset, *bytes) : std::nullopt;
    auto next = end ? checked_add(*end, kRegionAlign - 1) : std::nullopt;
    if (!next) throw AllocationError("[KvArena] arena size overflows");
    slots.push_back({std::move(spec), offset, *bytes});
    payload += *bytes;
    offset = *next / kRegionAlign * kRegionAlign;
  }
  return std::shared_ptr<KvArena>(new KvArena(std::move(slots), payload, offset, options));
}

mx::array KvArena::slot(size_t i) const {
  const Slot& s = slots_.at(i);
  return region_array(shared_from_this(), memory_.buffer(), s.offset, s.spec.shape,
                      s.spec.dtype);
}

// ---------------------------------------------------------------------------

KvSequence::KvSequence(std::shared_ptr<KvArena> arena, std::vector<size_t> slots)
    : arena_(std::move(arena)), slots_(std::move(slots)) {
  if (slots_.empty()) throw std::invalid_argument("[KvSequence] no slots");
  const auto& first = arena_->spec(slots_[0]).shape;
  capacity_ = first[2];
  for (auto i : slots_) {
    const auto& s = arena_->spec(i).shape;
    if (s[0] != first[0] || s[1] != first[1] || s[2] != first[2])
      throw std::invalid_argument("[KvSequence] slots must share batch, heads and capacity");
    states_.push_back(arena_->slot(i));
  }
}

size_t KvSequence::nbytes() const {
  size_t n = 0;
  for (auto i : slots_) n += arena_->slot_bytes(i);
  return n;
}

int KvSequence::max_live_end() {
  int m = 0;
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [](const auto& e) { return e.second.expired(); }),
              live_.end());
  for (const auto& e : live_) m = std::max(m, e.first);
  return m;
}

size_t KvSequence::live_views() {
  max_live_end();
  return live_.size();
}

std::vector<mx::array> KvSequence::write(std::vector<mx::array> xs, int start,
                                         mx::StreamOrDevice s) {
  if (xs.size() != slots_.size())
    throw std::invalid_argument("[KvSequence.write] expected " + std::to_string(slots_.size()) +
                                " arrays, got " + std::to_string(xs.size()));
  int n = -1;
  for (size_t i = 0; i < xs.size(); i++) {
    const auto& want = spec(i);
    auto& x = xs[i];
    if (x.ndim() != 4 || x.shape(0) != want.shape[0] || x.shape(1) != want.shape[1] ||
        x.shape(3) != want.shape[3] || (n >= 0 && x.shape(2) != n))
      throw std::invalid_argument(
          "[KvSequence.write] array " + std::to_string(i) + " has shape " + shape_str(x.shape()) +
          "; the cache holds (" + std::to_string(want.shape[0]) + ", " +
          std::to_string(want.shape[1]) + ", n, " + std::to_string(want.shape[3]) +
          ") with the same n for every array");
    n = x.shape(2);
  }
  if (start < 0 || n > capacity_ - start)
    throw std::out_of_range("[KvSequence.write] positions [" + std::to_string(start) + ", " +
                            std::to_string(static_cast<int64_t>(start) + n) +
                            ") exceed the capacity " + std::to_string(capacity_));
  return record(std::move(xs), start, start + n, s);
}

std::vector<mx::array> KvSequence::view(int end, mx::StreamOrDevice s) {
  if (end < 0 || end > capacity_)
    throw std::out_of_range("[KvSequence.view] end " + std::to_string(end) + " outside [0, " +
                            std::to_string(capacity_) + "]");
  return record({}, end, end, s);
}

std::vector<mx::array> KvSequence::record(std::vector<mx::array> xs, int start, int end,
                                          mx::StreamOrDevice s) {
  // The casts run where the caller runs (any device); the write itself on
  // this thread's default CPU stream, whatever device the model uses. MLX
  // orders work across streams and devices (a fence wherever an input comes
  // from another stream), so the write waits for the keys it copies and the
  // attention that reads its views waits for the write, as with mlx-lm's
  // generation stream on Linux, where the model runs on a stream of its own
  // and every write already crosses streams. The arena is a buffer of MLX's
  // allocator, so the views are addressable wherever the model reads them
  // (on a Mac a shared MTLBuffer in unified memory).
  auto stream = mx::to_stream(s);
  auto write_stream = mx::default_stream(mx::Device::cpu);
  const int n = static_cast<int>(slots_.size());
  const bool has_x = !xs.empty();
  for (int i = 0; i < n && has_x; i++)
    if (xs[i].dtype() != spec(i).dtype) xs[i] = mx::astype(xs[i], spec(i).dtype, stream);

  // Overwriting positions that a live array still shows would change that
  // array's values; give this sequence a fresh arena instead (the old one
  // lives on as long as those arrays do).
  const bool redirect = has_x && start < max_live_end();
  std::shared_ptr<KvArena> fresh;
  std::vector<mx::array> inputs = states_;
  inputs.insert(inputs.end(), xs.begin(), xs.end());
  if (redirect) {
    std::vector<KvSlotSpec> specs;
    for (int i = 0; i < n; i++) specs.push_back(spec(i));
    KvArenaOptions opts;
    opts.populate = arena_->populated();
    opts.lock = arena_->locked();
    fresh = KvArena::create(std::move(specs), opts);
    for (int i = 0; i < n; i++) inputs.push_back(fresh->slot(i));
  }

  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < n; i++) {
      auto shape = spec(i).shape;
      if (k == 0) shape[2] = end;
      shapes.push_back(std::move(shape));
      dtypes.push_back(spec(i).dtype);
    }
  }
  auto token = std::make_shared<char>(0);
  auto outs = mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<KvWrite>(write_stream, n, start, has_x, redirect, token), inputs);

  if (redirect) {
    arena_ = std::move(fresh);
    for (int i = 0; i < n; i++) slots_[i] = static_cast<size_t>(i);
    live_.clear();  // older views show the old arena, which is no longer written
    cow_count_++;
  }
  states_.assign(outs.begin() + n, outs.end());
  live_.emplace_back(end, std::weak_ptr<void>(token));
  outs.erase(outs.begin() + n, outs.end());
  return outs;
}

}  // namespace pyloader
