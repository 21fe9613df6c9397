"""Differential fuzzing of the header parser against the safetensors package.

The generator, the mutations and the oracle are in tests/fuzz_safetensors.py;
each run is a child process, so a crash in the extension fails the test
instead of killing pytest. The seed is printed (and taken from
PYLOADER_FUZZ_SEED when set) so a failure can be replayed with
``python tests/fuzz_safetensors.py --seed S --cases N``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import fuzz_safetensors as fz
from helpers import fuzz_seed

HARNESS = Path(__file__).with_name("fuzz_safetensors.py")
CI_CASES = 20_000


def _run(args: list[str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, str(HARNESS), *args], capture_output=True,
                          text=True, timeout=timeout)
    print(proc.stderr[-4000:])
    assert proc.returncode == 0, (f"fuzz run failed (exit {proc.returncode}, a negative code is "
                                  f"a signal):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_differential_fuzz_ci():
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    s = _run(["--cases", str(CI_CASES), "--seed", str(seed)], timeout=600)
    assert s["cases"] == CI_CASES and s["seed"] == seed
    # The mix must reach both verdicts, every mutation kind and real loads;
    # a generator that only produced garbage would pass vacuously.
    assert s["both-accept"] > CI_CASES // 20 and s["both-reject"] > CI_CASES // 2
    assert s["loaded_tensors"] > CI_CASES // 10
    for kind in ("bitflip", "byte", "truncate", "extend", "length", "json", "splice", "valid"):
        assert s.get(f"kind:{kind}", 0) > CI_CASES // 50, kind
    assert s.get("stricter:duplicate key", 0) > 0 and s.get("stricter:unexpected field", 0) > 0


@pytest.mark.fuzz_long
def test_differential_fuzz_long():
    """Hypothesis drives the same generator for PYLOADER_FUZZ_SECONDS (default
    600), then a plain random run of the same length."""
    seconds = float(os.environ.get("PYLOADER_FUZZ_SECONDS", "600"))
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    h = _run(["--hypothesis", "--seconds", str(seconds / 2), "--seed", str(seed)],
             timeout=seconds + 600)
    r = _run(["--seconds", str(seconds / 2), "--seed", str(seed)], timeout=seconds + 600)
    print("hypothesis:", json.dumps(h), "\nrandom:", json.dumps(r))
    assert h["cases"] > 0 and r["cases"] > 0
    assert h["both-accept"] > 0 and r["both-accept"] > 0


# --- The oracle itself can fail ------------------------------------------------


def _st(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


VALID = _st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8))


def test_oracle_accepts_agreement(tmp_path):
    counts: Counter = Counter()
    assert fz.check(VALID, tmp_path / "m.safetensors", counts) == "both-accept"
    bad = _st(b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8))
    assert fz.check(bad, tmp_path / "m.safetensors", counts) == "both-reject"


def test_oracle_flags_a_looser_parser(tmp_path, monkeypatch):
    """If pyloader accepted what the reference rejects, check() must say so."""
    bad = _st(b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8))
    monkeypatch.setattr(fz, "reference", lambda data: None)
    with pytest.raises(fz.Mismatch, match="reference rejects"):
        fz.check(VALID, tmp_path / "m.safetensors", Counter())
    monkeypatch.undo()
    # ...and a stricter rejection without the documented rule is a mismatch too.
    monkeypatch.setattr(fz, "reference", lambda data: ({}, {}))
    with pytest.raises(fz.Mismatch, match="reference accepts, pyloader rejects"):
        fz.check(bad, tmp_path / "m.safetensors", Counter())


def test_oracle_checks_the_stricter_rule_is_real(tmp_path):
    dup = _st(b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
              b'"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a")
    counts: Counter = Counter()
    assert fz.check(dup, tmp_path / "m.safetensors", counts) == "stricter"
    assert counts["stricter:duplicate key"] == 1
    assert not fz.breaks_stricter_rule(VALID, "duplicate key 'w'")


def test_oracle_compares_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(fz, "reference",
                        lambda data: ({"w": ("F32", [2], b"\x01" + bytes(7))}, {}))
    with pytest.raises(fz.Mismatch, match="bytes"):
        fz.check(VALID, tmp_path / "m.safetensors", Counter())


def test_control_characters_in_names_do_not_cut_messages(tmp_path):
    """Found by the fuzzer: a NUL in a tensor name cut the C++ message short,
    so the rule text never reached Python."""
    import pyloader

    p = tmp_path / "m.safetensors"
    p.write_bytes(_st(b'{"a\\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}',
                      b"a"))
    with pytest.raises(pyloader.FormatError, match=r"tensor 'a\\x00b': unexpected field 'x'"):
        pyloader.open(p)


def test_fnuz_float8_dtypes_open(tmp_path):
    """Found by the fuzzer: safetensors 0.8 knows F8_E4M3FNUZ and F8_E5M2FNUZ."""
    import pyloader

    p = tmp_path / "m.safetensors"
    p.write_bytes(_st(b'{"a":{"dtype":"F8_E4M3FNUZ","shape":[2],"data_offsets":[0,2]},'
                      b'"b":{"dtype":"F8_E5M2FNUZ","shape":[1],"data_offsets":[2,3]}}', b"xyz"))
    ck = pyloader.open(p)
    assert [ck[n].dtype for n in ("a", "b")] == ["F8_E4M3FNUZ", "F8_E5M2FNUZ"]
    got = pyloader.load(p, strategy="pread")
    assert bytes(memoryview(got["a"])) + bytes(memoryview(got["b"])) == b"xyz"
