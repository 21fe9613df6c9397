"""mlx-lm's own tiny model configs, taken from its test suite (the zoo's first choice).

    python tests/zoo_suite_configs.py MLX_LM_TESTS_DIR OUT.json

Imports ``test_models.py`` from an extracted mlx-lm source distribution (the one
``scripts/mlx_lm_suite.py`` downloads and checks), runs each ``TestModels`` test with its
``model_test_runner`` replaced by a recorder, and writes, per architecture module (the
module of the model class the test built), the ``ModelArgs`` (``model.args`` or
``model.config``) of the first model a test passed to the runner, as a config dict
(``dataclasses.asdict``). The tests run through ``unittest``, so a failing sub-test does
not stop the loop over ``test_all_models``' configs; a test that fails before reaching the
runner records nothing. Prints one line: how many tests ran and how many architectures
were recorded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import unittest
from pathlib import Path


def _jsonable(config: dict) -> dict | None:
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError):
        return None


def capture(tests_dir: Path) -> dict[str, dict]:
    """``{architecture module: config}`` from the suite's ``TestModels``."""
    sys.path.insert(0, str(tests_dir))
    import test_models  # mlx-lm's, from its sdist

    found: dict[str, dict] = {}

    def record(self, model, model_type, vocab_size, num_layers):
        args = next((a for a in (getattr(model, "args", None), getattr(model, "config", None))
                     if a is not None and dataclasses.is_dataclass(a)), None)
        if args is None:
            return
        arch = type(model).__module__.rsplit(".", 1)[-1]
        config = _jsonable(dataclasses.asdict(args))
        if config is None:
            return
        config.setdefault("model_type", model_type)
        found.setdefault(arch, config)

    cls = test_models.TestModels
    cls.model_test_runner = record
    names = sorted(n for n in dir(cls) if n.startswith("test_"))
    result = unittest.TestResult()
    for name in names:
        # Through unittest, so a failing subTest (one config of test_all_models) is
        # recorded and the loop goes on to the next config.
        cls(name).run(result)
    print(f"{len(names)} tests ({len(result.errors)} errors, {len(result.failures)} "
          f"failures in the recorder's stead), {len(found)} architectures recorded",
          file=sys.stderr)
    return found


if __name__ == "__main__":
    configs = capture(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(configs, indent=1, sort_keys=True))
