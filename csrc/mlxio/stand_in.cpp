#include "mlxio/stand_in.h"

#include <memory>
#include <vector>

#include "core/errors.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;

namespace pyloader {
namespace {

// No inputs; evaluating it is the error. On the creating thread's default CPU
// stream on every backend, so eval_cpu is the one that runs: it throws before
// the stream's encoder is looked up or any work is encoded, so evaluating a
// stand-in from another thread raises the same error, and MLX's eval unwinds
// cleanly (since 0.32.1). No stream of its own: a dedicated one would start an
// MLX stream thread at the first mx.clear_cache().
class StandIn : public mx::UnaryPrimitive {
 public:
  explicit StandIn(std::shared_ptr<const std::string> message)
      : mx::UnaryPrimitive(mx::default_stream(mx::Device::cpu)),
        message_(std::move(message)) {}

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
