"""What the benchmark suites in ``bench/`` share: where results live (:mod:`.paths`),
memory cgroups (:mod:`.cgroup`), the scale run (:mod:`.scale`), the suites' own measuring
workloads (:mod:`.workloads`) and llama.cpp's engine and builds (:mod:`.llamacpp_engine`,
:mod:`.llamacpp_levels`). The measuring protocol itself is the product's
(:mod:`pyloader.compare`).

``bench/`` is on ``sys.path`` when a suite runs (``python bench/kv_bench.py``) and in the
pytest runs (``pythonpath`` in pyproject.toml).
"""
