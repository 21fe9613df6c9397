"""The leaf layer: facts about this process and machine, and small helpers every other
layer shares. Nothing here imports another part of pyloader, MLX or mlx-lm at module
level.

* :mod:`.procfs`: ``/proc/self/status``, ``/proc/self/io``, ``/proc/meminfo``, loadavg;
* :mod:`.memory`: memory probes (MemAvailable, the process's cgroup v1/v2, PSI) and the
  one headroom rule, whose page-cache treatment is an explicit argument;
* :mod:`.names`: which decoder layer a tensor belongs to;
* :mod:`.sizes`: byte sizes as text, both ways;
* :mod:`.fs`: the cache directory and atomic writes;
* :mod:`.hooks`: the one handle pyloader attaches to a model, and ``__call__`` hooks on
  modules that keep their class identity.
"""
