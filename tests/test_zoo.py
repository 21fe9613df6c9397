"""mlx-lm's model zoo, streamed: every architecture module of
``mlx_lm.models``, a tiny random float32 instance (tests/zoo.py), plain mlx-lm against
pyloader at resident 0 with mmap and pread (and an expert cache for the MoE ones): the
first logits and 4 greedy tokens identical bit for bit, or a refusal raised before the
first token — never a different token. An architecture plain mlx-lm cannot build or run
from the tiny config here is skipped with plain mlx-lm's error.

Each architecture runs in its own process (a crash in one architecture's MLX code stays its
own). Tiny configs come first from mlx-lm's own test suite (its source distribution, downloaded
once and checked by scripts/mlx_lm_suite.py, the configs captured by tests/zoo_suite_configs.py
and cached beside it); where it cannot be had (offline, first run) the zoo says so and falls
back to this project's and derived configs. The default run takes a representative subset
(:data:`SUBSET`: dense, tied, sliding-window, hybrid linear attention, MoE of several shapes, a
forward that does not call its layers); ``pytest -m zoo tests/test_zoo.py`` runs the whole zoo
(docs/streaming.md gives its counts and time).

The kernels tests run the same zoo, float32 and 4-bit, with pyloader's CPU kernels
(``kernels="auto"``) against MLX's own ops and the float64 reference
(tests/zoo_kernels.py; :data:`KERNELS_SUBSET` by default; the bound and the last sweep's
result are in docs/kernels.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import zoo

HERE = Path(__file__).parent
ZOO = HERE / "zoo.py"
ZOO_KERNELS = HERE / "zoo_kernels.py"
CAPTURE = HERE / "zoo_suite_configs.py"
SUITE = HERE.parent / "scripts" / "mlx_lm_suite.py"

#: The default run's architectures.
SUBSET = ["llama", "qwen3", "gemma3_text", "qwen3_5", "qwen3_moe", "deepseek_v3",
          "olmoe", "iquestloopcoder"]
#: The default run's architectures under kernels="auto": dense, sliding-window masks,
#: hybrid linear attention, MoE, and deepseek_v41 (a vocabulary of 128 in mlx-lm's tiny
#: config; fp8 and fp4 rounding steps and top-k choices inside its forward).
KERNELS_SUBSET = ["llama", "gemma3_text", "qwen3_5", "qwen3_moe", "deepseek_v41"]
#: The default run takes mlx-lm's own config up to this size (estimated parameters), the
#: whole zoo up to tests/zoo.py's MAX_SUITE_PARAMETERS: qwen3_moe's (220M parameters, a
#: minute with its float64 reference) gives way to this project's tiny MoE config.
SUBSET_MAX_SUITE_PARAMETERS = 100_000_000


def _suite_module():
    spec = importlib.util.spec_from_file_location("mlx_lm_suite", SUITE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def suite_configs() -> Path | None:
    """The JSON file of mlx-lm's own tiny configs (cached), or None with the reason
    printed when its source distribution cannot be had here."""
    suite = _suite_module()
    cache = suite.cache_root()
    out = cache / "zoo-configs.json"
    if out.exists():
        return out
    try:
        tarball = suite.fetch_sdist(cache)
        with tempfile.TemporaryDirectory() as work:
            suite.extract_tests(tarball, Path(work))
            tmp = out.with_suffix(f".tmp-{os.getpid()}")
            subprocess.run([sys.executable, str(CAPTURE), str(Path(work) / "tests"),
                            str(tmp)], check=True, timeout=600, cwd=work,
                           capture_output=True, text=True)
            os.replace(tmp, out)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - offline: say so, fall back
        print(f"zoo: mlx-lm's own test configs unavailable ({type(e).__name__}: {e}); "
              "using this project's and derived configs", file=sys.stderr)
        return None
    return out


def _zoo(*args: str, env: dict | None = None, script: Path = ZOO,
         timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Runs tests/zoo.py (or ``script``) with ``args`` in a new process: the process and
    its last ``ZOO`` result line (None when it printed none)."""
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=timeout, check=False, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ZOO ")]
    return proc, json.loads(lines[-1][4:]) if lines else None


