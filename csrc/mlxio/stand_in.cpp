#include "mlxio/stand_in.h"

#include <memory>
#include <vector>

#include "core/errors.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;

namespace pyloader {
namespace {

// One CPU stream for every stand-in, usable from any thread: a default stream
// is per thread in MLX 0.32, and a stand-in made on the loading thread may be
// reached from a generating one (the error must still be StandInRead, not
// "There is no Stream(cpu, N) in current thread"). Nothing ever runs on it.
mx::Stream stand_in_stream() {
  static const mx::Stream stream = mx::new_thread_unsafe_stream(mx::Device::cpu);
  return stream;
}

// No inputs; evaluating it is the error. On the CPU on every backend, so
// eval_cpu is the one that runs (it throws before any work is encoded, which
// MLX's eval unwinds cleanly since 0.32.1).
class StandIn : public mx::UnaryPrimitive {
 public:
  explicit StandIn(std::shared_ptr<const std::string> message)
      : mx::UnaryPrimitive(stand_in_stream()), message_(std::move(message)) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array&) override {
    throw StandInRead(*message_);
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw StandInRead(*message_);
  }
  const char* name() const override { return "StandIn"; }
  // Never merged with another stand-in by compile's simplification.
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  std::shared_ptr<const std::string> message_;
};

}  // namespace

mx::array stand_in_array(const mx::Shape& shape, mx::Dtype dtype,
                         const std::string& message) {
  auto msg = std::make_shared<const std::string>(message);
  return mx::array(shape, dtype, std::make_shared<StandIn>(std::move(msg)),
                   std::vector<mx::array>{});
}

}  // namespace pyloader
