"""``pyloader compare``: loaders measured like for like, each run in a fresh process with
the page cache controlled.

* :mod:`.protocol`: the measuring-child protocol (ready → go → result) and its parent
  class :class:`~.protocol.Child`; :mod:`.child` is the child's entry point;
* :mod:`.workloads`: what a child measures (``load``, ``generate``, ``call``: any
  importable function), or any workload module named by its file;
* :mod:`.harness`: the loop (rotated strategies, page cache evicted or warmed per run,
  summaries, JSON/CSV/table) and the load benchmark;
* :mod:`.genbench`: the load + generation comparison (configurations, token identity,
  table);
* :mod:`.plots`: memory-over-time and tok/s-vs-residency PNGs (matplotlib);
* :mod:`.system`: the host measurements a harness reads (memory, read bytes, load).

The benchmark suites built on it live in the source tree's ``bench/``, outside the wheel.
"""
