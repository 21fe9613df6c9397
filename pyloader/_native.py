"""Imports the C++ extension and checks it matches the running MLX."""

from __future__ import annotations

#: The distribution's name on PyPI (``pyloader`` there is an unrelated project).
DISTRIBUTION = "pyloader-mlx"


def _distribution() -> str:
    """The name pyloader was installed under (its package metadata), for messages."""
    try:
        from importlib.metadata import packages_distributions

        return (packages_distributions().get(__package__) or [DISTRIBUTION])[0]
    except Exception:  # noqa: BLE001 - only a message depends on it
        return DISTRIBUTION


try:
    import mlx.core as mx
except ImportError as exc:  # pragma: no cover - depends on the install
    name = _distribution()
    raise ImportError(
        f"MLX could not be loaded ({exc}). On Linux MLX's library (libmlx) comes from a "
        f'backend package that pyloader leaves to you, as MLX does: pip install "{name}[cpu]" '
        f'(CPU), "{name}[cuda12]" or "{name}[cuda13]" (NVIDIA GPUs), or install mlx[cpu] / '
        "mlx[cuda12] / mlx[cuda13] yourself — exactly one of them. macOS needs none "
        "(mlx brings mlx-metal)."
    ) from exc

def _installed_extension(here: str):
    """The installed copy's extension, for a source tree that shadows the installed package."""
    import glob
    import hashlib
    import os
    import sys

    def digest(root: str) -> str:
        h = hashlib.sha256()
        for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            h.update(os.path.relpath(f, root).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
        return h.hexdigest()

    for entry in sys.path:
        other = os.path.join(os.path.abspath(entry or os.curdir), "pyloader")
        if os.path.realpath(other) == os.path.realpath(here):
            continue
        built = sorted(glob.glob(os.path.join(other, "_core.*")))
        built = [b for b in built if not b.endswith(".pyi")]
        if not built:
            continue
        if digest(other) != digest(here):
            return None, (f"the installed copy in {other} was built from other sources "
                          "(this tree changed since `pip install`)")
        return built[0], None
    return None, "no installed copy of pyloader has one either"


try:
    from . import _core as core
except ImportError as exc:  # pragma: no cover - depends on the install
    if str(exc).startswith("PYLOADER_"):
        # A bad environment switch (csrc/core/platform.cpp): its own message says it all.
        raise
    import glob
    import importlib.util
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    if glob.glob(os.path.join(_here, "_core.*")):
        raise ImportError(
            f"pyloader's C++ extension could not be loaded ({exc}). Reinstall pyloader "
            "with `pip install --force-reinstall --no-cache-dir .` (from its source tree) "
            "in this environment."
        ) from exc
    # A source tree shadows the installed package: use its extension if built from these sources.
    _path, _why = _installed_extension(_here)
    if _path is None:
        raise ImportError(
            f"pyloader is being imported from its source tree {_here}, which has no built "
            f"extension (_core), and {_why}. Either build it in place: `pip install "
            f"--no-build-isolation -e {os.path.dirname(_here)}` (or `pip install .` again), "
            "or run from another directory (`cd ..`) so that the installed pyloader is "
            "imported."
        ) from exc
    _spec = importlib.util.spec_from_file_location(f"{__package__}._core", _path)
    core = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = core
    _spec.loader.exec_module(core)
    setattr(sys.modules[__package__], "_core", core)

if core.mlx_build_version != mx.__version__:
    raise ImportError(
        f"pyloader was built against MLX {core.mlx_build_version} but MLX {mx.__version__} "
        f"is installed. Install mlx=={core.mlx_build_version}, or rebuild pyloader "
        "(`pip install --no-cache-dir --force-reinstall .`) against this MLX."
    )


def _self_check() -> None:
    """Fail now if arrays from the extension are not real ``mx.array`` objects."""
    import os
    import struct
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "check.safetensors")
        header = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + b"\x07")
        try:
            arr = core.PreadReader(core.TensorIndex.open(path), threads=1).load()["x"]
        except TypeError as exc:
            raise ImportError(
                "pyloader's extension cannot hand arrays to this mlx.core "
                f"({exc}); the nanobind or MLX builds differ. Rebuild pyloader."
            ) from exc
    if not isinstance(arr, mx.array) or arr.item() != 7:
        raise ImportError("pyloader's extension returned a wrong array: rebuild pyloader.")


_self_check()