def _outcome(arch: str, root: Path, configs: Path | None, script: Path = ZOO,
             max_suite: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("PYLOADER_ZOO_CONFIGS", None)
    env.pop("PYLOADER_ZOO_MAX_SUITE_PARAMETERS", None)
    if configs is not None:
        env["PYLOADER_ZOO_CONFIGS"] = str(configs)
    if max_suite is not None:
        env["PYLOADER_ZOO_MAX_SUITE_PARAMETERS"] = str(max_suite)
    proc, result = _zoo(arch, str(root), env=env, script=script, timeout=900)
    if result is None and "ZOO-REFERENCE-RAN" not in proc.stdout:
        # The process died in plain mlx-lm's part (building the tiny model, its load
        # or its generation): an architecture plain mlx-lm cannot run from this config.
        return {"arch": arch, "status": "skipped",
                "reason": f"plain mlx-lm's process died (exit {proc.returncode})"}
    assert result is not None, f"{arch}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return result


def _fresh_reference(arch: str, root: Path) -> list | str:
    """Plain mlx-lm's first logits and tokens on the written model, in a new process
    (or how that process ended when it printed none)."""
    proc, result = _zoo("--reference", arch, str(root))
    return f"exit {proc.returncode}" if result is None else result["reference"]


def _judge_difference(arch: str, root: Path, out: dict) -> None:
    """A pyloader run differed from the reference: before calling it pyloader's, does
    plain mlx-lm compute this model the same way from one process to the next? Its
    reference is run twice more, each in a fresh process. When plain mlx-lm's own greedy
    tokens agree every time and so do pyloader's, but its first logits move between its
    own runs, the outcome is ``identical tokens`` (bit-exact logits are not defined for
    that model here); when its own tokens move, or it crashes, the architecture is
    skipped with that reason. Only a difference against a reference that reproduces bit
    for bit stays ``different``."""
    refs = [out["reference"]] + [_fresh_reference(arch, root) for _ in range(2)]
    if all(r == refs[0] for r in refs):
        return
    crashed = [r for r in refs if isinstance(r, str)]
    tokens = [r[1] for r in refs if not isinstance(r, str)]
    if crashed or any(t != tokens[0] for t in tokens):
        out.update(status="skipped", reason=(
            "plain mlx-lm is not deterministic on this model: its greedy tokens over three "
            f"processes were {tokens}" + (f", and a rerun crashed ({crashed[0]})"
                                          if crashed else "")
            + "; no reference to compare with"))
        return
    got = [d["tokens"] for d in out.get("diff", {}).values()]
    if all(t == tokens[0] for t in got):
        out.update(status="identical tokens", note=(
            "pyloader's greedy tokens equal plain mlx-lm's; its first logits differ, as "
            "plain mlx-lm's own do from one process to the next"))


def _check(arch: str, root: Path, configs: Path | None, max_suite: int | None = None) -> None:
    out = _outcome(arch, root, configs, max_suite=max_suite)
    if out["status"] == "different":
        _judge_difference(arch, root, out)
    out.pop("reference", None)
    print(f"ZOO {json.dumps(out)}")
    if out["status"] == "skipped":
        pytest.skip(f"{arch}: {out['reason']}")
    assert out["status"] in ("identical", "identical tokens", "refused"), out
    for name, why in out.get("refusals", {}).items():
        # A refusal is a typed error that says what to do instead.
        assert "Error" in why.split(":")[0], (arch, name, why)


@pytest.mark.parametrize("arch", SUBSET)
def test_zoo_subset(arch, tmp_path, suite_configs):
    _check(arch, tmp_path, suite_configs, SUBSET_MAX_SUITE_PARAMETERS)


@pytest.mark.zoo
@pytest.mark.parametrize("arch", zoo.architectures())
def test_zoo(arch, tmp_path, suite_configs):
    _check(arch, tmp_path, suite_configs)


def _check_kernels(arch: str, root: Path, configs: Path | None,
                   max_suite: int | None = None) -> None:
    """``kernels="auto"`` against ``kernels="mlx"`` and the float64 reference
    (tests/zoo_kernels.py): within docs/kernels.md's bound, no NaN where MLX has none."""
    try:
        out = _outcome(arch, root, configs, script=ZOO_KERNELS, max_suite=max_suite)
    except AssertionError as e:  # the process died after plain mlx-lm's part ran
        died = {"arch": arch, "sweep": "kernels", "status": "failed", "reason": str(e)[:300]}
        print(f"ZOO {json.dumps(died)}")
        raise
    out.setdefault("sweep", "kernels")
    print(f"ZOO {json.dumps(out)}")
    if out["status"] == "skipped":
        pytest.skip(f"{arch}: {out['reason']}")
    assert out["status"] == "within", out


@pytest.mark.parametrize("arch", KERNELS_SUBSET)
def test_zoo_kernels_subset(arch, tmp_path, suite_configs):
    _check_kernels(arch, tmp_path, suite_configs, SUBSET_MAX_SUITE_PARAMETERS)


@pytest.mark.zoo
@pytest.mark.parametrize("arch", zoo.architectures())
def test_zoo_kernels(arch, tmp_path, suite_configs):
    _check_kernels(arch, tmp_path, suite_configs)
