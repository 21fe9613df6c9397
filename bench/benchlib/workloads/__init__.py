"""The suites' own measured workloads, each a file the product's measuring child runs
(:class:`pyloader.compare.protocol.Child` takes a workload module's path):

* :data:`STREAM`: decode speed of a streamed model against plain mlx-lm
  (``bench/test_streaming_bench.py``, ``bench/stream_bound.py``, the scale run);
* :data:`FIRST_USE`: a checkpoint loaded with one strategy, then each tensor used once in
  file order (``bench/first_use.py``);
* :data:`DISTRIBUTED`: one rank of a pipeline under ``mlx.launch``
  (``tests/test_distributed.py``, ``bench/distributed_bench.py``);
* :data:`RESIDENCY`: the planner's predicted vs measured speed
  (``tests/test_residency_real.py``, ``bench/prediction_bench.py``).
"""

from pathlib import Path

_HERE = Path(__file__).resolve().parent

STREAM = str(_HERE / "stream.py")
FIRST_USE = str(_HERE / "first_use.py")
DISTRIBUTED = str(_HERE / "distributed.py")
RESIDENCY = str(_HERE / "residency.py")
