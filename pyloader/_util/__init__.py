"""The leaf layer: facts about this process and machine, and small helpers every other
layer shares. Nothing here imports another part of pyloader, MLX or mlx-lm at module
level.

* :mod:`.procfs`: ``/proc/self/status``, ``/proc/self/io``, ``/proc/meminfo``, PSI,
  loadavg; ``PYLOADER_NO_PROC=1`` hides ``/proc`` and ``/sys``;
* :mod:`.darwin`: macOS's figures from the kernel (ctypes), or ``sysctl``/``vm_stat``;
* :mod:`.host`: the one answer per figure on every platform (process memory, read
  counters, host memory, pressure level), None where a platform has no such figure;
* :mod:`.memory`: memory probes (MemAvailable, the process's cgroup v1/v2, PSI) and the
  one headroom rule, whose page-cache treatment is an explicit argument;
* :mod:`.names`: which decoder layer a tensor belongs to;
* :mod:`.sizes`: byte sizes as text, both ways;
* :mod:`.fs`: the cache directory and atomic writes;
* :mod:`.hooks`: the one handle pyloader attaches to a model, and ``__call__`` hooks on
  modules that keep their class identity.
"""
