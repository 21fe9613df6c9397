"""Measuring loaders like for like: fresh processes, controlled page cache, medians.

* :mod:`.protocol`: the one measuring-child protocol (ready → go → result) and its
  parent class :class:`~.protocol.Child`; :mod:`.child` is the child's entry point;
* :mod:`.workloads`: what a child measures (``load``, ``generate``, ``stream``,
  ``distributed``, ``residency``, ``call``: any importable function);
* :mod:`.pytest_plugin`: the pytest plugin in the wheel (``page_cache``, ``isolated``,
  ``--page-cache``) for anyone's loader benchmarks;
* :mod:`.harness`: the loop of ``pyloader compare`` (rotated strategies, page cache
  evicted or warmed per run, summaries, JSON/CSV/table) and the load benchmark;
* :mod:`.genbench`: the load + generation comparison (configurations, token identity,
  table);
* :mod:`.plots`: memory-over-time and tok/s-vs-residency PNGs (matplotlib);
* :mod:`.synthetic`: deterministic checkpoints and random-weight models of a chosen size;
* :mod:`.suites`: one module per benchmark suite (``bench/*.py`` are their command lines);
* :mod:`.results`: raw results reduced to kept summaries and rendered into
  ``docs/results.md`` (:mod:`.paths`: where both live).
"""
