"""Imports the C++ extension and checks it matches the running MLX.

libmlx's C++ ABI changes between releases and ``mlx.core.array`` objects only
cross the boundary when both modules share nanobind internals, so a mismatch
is turned into one clear ImportError here instead of a crash or a TypeError
deep inside a load. Every other module reaches the extension as ``_native.core``.
"""

from __future__ import annotations


def _distribution() -> str:
    """The name pyloader was installed under (its package metadata), for messages."""
    try:
        from importlib.metadata import packages_distributions

        return (packages_distributions().get(__package__) or [__package__])[0]
    except Exception:  # noqa: BLE001 - only a message depends on it
        return __package__


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

try:
    from . import _core as core
except ImportError as exc:  # pragma: no cover - depends on the install
    import glob
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    if not glob.glob(os.path.join(_here, "_core.*")):
        raise ImportError(
            f"pyloader is being imported from {_here}, which has no built extension "
            "(_core): probably pyloader's source tree shadows the installed package. Run "
            "from another directory, or build in place with `pip install -e .`."
        ) from exc
    raise ImportError(
        f"pyloader's C++ extension could not be loaded ({exc}). "
        "Reinstall pyloader with `pip install --force-reinstall --no-cache-dir pyloader` "
        "in this environment."
    ) from exc

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

__all__ = ["core"]
