"""The measured workloads, each run in a fresh child (:mod:`pyloader.compare.protocol`).

Each module defines ``add_arguments(parser)``, ``prepare(args) -> (ready, state)`` (the
untimed set-up) and ``run(args, state) -> result`` (the measured work):

* ``load``: a checkpoint into a dict of arrays, with one strategy (``pyloader compare
  --load-only``, ``bench/test_bench_load.py``);
* ``generate``: load + prompt + greedy decode, with a memory sampler (``pyloader
  compare``);
* ``call``: one importable function called with pickled arguments (the ``isolated``
  fixture of :mod:`pyloader.testing`).

A workload can also be named by the path of a ``.py`` file defining the same three
functions (the benchmark suites' own workloads, in the source tree's
``bench/benchlib/workloads/``).
"""

#: Workload name → its module.
WORKLOADS = {name: f"{__name__}.{name}" for name in ("load", "generate", "call")}
