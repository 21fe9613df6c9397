#include "mlxio/kv_arena.h"

#include <algorithm>
#include <atomic>
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

// Where a data pointer was taken: on the task (as MLX's own CPU ops do) or,
// wrongly, while the graph is built. On MLX's CPU allocator both give the
// same pointer; on CUDA raw_ptr() may migrate the buffer with a synchronous
// copy, which at build time would read before the kernel writing the input
// has run. Counted for kv_pointers_taken().
thread_local bool t_in_write_task = false;
std::atomic<uint64_t> g_pointers_in_task{0}, g_pointers_outside_task{0};

template <typename T>
T* data_in_task(const mx::array& a) {
  (t_in_write_task ? g_pointers_in_task : g_pointers_outside_task)
      .fetch_add(1, std::memory_order_relaxed);
  return const_cast<mx::array&>(a).data<T>();
}

// One slot's copy: arrays, not pointers, so that every pointer is taken on
// the task (data_in_task).
struct CopyJob {
  mx::array dst;                      // the slot
  std::optional<mx::array> prefix;    // redirected: the old slot
  std::optional<mx::array> x;         // new tokens
};

void run_copy(const CopyJob& job, int start) {
  uint8_t* dst = data_in_task<uint8_t>(job.dst);
  const uint8_t* prefix = job.prefix ? data_in_task<const uint8_t>(*job.prefix) : nullptr;
  const uint8_t* x = job.x ? data_in_task<const uint8_t>(*job.x) : nullptr;
  const int64_t B = job.dst.shape(0), H = job.dst.shape(1), C = job.dst.shape(2),
                D = job.dst.shape(3), item = static_cast<int64_t>(job.dst.itemsize());
  int64_t S = 0, xb = 0, xh = 0, xs = 0, xd = 0;  // x's strides in bytes
  if (job.x) {
    S = job.x->shape(2);
    xb = job.x->strides()[0] * item, xh = job.x->strides()[1] * item;
    xs = job.x->strides()[2] * item, xd = job.x->strides()[3] * item;
  }
  const int64_t row = D * item;
  const int64_t sh = C * row, sb = H * sh;  // slot strides in bytes
  for (int64_t b = 0; b < B; b++) {
    for (int64_t h = 0; h < H; h++) {
      uint8_t* base = dst + b * sb + h * sh;
      if (prefix && start > 0)
        std::memcpy(base, prefix + b * sb + h * sh, static_cast<size_t>(start * row));
      if (!x) continue;
      for (int64_t s = 0; s < S; s++) {
        uint8_t* d = base + (start + s) * row;
        const uint8_t* p = x + b * xb + h * xh + s * xs;
        if (xd == item) {
          std::memcpy(d, p, static_cast<size_t>(row));
        } else {
          for (int64_t e = 0; e < D; e++)
            std::memcpy(d + e * item, p + e * xd, static_cast<size_t>(item));
        }
      }
    }
  }
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) {
  std::vector<CopyJob> jobs;
  auto& encoder = mx::cpu::get_command_encoder(stream());
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
    CopyJob j{mx::array::unsafe_weak_copy(dst), std::nullopt, std::nullopt};
    encoder.set_output_array(const_cast<mx::array&>(dst));
    if (redirect_) {
      j.prefix = mx::array::unsafe_weak_copy(src);
      encoder.set_input_array(src);
    }
    if (has_x_) {
      j.x = mx::array::unsafe_weak_copy(inputs[n_ + i]);
      encoder.set_input_array(inputs[n_ + i]);
    }
    jobs.push_back(std::move(j));
  }
  if (jobs.empty()) return;
  // Runs on the stream's thread after every kernel already queued, which
  // includes the ones computing xs (MLX's cpu::eval keeps the inputs' and
  // outputs' buffers alive until this task has run).
  encoder.dispatch([jobs = std::move(jobs), start = start_]() {
    t_in_write_task = true;
    for (const auto& j : jobs) run_copy(j, start);
    t_in_write_task = false;
  });
}

}  // namespace

