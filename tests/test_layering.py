"""The package's shape stays as docs/architecture.md draws it.

Every module of ``pyloader/`` is parsed (imports inside functions included) and:

* imports only from its own subpackage or from components earlier in :data:`ORDER`
  (dependencies point one way);
* takes part in no import cycle;
* never imports the package root (``pyloader/__init__.py`` only re-exports);
* never imports another module's underscore name, nor reads one off an imported module
  (a missing interface, otherwise);
* at most two ``_pyloader*`` attribute names exist (the model's handle and a hooked
  module's hook chain: pyloader/_util/hooks.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pyloader

ROOT = Path(pyloader.__file__).resolve().parent

#: Components of the package, lowest first: each may import only from itself and from
#: the ones before it.
ORDER = [
    "_version", "_core", "_native", "_util", "errors",  # the leaf layer
    "io", "gguf",                                       # checkpoints, readers (no mlx-lm)
    "kernels",                                          # CPU kernels under nn modules
    "default_model",
    "streaming",                                        # the controller
    "kv", "heads", "distributed",                       # built on the controller
    "launcher",                                         # mlx.launch, rank statuses
    "loading",                                          # load_model
    "serving",                                          # mlx-lm's server over load_model
    "generation", "residency",
    "bench",                                            # measuring
    "cli",                                              # the command line
    "__main__",
]
#: Modules that are not Python files in the source tree.
EXTENSIONS = {"pyloader._core"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES or name in EXTENSIONS


def _package_of(module: str) -> str:
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    if node.level > 1:
        base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(line, imported module, imported name or None) for every pyloader import."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pyloader":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target.split(".")[0] != "pyloader":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if _is_module(sub):
                    yield node.lineno, sub, None
                else:
                    yield node.lineno, target, alias.name


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {m: {t for _, t, _ in _imports(m) if t in MODULES} for m in MODULES}


def test_every_component_is_placed():
    components = {_component(m) for m in MODULES} - {"__init__"}
    assert components <= set(ORDER), f"not in ORDER: {sorted(components - set(ORDER))}"


def test_dependencies_point_one_way():
    rank = {c: i for i, c in enumerate(ORDER)}
    bad = []
    for m in MODULES:
        src = _component(m)
        if src == "__init__":
            continue  # the root re-exports everything
        for line, target, _ in _imports(m):
            dst = _component(target)
            if target == "pyloader":
                bad.append(f"{m}:{line} imports the package root")
            elif dst != src and dst != "__init__" and rank.get(dst, 99) >= rank[src]:
                bad.append(f"{m}:{line} imports {target} ({dst} is not below {src})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_underscore_names_across_modules():
    bad = []
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> pyloader module it is bound to
        for line, target, name in _imports(m):
            if name is not None and _private(name) and target != m:
                bad.append(f"{m}:{line} imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(m, node)
                for alias in node.names:
                    if _is_module(f"{target}.{alias.name}"):
                        bound[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name.startswith("pyloader."):
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and _private(node.attr)
                    and not _is_module(f"{bound[node.value.id]}.{node.attr}")):
                bad.append(f"{m}:{node.lineno} reads {bound[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_at_most_two_attribute_names_on_foreign_objects():
    names = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("_pyloader"):
                    names.add(node.value)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_pyloader"):
                names.add(node.attr)
    assert names <= {"_pyloader", "_pyloader_hooks"} and len(names) <= 2, sorted(names)


@pytest.mark.parametrize("source, message", [
    ("from .streaming.controller import _owner\n", "imports pyloader.streaming.controller._owner"),
    ("import pyloader.io.readers as r\nr._x\n", "reads pyloader.io.readers._x"),
])
def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch, source, message):
    """The underscore check fails on a module that breaks the rule (so it can fail)."""
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "pyloader.fake", fake)
    with pytest.raises(AssertionError, match=message.replace(".", r"\.")):
        test_no_underscore_names_across_modules()


def test_the_cycle_check_can_fail(tmp_path, monkeypatch):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from . import fake_b\n")
    b.write_text("def f():\n    from . import fake_a\n")
    monkeypatch.setitem(MODULES, "pyloader.fake_a", a)
    monkeypatch.setitem(MODULES, "pyloader.fake_b", b)
    with pytest.raises(AssertionError, match="fake_a"):
        test_no_import_cycles()
