"""Run an engine's own loader and learn which checkpoint tensor each parameter is.

:class:`LoadCapture` watches ``mx.load`` of the checkpoint's files and records the arrays it
hands out (MLX lazy loads, or zero-cost shapes-only arrays for loaders that evaluate). A
parameter that *is* one of them is read and streamed by pyloader; any other was computed by
the loader and stays resident (:func:`sources`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..io.checkpoint import Checkpoint, TensorMeta

# One capture at a time: mx.load is a module attribute, shared by every thread.
_LOCK = threading.Lock()


class LoadCapture:
    """While active (``with``), ``mx.load`` of ``ckpt``'s files by this thread returns
    arrays recorded by identity; every other call is untouched. One capture at a time."""

    def __init__(self, ckpt: Checkpoint, *, shapes_only: bool = False):
        self.shapes_only = shapes_only
        self.by_file: dict[str, dict[str, TensorMeta]] = {}
        for t in ckpt.tensors():
            self.by_file.setdefault(os.path.realpath(t.file), {})[t.name] = t
        self.direct: dict[int, TensorMeta] = {}  # id(array) -> tensor
        self.passed: set[int] = set()            # ids of real loads of other files
        self._keep: list[mx.array] = []          # ids stay unique while recorded
        self._thread = 0
        self._load = None

    def __enter__(self) -> LoadCapture:
        _LOCK.acquire()
        self._thread = threading.get_ident()
        self._load = mx.load
        mx.load = self._watch
        return self

    def __exit__(self, *exc) -> None:
        mx.load = self._load
        _LOCK.release()

    def _watch(self, file, *args, **kwargs):
        result = self._load(file, *args, **kwargs)
        if threading.get_ident() != self._thread:
            return result
        arrays = result[0] if isinstance(result, tuple) else result
        if not isinstance(arrays, dict):
            return result
        try:
            metas = self.by_file.get(os.path.realpath(os.fspath(file)), {})
        except TypeError:  # a file object: not one of the checkpoint's paths
            metas = {}
        out = {}
        for name, arr in arrays.items():
            t = metas.get(name)
            if t is None or not isinstance(arr, mx.array):
                self.passed.add(id(arr))
            else:
                if self.shapes_only:
                    arr = mx.broadcast_to(mx.zeros((), arr.dtype), arr.shape)
                self.direct[id(arr)] = t
            self._keep.append(arr)
            out[name] = arr
        return (out, *result[1:]) if isinstance(result, tuple) else out


@dataclass
class Sources:
    """Where the parameters of a model built under a :class:`LoadCapture` come from.

    Attributes:
        direct: Parameter path -> the checkpoint tensor it is (streamed by pyloader).
        computed: Parameter path -> the array the loader made (kept resident).
        unknown: Parameters computed from a shapes-only array (rerun with real loads).
    """

    direct: dict[str, TensorMeta] = field(default_factory=dict)
    computed: dict[str, mx.array] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)


def sources(model: nn.Module, capture: LoadCapture) -> Sources:
    """Each parameter of ``model`` sorted by where it comes from (see :class:`Sources`)."""
    out = Sources()
    for path, arr in tree_flatten(model.parameters()):
        t = capture.direct.get(id(arr))
        if t is not None:
            out.direct[path] = t
        elif capture.shapes_only and id(arr) not in capture.passed:
            out.unknown.append(path)
        else:
            out.computed[path] = arr
    return out
