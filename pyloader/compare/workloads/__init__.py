"""The measured workloads (``load``, ``generate``, ``call``, or a ``.py`` path), each
defining ``add_arguments``, ``prepare`` and ``run``."""

#: Workload name → its module.
WORKLOADS = {name: f"{__name__}.{name}" for name in ("load", "generate", "call")}
