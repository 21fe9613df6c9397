"""mlx-lm's model zoo, streamed (issue 32 item 2): every architecture module of
``mlx_lm.models``, a tiny random float32 instance (tests/zoo.py), plain mlx-lm against
pyloader at resident 0 with mmap and pread (and an expert cache for the MoE ones): the
first logits and 4 greedy tokens identical bit for bit, or a refusal raised before the
first token — never a different token. An architecture plain mlx-lm cannot build or run
from the tiny config here is skipped with plain mlx-lm's error.

Each architecture runs in its own process (a crash in one architecture's MLX code stays
its own). The default run takes a representative subset (:data:`SUBSET`: dense, tied,
sliding-window, hybrid linear attention, MoE of several shapes, a forward that does not
call its layers); ``pytest -m zoo tests/test_zoo.py`` runs the whole zoo (docs/streaming.md
gives its counts and time).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zoo

ZOO = Path(__file__).with_name("zoo.py")

#: The default run's architectures.
SUBSET = ["llama", "qwen3", "gemma3_text", "qwen3_5", "mixtral", "deepseek_v3",
          "olmoe", "iquestloopcoder"]


def _outcome(arch: str, root: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ZOO), arch, str(root)], capture_output=True,
                          text=True, timeout=300, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ZOO ")]
    if not lines and "ZOO-REFERENCE-RAN" not in proc.stdout:
        # The process died in plain mlx-lm's part (building the tiny model, its load
        # or its generation): an architecture plain mlx-lm cannot run from this config.
        return {"arch": arch, "status": "skipped",
                "reason": f"plain mlx-lm's process died (exit {proc.returncode})"}
    assert lines, f"{arch}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1][4:])


def _check(arch: str, root: Path) -> None:
    out = _outcome(arch, root)
    print(f"ZOO {json.dumps(out)}")
    if out["status"] == "skipped":
        pytest.skip(f"{arch}: {out['reason']}")
    assert out["status"] in ("identical", "refused"), out
    for name, why in out.get("refusals", {}).items():
        # A refusal is a typed error that says what to do instead.
        assert "Error" in why.split(":")[0], (arch, name, why)


@pytest.mark.parametrize("arch", SUBSET)
def test_zoo_subset(arch, tmp_path):
    _check(arch, tmp_path)


@pytest.mark.zoo
@pytest.mark.parametrize("arch", zoo.architectures())
def test_zoo(arch, tmp_path):
    _check(arch, tmp_path)
