#include "mlxio/task_count.h"

#include <mlx/device.h>
#include <mlx/scheduler.h>
#include <mlx/stream.h>

namespace mx = mlx::core;

namespace pyloader {
namespace {

// synchronize(), once more when it rethrows a stored task error (the first
// call consumed it: the stream is then waited for).
void wait_for(mx::Stream s) {
  try {
    mx::synchronize(s);
  } catch (const std::exception&) {
    mx::synchronize(s);
  }
}

}  // namespace

int release_leaked_tasks() {
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  wait_for(cpu);
  if (mx::is_available(mx::Device::gpu)) wait_for(mx::default_stream(mx::Device::gpu));
  const int leaked = mx::scheduler::n_active_tasks();
  for (int i = 0; i < leaked; i++) mx::scheduler::notify_task_completion(cpu);
  for (int i = leaked; i < 0; i++) mx::scheduler::notify_new_task(cpu);
  return leaked;
}

int active_tasks() { return mx::scheduler::n_active_tasks(); }

}  // namespace pyloader
