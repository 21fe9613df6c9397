"""What pyloader attaches to the models and modules it manages: two attribute names.

* ``model._pyloader`` is the model's :class:`ModelHandle`: its streaming controller, its distributed
  share, its head manager and its pressure monitor, each None when absent.
* ``module._pyloader_hooks`` is a hooked module's chain of ``__call__`` hooks (:func:`add_hook`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

HANDLE_ATTR = "_pyloader"
HOOKS_ATTR = "_pyloader_hooks"

#: ``hook(module, call, *args, **kwargs)``; ``call`` runs the inner hooks and ``__call__``.
Hook = Callable[..., Any]


@dataclass(eq=False)
class ModelHandle:
    """Everything pyloader attaches to a model it loaded (None where not used).

    Attributes:
        controller: The :class:`pyloader.streaming.StreamingController` owning the weights.
        share: The :class:`pyloader.distributed.Share` of a model loaded with ``group=``.
        heads: The :class:`pyloader.heads.HeadManager` of a head-bundle model.
        monitor: The :class:`pyloader.residency.PressureMonitor` attached to it.
    """

    controller: Any = None
    share: Any = None
    heads: Any = None
    monitor: Any = None


def handle_of(model: Any) -> ModelHandle | None:
    """The model's handle, or None when pyloader did not load it."""
    return vars(model).get(HANDLE_ATTR) if hasattr(model, "__dict__") else None


def attach_handle(model: Any) -> ModelHandle:
    """The model's handle, created empty on first use."""
    h = handle_of(model)
    if h is None:
        h = ModelHandle()
        object.__setattr__(model, HANDLE_ATTR, h)
    return h


# __call__ hooks

_HOOKED: dict[type, type] = {}   # original class -> its Hooked subclass
_BASE: dict[type, type] = {}     # Hooked subclass -> original class


def _hooked_call(self, *args, **kwargs):
    hooks = list(vars(self)[HOOKS_ATTR].values())
    base = next(_BASE[c] for c in type(self).__mro__ if c in _BASE)

    def run(i: int, a: tuple, k: dict):
        if i < 0:
            return base.__call__(self, *a, **k)
        return hooks[i](self, lambda *a2, **k2: run(i - 1, a2, k2), *a, **k)

    return run(len(hooks) - 1, args, kwargs)


def _hooked_class(cls: type) -> type:
    sub = _HOOKED.get(cls)
    if sub is None:
        sub = type(f"Hooked{cls.__name__}", (cls,),
                   {"__call__": _hooked_call, "__doc__": cls.__doc__,
                    "__module__": cls.__module__})
        _HOOKED[cls] = sub
        _BASE[sub] = cls
    return sub


def add_hook(module: Any, key: str, hook: Hook, *, inner: bool = False) -> None:
    """Run ``hook`` around every call of ``module`` (outside its hooks, or with ``inner`` around the
    module's own call only). ValueError when ``key`` is taken."""
    chain = vars(module).get(HOOKS_ATTR)
    if chain is None:
        chain = {}
        object.__setattr__(module, HOOKS_ATTR, chain)
        if not any(c in _BASE for c in type(module).__mro__):
            module.__class__ = _hooked_class(type(module))
    if key in chain:
        raise ValueError(f"{type(module).__name__} already has a {key!r} hook")
    items = [(key, hook), *chain.items()] if inner else [*chain.items(), (key, hook)]
    chain.clear()  # the same dict, in the new order
    chain.update(items)


def get_hook(module: Any, key: str) -> Hook | None:
    """The module's hook under ``key``, or None."""
    return vars(module).get(HOOKS_ATTR, {}).get(key)


def remove_hook(module: Any, key: str) -> None:
    """Remove the hook under ``key`` (KeyError if none); the last one restores the class."""
    chain = vars(module)[HOOKS_ATTR]
    del chain[key]
    if not chain and type(module) in _BASE:
        module.__class__ = _BASE[type(module)]
        object.__delattr__(module, HOOKS_ATTR)


def own_class(module: Any) -> type:
    """The module's class as if it had no hooks (``Hooked<Class>`` -> ``Class``)."""
    cls = type(module)
    return _BASE.get(cls, cls)


def set_own_class(module: Any, cls: type) -> None:
    """Give ``module`` the class ``cls`` under its hooks (a hooked subclass when hooked)."""
    module.__class__ = _hooked_class(cls) if type(module) in _BASE else cls


_MIXED: dict[tuple[type, type], type] = {}


def add_mixin(obj: Any, mixin: type) -> None:
    """Give ``obj`` the methods of ``mixin`` (its class swapped for a cached subclass)."""
    cls = type(obj)
    sub = _MIXED.get((mixin, cls))
    if sub is None:
        name = mixin.__name__.removesuffix("Methods").lstrip("_")
        sub = type(f"{name}{cls.__name__}", (mixin, cls),
                   {"__doc__": cls.__doc__, "__module__": cls.__module__})
        _MIXED[(mixin, cls)] = sub
    obj.__class__ = sub
