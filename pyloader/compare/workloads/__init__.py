"""The measured workloads (``load``, ``generate``, ``call``), each run in a fresh child.

Each defines ``add_arguments(parser)``, ``prepare(args) -> (ready, state)`` and
``run(args, state) -> result``; a ``.py`` path with the same functions works too.
"""

#: Workload name → its module.
WORKLOADS = {name: f"{__name__}.{name}" for name in ("load", "generate", "call")}
