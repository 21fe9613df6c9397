"""mlx-lm, an optional dependency: imported when a feature that needs it is used.

Lower layers never import mlx-lm at import time, so the checkpoint tools run without it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: What to install for the features that run models through mlx-lm.
MLX_LM_INSTALL = 'pip install "pyloader-mlx[compare]" (or mlx-lm==0.32.2)'


def missing_message(needed_by: str) -> str:
    """The message for ``needed_by`` (a function or command) when mlx-lm is missing."""
    return f"{needed_by} needs mlx-lm, which is not installed: {MLX_LM_INSTALL}"


def require_mlx_lm(needed_by: str, module: str = "mlx_lm") -> ModuleType:
    """``module`` (``mlx_lm`` or one of its submodules), imported.

    Raises:
        ModuleNotFoundError: mlx-lm is not installed (naming ``needed_by`` and what to install).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "mlx_lm":
            raise
        raise ModuleNotFoundError(missing_message(needed_by), name=exc.name) from exc


class mlx_lm_module:  # used like the module it stands for, hence the lowercase name
    """A module of mlx-lm imported on first attribute access (``mlx_cache.KVCache``).

    Args:
        module: The module's name, e.g. ``"mlx_lm.models.cache"``.
        needed_by: What needs it, for the message when mlx-lm is missing.
    """

    def __init__(self, module: str, needed_by: str) -> None:
        self.__module = module
        self.__needed_by = needed_by

    def __getattr__(self, name: str):
        # Only for names this object lacks; dunder lookups are not forwarded.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(require_mlx_lm(self.__needed_by, self.__module), name)

    def __repr__(self) -> str:
        return f"<mlx-lm module {self.__module!r}, imported on first use>"