std::pair<uint64_t, uint64_t> kv_pointers_taken() {
  return {g_pointers_in_task.load(std::memory_order_relaxed),
          g_pointers_outside_task.load(std::memory_order_relaxed)};
}

// ---------------------------------------------------------------------------

KvArena::KvArena(std::vector<Slot> slots, size_t payload, const std::vector<size_t>& buffers,
                 KvArenaOptions options)
    : slots_(std::move(slots)), payload_(payload), options_(options) {
  for (size_t bytes : buffers) {
    memory_.push_back(std::make_unique<ArenaMemory>(
        bytes, options.populate, "the KV cache",
        "Lower max_context, use kv_bits=8, or free memory."));
    ArenaMemory& m = *memory_.back();
    // Under a GPU allocator, MLX's Metal attention may read key/value rows
    // past the written end when their strides show the slot continues (it
    // widens the key length to its block size; masked, so the values do not
    // matter unless they are NaN). mlx-lm's own cache buffers are mx.zeros;
    // so is this arena there. (On the CPU allocator nothing reads past the
    // views.)
    if (buffer_owner() != BufferOwner::Cpu) std::memset(m.data(), 0, m.size());
    if (options.lock) locks_.push_back(std::make_unique<MemoryLock>(m.data(), m.size()));
  }
}

size_t KvArena::allocated_bytes() const {
  size_t n = 0;
  for (const auto& m : memory_) n += m->size();
  return n;
}

size_t KvArena::resident_bytes() const {
  size_t n = 0;
  for (const auto& m : memory_) n += m->resident_bytes();
  return n;
}

bool KvArena::locked() const {
  if (locks_.empty()) return false;
  for (const auto& l : locks_)
    if (!l->locked()) return false;
  return true;
}

std::string KvArena::lock_error() const {
  for (const auto& l : locks_)
    if (!l->error().empty()) return l->error();
  return std::string();
}

std::shared_ptr<KvArena> KvArena::create(std::vector<KvSlotSpec> specs, KvArenaOptions options) {
  if (specs.empty()) throw std::invalid_argument("[KvArena] no slots");
  const uint64_t limit = max_buffer_bytes();
  std::vector<Slot> slots;
  std::vector<size_t> buffers;  // bytes of each buffer
  uint64_t offset = 0, payload = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    KvSlotSpec& spec = specs[i];
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
    if (!bytes) throw AllocationError("[KvArena] arena size overflows");
    if (*bytes > limit)
      throw UnsupportedError(
          "[KvArena] slot " + std::to_string(i) + " of shape " + shape_str(spec.shape) +
          " needs " + std::to_string(*bytes) + " bytes (" + human_bytes(*bytes) +
          ") in one buffer, and this device's largest buffer (maxBufferLength) is " +
          std::to_string(limit) + " bytes (" + human_bytes(limit) +
          "). Lower max_context, use kv_bits=8, or use fewer sequences at once.");
    // A new buffer when this slot would take the current one past the limit.
    if (buffers.empty() || *bytes > limit - offset) {
      buffers.push_back(0);
      offset = 0;
    }
    auto end = checked_add(offset, *bytes);
    auto next = end ? checked_add(*end, kRegionAlign - 1) : std::nullopt;
    if (!next) throw AllocationError("[KvArena] arena size overflows");
    slots.push_back({std::move(spec), buffers.size() - 1, static_cast<size_t>(offset),
                     static_cast<size_t>(*bytes)});
    payload += *bytes;
    // The next slot starts aligned; the padding is dropped at a buffer's end.
    buffers.back() = static_cast<size_t>(*end);
    offset = std::min<uint64_t>(*next / kRegionAlign * kRegionAlign, limit);
  }
  return std::shared_ptr<KvArena>(
      new KvArena(std::move(slots), static_cast<size_t>(payload), buffers, options));
}

mx::array KvArena::slot(size_t i) const {
  const Slot& s = slots_.at(i);
  return region_array(shared_from_this(), memory_[s.buffer]->buffer(), s.offset, s.spec.shape,
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
