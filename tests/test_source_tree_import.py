"""``import pyloader`` where the README's install command leaves a user: in the repository
root after ``pip install .``, where the source tree (first on ``sys.path``) shadows the
installed package and has no built extension."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import pyloader
from pyloader import _core

PACKAGE = Path(pyloader.__file__).parent


def _copy_sources(dst: Path) -> Path:
    """The package's Python files (no extension) under ``dst/pyloader``."""
    for f in PACKAGE.rglob("*.py"):
        target = dst / "pyloader" / f.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return dst / "pyloader"


@pytest.fixture
def layout(tmp_path):
    """``repo/pyloader``: a source tree without the extension; ``site/pyloader``: an
    installed copy of the same sources with the built extension (and ``site/mlx`` for
    its ``$ORIGIN/../mlx/lib`` run path)."""
    repo, site = tmp_path / "repo", tmp_path / "site"
    _copy_sources(repo)
    installed = _copy_sources(site)
    shutil.copy(_core.__file__, installed / Path(_core.__file__).name)
    (site / "mlx").symlink_to(Path(mx.__file__).parent)
    return repo, site


def _import_from(cwd: Path, site: Path, code: str,
                 real_site: bool = True) -> subprocess.CompletedProcess:
    """``python -S -c code`` in ``cwd`` (first on sys.path, as for ``python -c``) with
    ``site`` and then (``real_site``) this environment's site-packages (numpy, mlx-lm) on
    the path; -S keeps this environment's editable-install finder out."""
    path = [str(site)] + ([str(Path(mx.__file__).parent.parent)] if real_site else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_source_tree_uses_the_installed_extension_built_from_it(layout, tmp_path):
    repo, site = layout
    (tmp_path / "x.safetensors").write_bytes(
        b"\x38\x00\x00\x00\x00\x00\x00\x00"
        b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}   \x07')
    out = _import_from(repo, site, "import pyloader, sys; "
                       "print(pyloader.__file__); print(pyloader._core.__file__); "
                       f"print(pyloader.load({str(tmp_path / 'x.safetensors')!r})['x'].item())")
    assert out.returncode == 0, out.stderr
    source, extension, value = out.stdout.split()
    assert source == str(repo / "pyloader" / "__init__.py")  # the source tree's Python
    assert extension.startswith(str(site / "pyloader"))      # the installed extension
    assert value == "7"


def test_changed_sources_say_exactly_what_to_do(layout):
    repo, site = layout
    with open(repo / "pyloader" / "errors.py", "a") as f:
        f.write("# edited after pip install\n")
    out = _import_from(repo, site, "import pyloader")
    assert out.returncode == 1
    assert "built from other sources" in out.stderr
    assert "pip install --no-build-isolation -e" in out.stderr and "cd .." in out.stderr


def test_no_installed_copy_says_exactly_what_to_do(layout, tmp_path):
    repo, _ = layout
    only_mlx = tmp_path / "only-mlx"
    only_mlx.mkdir()
    (only_mlx / "mlx").symlink_to(Path(mx.__file__).parent)
    out = _import_from(repo, only_mlx, "import pyloader", real_site=False)
    assert out.returncode == 1
    assert "no built extension (_core)" in out.stderr
    assert "no installed copy of pyloader has one either" in out.stderr
