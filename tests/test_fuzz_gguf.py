"""Mutational fuzzing of GGUF reading (generator and oracle: tests/fuzz_gguf.py) and of
GGUF conversion over metadata values and tensor names (tests/fuzz_gguf_convert.py).

Every run is a child process, so a signal (MLX's GGUF reader divides, asserts and reads
wherever a header points) fails the test instead of killing pytest, and the file that
killed it is kept in the test's directory. The seed is printed (and taken from
PYLOADER_FUZZ_SEED when set): ``python tests/fuzz_gguf.py --seed S --cases N`` replays it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import fuzz_gguf as fz
import fuzz_gguf_convert as fzc
from helpers import fuzz_seed

HARNESS = Path(__file__).with_name("fuzz_gguf.py")
CONVERT_HARNESS = Path(__file__).with_name("fuzz_gguf_convert.py")
CI_CASES = 10_000
#: Conversion cases in the default run (each converts a model, loads it in mlx-lm and
#: runs the command: about 30 ms).
CI_CONVERT_CASES = 1_000


def _run(args: list[str], directory: Path, timeout: float, env=None,
         harness: Path = HARNESS) -> dict:
    directory.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(harness), "--keep-dir", str(directory), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    print(proc.stderr[-4000:])
    if proc.returncode < 0:
        kept = directory / "crash.gguf"
        shutil.copy(directory / "case.gguf", kept)
        raise AssertionError(f"the fuzz run died on signal "
                             f"{signal.Signals(-proc.returncode).name}; the case: {kept}")
    assert proc.returncode == 0, f"fuzz run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gguf_fuzz_ci(tmp_path):
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    s = _run(["--cases", str(CI_CASES), "--seed", str(seed)], tmp_path / "run", timeout=600)
    assert s["cases"] == CI_CASES and s["seed"] == seed
    # The mix must reach every verdict and every mutation kind: a generator producing
    # only garbage (or only valid files) would pass vacuously.
    assert s["accepted"] > CI_CASES // 20 and s["format-error"] > CI_CASES // 3
    assert s["unsupported"] > CI_CASES // 50 and s["tensors"] > CI_CASES // 5
    for kind in ("field", "bitflip", "byte", "truncate", "extend", "splice", "structure",
                 "valid"):
        assert s.get(f"kind:{kind}", 0) > CI_CASES // 50, kind


def test_gguf_convert_fuzz_ci(tmp_path):
    """Metadata values and tensor names: every case converts to a model mlx-lm loads, or
    is refused with a typed error naming the file; the command never raises."""
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    s = _run(["--cases", str(CI_CONVERT_CASES), "--seed", str(seed)], tmp_path / "run",
             timeout=900, harness=CONVERT_HARNESS)
    assert s["cases"] == CI_CONVERT_CASES and s["seed"] == seed
    n = CI_CONVERT_CASES
    assert s["accepted"] > n // 20 and s["format-error"] > n // 3
    assert s["unsupported"] > n // 50 and s["rules"] > 50
    assert s["in-place:accepted"] >= s["accepted"] and s["in-place:refused"] > n // 3
    for kind in ("value", "drop-key", "tokenizer", "name", "drop", "shape", "type", "valid"):
        assert s.get(f"kind:{kind}", 0) > n // 50, kind


@pytest.mark.fuzz_long
def test_gguf_convert_fuzz_long(tmp_path):
    """PYLOADER_FUZZ_SECONDS (default 600) of the conversion generator."""
    seconds = float(os.environ.get("PYLOADER_FUZZ_SECONDS", "600"))
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    s = _run(["--seconds", str(seconds), "--seed", str(seed)], tmp_path / "run",
             timeout=seconds + 600, harness=CONVERT_HARNESS)
    print("gguf convert fuzz:", json.dumps(s))
    assert s["cases"] > 0 and s["accepted"] > 0


@pytest.mark.fuzz_long
def test_gguf_fuzz_long(tmp_path):
    """PYLOADER_FUZZ_SECONDS (default 600) of the same generator."""
    seconds = float(os.environ.get("PYLOADER_FUZZ_SECONDS", "600"))
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    s = _run(["--seconds", str(seconds), "--seed", str(seed)], tmp_path / "run",
             timeout=seconds + 600)
    print("gguf fuzz:", json.dumps(s))
    assert s["cases"] > 0 and s["accepted"] > 0


# --- The harness itself can fail ---------------------------------------------------


def test_a_signal_in_the_reader_fails_the_run_and_keeps_the_file(tmp_path):
    """A reader that dies on a signal (here: abort() in place of read_gguf) fails the
    test with the signal's name, and the case that killed it is kept."""
    hook = tmp_path / "sitecustomize.py"
    hook.write_text("import os, pyloader.gguf\n"
                    "pyloader.gguf.read_gguf = lambda path: os.abort()\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with pytest.raises(AssertionError, match="died on signal SIGABRT") as info:
        _run(["--cases", "5", "--seed", "1"], tmp_path / "run", timeout=300, env=env)
    kept = tmp_path / "run" / "crash.gguf"
    assert str(kept) in str(info.value) and kept.read_bytes()[:4] in (b"GGUF", b"")


def test_the_oracle_flags_an_untyped_error(tmp_path, monkeypatch):
    import pyloader.gguf

    p = tmp_path / "case.gguf"
    p.write_bytes(fz.gguf_bytes([], [("w", [4], 0, bytes(16))]))
    assert fz.check(p, Counter()) == "accepted"

    def boom(path):
        raise IndexError("list index out of range")

    monkeypatch.setattr(pyloader.gguf, "read_gguf", boom)
    with pytest.raises(fz.Failure, match="IndexError"):
        fz.check(p, Counter())


def test_the_oracle_flags_an_error_that_does_not_name_the_file(tmp_path, monkeypatch):
    import pyloader
    import pyloader.gguf

    p = tmp_path / "case.gguf"
    p.write_bytes(b"GGUF")

    def anonymous(path):
        raise pyloader.FormatError("not a GGUF file")

    monkeypatch.setattr(pyloader.gguf, "read_gguf", anonymous)
    with pytest.raises(fz.Failure, match="does not name the file"):
        fz.check(p, Counter())


def _valid_convert_case(tmp_path) -> Path:
    import random

    p = tmp_path / "case.gguf"
    p.write_bytes(fz.gguf_bytes(*fzc.model_case(random.Random(0), "llama")))
    return p


def test_the_convert_oracle_flags_an_untyped_error(tmp_path, monkeypatch):
    import pyloader.gguf

    p = _valid_convert_case(tmp_path)
    assert fzc.check(p, tmp_path, Counter()) == "accepted"

    def boom(path, out, dtype="keep"):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(pyloader.gguf, "convert_gguf", boom)
    with pytest.raises(fz.Failure, match="ZeroDivisionError"):
        fzc.check(p, tmp_path, Counter())


def test_the_convert_oracle_flags_a_model_mlx_lm_cannot_load(tmp_path, monkeypatch):
    import json as _json

    import pyloader.gguf

    real = pyloader.gguf.convert_gguf

    def wrong_width(path, out, dtype="keep"):
        out = real(path, out, dtype)
        config = _json.loads((out / "config.json").read_text())
        config["hidden_size"] += 32  # what an unchecked embedding_length would write
        (out / "config.json").write_text(_json.dumps(config))
        return out

    monkeypatch.setattr(pyloader.gguf, "convert_gguf", wrong_width)
    with pytest.raises(fz.Failure, match="mlx-lm cannot use it"):
        fzc.check(_valid_convert_case(tmp_path), tmp_path, Counter())


def test_the_convert_oracle_flags_a_traceback_from_the_command(tmp_path, monkeypatch):
    import pyloader.cli.convert_gguf as command

    def boom(*args):
        raise KeyError("blk.0.attn_q.weight")

    monkeypatch.setattr(command, "convert_gguf", boom)
    with pytest.raises(fz.Failure, match="pyloader convert-gguf raised KeyError"):
        fzc.check(_valid_convert_case(tmp_path), tmp_path, Counter())
