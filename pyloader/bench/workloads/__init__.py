"""The measured workloads, each run in a fresh child (:mod:`pyloader.bench.protocol`).

Each module defines ``add_arguments(parser)``, ``prepare(args) -> (ready, state)`` (the
untimed set-up) and ``run(args, state) -> result`` (the measured work):

* ``load``: a checkpoint into a dict of arrays, with one strategy (``pyloader compare
  --load-only``, ``bench/test_bench_load.py``);
* ``first_use``: a checkpoint loaded with one strategy, then each tensor used once in
  file order (``bench/first_use.py``: overlapped loads against ``mx.load``);
* ``generate``: load + prompt + greedy decode, with a memory sampler (``pyloader
  compare``);
* ``stream``: decode speed of a streamed model against plain mlx-lm
  (``bench/test_streaming_bench.py``);
* ``distributed``: one rank of a pipeline under ``mlx.launch`` (``tests/test_distributed.py``,
  ``bench/distributed_bench.py``);
* ``residency``: the planner's predicted vs measured speed (``tests/test_residency_real.py``,
  ``bench/prediction_bench.py``);
* ``call``: one importable function called with pickled arguments (the pytest plugin's
  ``isolated`` fixture, :mod:`pyloader.bench.pytest_plugin`).
"""

#: Workload name → its module.
WORKLOADS = {name: f"{__name__}.{name}"
             for name in ("load", "first_use", "generate", "stream", "distributed", "residency",
                          "call")}
