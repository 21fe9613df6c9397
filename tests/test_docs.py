"""Every Python and shell block of README.md and docs/*.md runs as written.

Each ```python / ```bash / ```sh block is run in a fresh process in its own empty working
directory, with this environment's ``python`` and ``pyloader`` first on PATH, the clone's
``bench/`` as PYTHONPATH (the examples' stand-in models) and the hub offline: it must
exit 0. A block that starts a server (``pyloader serve ... --port N &``) runs too, when
port N is free here (otherwise it is skipped, saying so). A block that cannot run here
(it needs ``mlx.launch``, a cgroup, another machine, many minutes, or it installs
packages) is marked in the markdown by the line just before it::

    <!-- docs-test: skip the reason -->

and reported as skipped with that reason (``pytest -ra`` prints it). A block that is a
file for the next block to use (a test file the next block runs with pytest) is marked::

    <!-- docs-test: file test_my_loader.py -->

and written under that name into the next runnable block's directory instead of being
run itself. The blocks share the pyloader cache, so the built-in model is converted once.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(.+?)\s*-->")
FILE = re.compile(r"<!--\s*docs-test:\s*file\s+([\w.-]+)\s*-->")
#: Seconds one block may take (the slowest ones generate on the built-in model).
TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # of the opening fence (1-based)
    lang: str
    code: str
    skip: str | None   # the reason, when marked
    files: tuple[tuple[str, str], ...] = ()  # (name, text) of the file blocks before it

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` in a language :data:`RUN` knows, with their marks;
    a block marked as a file goes with the next block instead (``files``)."""
    out, lines, files = [], path.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```+\s*([A-Za-z]*)", lines[i])
        if not m:
            i += 1
            continue
        start, lang, indent = i, m.group(2).lower(), len(m.group(1))
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        i += 1
        if lang not in RUN:
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        if (file := FILE.search(before)) is not None:
            files.append((file.group(1), "\n".join(body) + "\n"))
            continue
        mark = SKIP.search(before)
        out.append(Block(path, start + 1, lang, "\n".join(body) + "\n",
                         mark.group(1) if mark else None, tuple(files)))
        files = []
    assert not files, f"{path}: file blocks {[n for n, _ in files]} with no block after them"
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = str(ROOT / "bench")  # the stand-in models (benchlib.synthetic)
    return env


@pytest.fixture(scope="module", autouse=True)
def built_in_model():
    """The built-in model, converted before the first block times out on it."""
    import pyloader

    return pyloader.default_model_path()


def port_in_use(port: int) -> bool:
    """Whether something here already listens on ``port`` (a block's server would then
    fail to bind, and its client talk to someone else's)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_runs_as_written(block: Block, tmp_path):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    for port in map(int, re.findall(r"--port\s+([0-9]+)", block.code)):
        if port and port_in_use(port):
            pytest.skip(f"{block.id}: port {port}, which its server takes, is in use here")
    for name, text in block.files:
        (tmp_path / name).write_text(text)
    if RUN[block.lang] == "python":
        argv = [sys.executable, "-c", block.code]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    t0 = time.monotonic()
    out = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert out.returncode == 0, (
        f"{block.id} ({block.lang}) exited {out.returncode} after {took:.0f} s:\n"
        f"{block.code}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")


def test_the_two_commands_are_in_the_first_40_lines():
    """The README's first screen: the main job and the tests (CI runs the second one
    verbatim, .ci/run)."""
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert 'pip install ".[cpu,compare]" && pyloader compare' in head
    assert 'pip install ".[cpu,test]" && pip install --no-deps mlx-whisper==0.4.3 && pytest' in head
    assert "```python" in head  # the quickstart


def pip_install_targets(line: str) -> list[str]:
    """Every package a ``pip install`` on ``line`` names: each word after it that is
    not an option, up to the end of that command (``&&``, ``;``, ``|``, ``#``, a closing
    backquote or parenthesis)."""
    out = []
    for m in re.finditer(r"pip3? install\b([^&;|#`)]*)", line):
        out += [w.strip("\"'") for w in m.group(1).split()
                if not w.startswith("-") and w != "\\"]
    return out


def test_every_pip_install_names_this_project():
    """PyPI's "pyloader" is another project: the docs install from the source tree
    (``.``, ``".[extra]"``) or as pyloader-mlx, never as plain pyloader, in any place
    of the command (``pip install pytest-benchmark pyloader`` is as wrong)."""
    wrong = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if any(re.fullmatch(r"pyloader(\[.*\])?([<>=!~].*)?", target)
                   for target in pip_install_targets(line)):
                wrong.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_pip_install_targets_reads_every_package():
    assert pip_install_targets("pip install pytest-benchmark pyloader") == [
        "pytest-benchmark", "pyloader"]
    assert pip_install_targets('pip install -q ".[cpu,test]" && pytest  # the tests') == [
        ".[cpu,test]"]
    assert pip_install_targets("`pip install pyloader-mlx[cpu] 'pyloader==0.1'`") == [
        "pyloader-mlx[cpu]", "pyloader==0.1"]
    assert pip_install_targets("(pip install -e . ) then pip install pyloader") == [
        ".", "pyloader"]


def test_the_block_finder_reads_marks(tmp_path):
    """The finder itself: languages, indentation, the skip mark on the line before."""
    md = tmp_path / "x.md"
    md.write_text("text\n\n<!-- docs-test: skip needs a server -->\n```bash\nserve\n```\n\n"
                  "```python\nprint(1)\n```\n\n```json\n{}\n```\n\n"
                  "<!-- docs-test: file test_x.py -->\n```python\ndef test(): pass\n```\n"
                  "* item:\n  ```sh\n  echo hi\n  ```\n")
    found = blocks(md)
    assert [(b.lang, b.code, b.skip, b.files) for b in found] == [
        ("bash", "serve\n", "needs a server", ()), ("python", "print(1)\n", None, ()),
        ("sh", "echo hi\n", None, (("test_x.py", "def test(): pass\n"),))]


def test_the_readme_kv_cache_claim_holds():
    """README: the built-in model's KV cache is float32, and ``kv_bits=8`` stores it in
    the percentage the README states: checked against what plan_kv_cache plans and
    make_kv_cache allocates (the README said "halves it" once: wrong for float32)."""
    import mlx_lm

    import pyloader

    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"\((\w+) for the built-in model[^)]*\); `kv_bits=8` stores it in "
                  r"([0-9]+)% of that", text)
    assert m, "the README's KV cache sentence moved: update this test with it"
    dtype, percent = m.group(1), int(m.group(2))
    model, _ = mlx_lm.load(str(pyloader.default_model_path()))
    full = pyloader.plan_kv_cache(model, 4096)
    eight = pyloader.plan_kv_cache(model, 4096, kv_bits=8)
    assert str(full.dtype) == f"mlx.core.{dtype}"
    made = [sum(c.nbytes for c in pyloader.make_kv_cache(model, 4096, kv_bits=bits))
            for bits in (None, 8)]
    assert made == [full.nbytes, eight.nbytes]
    assert round(100 * eight.nbytes / full.nbytes) == percent
