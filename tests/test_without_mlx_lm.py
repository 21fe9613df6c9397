"""mlx-lm is optional: without it the CLI's help, ``inspect``, ``repack``, ``convert-gguf``
and ``pyloader.load`` / ``pyloader.open`` work, and what builds models says to install it.

Each check runs in a child Python whose ``import mlx_lm`` fails as it does when the package
is absent (a ``sys.meta_path`` finder installed before pyloader is imported)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from models import make_model_dir

#: Makes every ``import mlx_lm...`` in the child fail as a missing package does.
BLOCK = textwrap.dedent("""
    import sys

    class _NoMlxLm:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "mlx_lm":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoMlxLm())
""")


def _child(code: str) -> dict:
    """Runs ``code`` after the blocker; it prints one JSON object, returned here."""
    proc = subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)],
                          capture_output=True, text=True, cwd="/", timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def test_the_child_has_no_mlx_lm():
    out = _child("""
        import json
        try:
            import mlx_lm
            print(json.dumps({"imported": True}))
        except ModuleNotFoundError as exc:
            print(json.dumps({"imported": False, "name": exc.name}))
    """)
    assert out == {"imported": False, "name": "mlx_lm"}


def test_every_help_and_the_version():
    from pyloader.cli import COMMANDS

    out = _child(f"""
        import contextlib, io, json, traceback
        from pyloader.cli import main
        res = {{}}
        for argv in [["--help"], ["--version"]] + [[c, "--help"] for c in {list(COMMANDS)!r}]:
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    code = main(argv)
            except SystemExit as exc:
                code = exc.code
            except BaseException:
                code = traceback.format_exc()
            res[" ".join(argv)] = [code, len(buf.getvalue())]
        print(json.dumps(res))
    """)
    assert len(out) == len(COMMANDS) + 2
    for argv, (code, printed) in out.items():
        assert code == 0 and printed > 0, (argv, code)


def test_checkpoint_tools_and_readers(tiny_dir, tmp_path):
    from test_gguf import tiny_llama_gguf

    gguf = tiny_llama_gguf(tmp_path / "tiny.gguf", {})
    out = _child(f"""
        import contextlib, io, json
        import pyloader
        from pyloader.cli import main

        def run(*argv):
            with contextlib.redirect_stdout(io.StringIO()):
                return main(list(argv))

        print(json.dumps({{
            "inspect": run("inspect", {str(tiny_dir)!r}, "--json"),
            "repack": run("repack", {str(tiny_dir)!r}, {str(tmp_path / "repacked")!r}),
            "convert-gguf": run("convert-gguf", {str(gguf)!r}, {str(tmp_path / "conv")!r}),
            "load": len(pyloader.load({str(tiny_dir)!r})),
            "pread": len(pyloader.load({str(tmp_path / "repacked")!r}, "pread")),
            "open": len(pyloader.open({str(tmp_path / "conv")!r}).tensors()),
        }}))
    """)
    assert out["inspect"] == out["repack"] == out["convert-gguf"] == 0, out
    assert out["load"] == out["pread"] > 0 and out["open"] > 0, out


def test_what_needs_mlx_lm_says_what_to_install(tiny_dir):
    out = _child(f"""
        import contextlib, io, json
        import pyloader
        from pyloader.cli import main

        res = {{}}
        for name, call in [("load_model", lambda: pyloader.load_model({str(tiny_dir)!r})),
                           ("make_kv_cache",
                            lambda: pyloader.make_kv_cache(type("M", (), {{"layers": [0]}})(),
                                                           16))]:
            try:
                call()
                res[name] = "no error"
            except ModuleNotFoundError as exc:
                res[name] = str(exc)
        for cmd in ("generate", "compare", "serve", "plan"):
            err = io.StringIO()
            argv = [cmd, "--model", {str(tiny_dir)!r}] if cmd == "serve" else [
                cmd, {str(tiny_dir)!r}]
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
            res[cmd] = [code, err.getvalue()]
        print(json.dumps(res))
    """)
    for name in ("load_model", "make_kv_cache"):
        assert "needs mlx-lm, which is not installed" in out[name], out[name]
        assert "pip install" in out[name] and "mlx-lm==" in out[name]
    assert "pyloader.load_model" in out["load_model"]
    for cmd in ("generate", "compare", "serve", "plan"):
        code, err = out[cmd]
        assert code == 2 and f"pyloader {cmd}:" in err and "pip install" in err, (cmd, err)
