"""Imports the C++ extension and checks it matches the running MLX.

libmlx's C++ ABI changes between releases and ``mlx.core.array`` objects only
cross the boundary when both modules share nanobind internals, so a mismatch
is turned into one clear ImportError here instead of a crash or a TypeError
deep inside a load. Every other module reaches the extension as ``_native.core``.
"""

from __future__ import annotations

import mlx.core as mx

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
