"""The measured workloads: ``add_arguments``, ``prepare`` and ``run`` each."""

#: Workload name → its module.
WORKLOADS = {name: f"{__name__}.{name}" for name in ("load", "generate", "call")}
