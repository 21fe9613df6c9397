// MLX's count of active tasks, brought back in line after a failed task.
//
// MLX 0.32's CPU command encoder counts a task (scheduler::notify_new_task)
// before it enqueues it, and enqueues its completion after. On the main thread
// an enqueue first rethrows the error a failed task left on the stream; when the
// enqueue that throws is a counted task's, its completion is never enqueued and
// the count stays one too high. eval waits for a task to finish whenever more
// than 10 are counted, so after about ten failed tasks in one process an eval
// whose own tasks have all finished waits forever.
#pragma once

namespace pyloader {

// Waits until every task queued on the default CPU stream (and the default GPU
// stream, where there is one) has run, then sets MLX's count of active tasks
// back to zero; returns by how much it was off (negative: too low). A stored
// task error is consumed, not rethrown: it already surfaced where it was raised.
// The caller has synchronized every other stream with work (mlx-lm's generation
// stream, say), and no other thread is evaluating.
int release_leaked_tasks();

// MLX's count of active tasks.
int active_tasks();

}  // namespace pyloader
