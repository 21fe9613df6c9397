"""Mutational fuzzing of GGUF reading (generator and oracle: tests/fuzz_gguf.py).

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

HARNESS = Path(__file__).with_name("fuzz_gguf.py")
CI_CASES = 10_000


def _seed() -> int:
    env = os.environ.get("PYLOADER_FUZZ_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


def _run(args: list[str], directory: Path, timeout: float, env=None) -> dict:
    directory.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(HARNESS), "--keep-dir", str(directory), *args],
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
    seed = _seed()
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


@pytest.mark.fuzz_long
def test_gguf_fuzz_long(tmp_path):
    """PYLOADER_FUZZ_SECONDS (default 600) of the same generator."""
    seconds = float(os.environ.get("PYLOADER_FUZZ_SECONDS", "600"))
    seed = _seed()
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
