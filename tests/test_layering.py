"""The package's shape stays as docs/architecture.md draws it.

Every module of ``pyloader/`` is parsed (imports inside functions included) and:

* imports only from its own subpackage or from components earlier in :data:`ORDER`
  (dependencies point one way);
* takes part in no import cycle;
* never imports the package root (``pyloader/__init__.py`` only re-exports);
* never imports another module's underscore name, nor reads one off an imported module
  (a missing interface, otherwise);
* in the streaming package, whose objects are parts composed by the controller, no
  object reads another object's underscore attribute;
* at most two ``_pyloader*`` attribute names exist (the model's handle and a hooked
  module's hook chain: pyloader/_util/hooks.py);
* components below ``loading`` never import mlx-lm when they are imported (it is an
  optional dependency: the checkpoint tools and the CLI run without it), and no module
  imports an engine (mlx-vlm, mlx-whisper, mlx-embeddings) when it is imported;
* the benchmark suites stay outside the package: no module of ``pyloader/`` imports the
  source tree's ``bench/`` (its scripts or ``benchlib``), and no module of ``bench/``
  imports an underscore module or name of pyloader (they use its public modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pyloader

ROOT = Path(pyloader.__file__).resolve().parent
#: The source tree's benchmark directory (scripts and ``benchlib``).
BENCH = Path(__file__).resolve().parents[1] / "bench"

#: Components of the package, lowest first: each may import only from itself and from
#: the ones before it.
ORDER = [
    "_version", "_core", "_native", "_util", "errors",  # the leaf layer
    "io", "gguf",                                       # checkpoints, readers (no mlx-lm)
    "kernels", "cpu_kernels",                           # CPU kernels under nn modules
    "gguf_model",                                       # GGUF files as mlx-lm models
    "default_model",
    "streaming",                                        # the controller
    "kv", "heads", "distributed",                       # built on the controller
    "engines",                                          # mlx-vlm, mlx-whisper, ... models
    "launcher",                                         # mlx.launch, rank statuses
    "loading",                                          # load_model
    "serving",                                          # mlx-lm's server over load_model
    "generation", "residency",
    "compare",                                          # pyloader compare's measuring
    "testing",                                          # the opt-in pytest plugin
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


#: Packages whose objects are parts composed by another (the streaming controller's
#: layer units, stray units, call order, expert caches, recorder): a part reads only the
#: public names of another, never ``other._x``.
PARTS = ("pyloader.streaming",)


def test_parts_read_no_underscore_attribute_of_another_object():
    bad = []
    for m, path in MODULES.items():
        if not m.startswith(PARTS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
                bad.append(f"{m}:{node.lineno} reads {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_the_parts_check_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "fake.py"
    fake.write_text("class C:\n    def f(self):\n        return self.units._schedule\n")
    monkeypatch.setitem(MODULES, "pyloader.streaming.fake", fake)
    with pytest.raises(AssertionError, match=r"fake:3 reads self\.units\._schedule"):
        test_parts_read_no_underscore_attribute_of_another_object()


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


#: The first component allowed to import mlx-lm when it is imported.
MLX_LM_FROM = "loading"


def _import_time_imports(tree: ast.AST):
    """The import statements a module runs when it is imported: everywhere but inside
    functions (class bodies and ``if``/``try`` blocks run at import)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_time_imports(node)


def test_lower_layers_import_mlx_lm_only_when_used():
    rank = {c: i for i, c in enumerate(ORDER)}
    bad = []
    for m, path in MODULES.items():
        if rank.get(_component(m), len(ORDER)) >= rank[MLX_LM_FROM]:
            continue
        for node in _import_time_imports(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            if any(n.split(".")[0] == "mlx_lm" for n in names):
                bad.append(f"{m}:{node.lineno} imports mlx_lm when imported (import it "
                           "where it is used: pyloader/_util/optional.py)")
    assert not bad, "\n".join(bad)


#: Engines pyloader builds models with (pyloader.engines): optional, imported where used.
ENGINE_PACKAGES = {"mlx_vlm", "mlx_whisper", "mlx_embeddings", "transformers"}


def test_no_module_imports_an_engine_when_imported():
    bad = []
    for m, path in MODULES.items():
        for node in _import_time_imports(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            if any(n.split(".")[0] in ENGINE_PACKAGES for n in names):
                bad.append(f"{m}:{node.lineno} imports an engine when imported")
    assert not bad, "\n".join(bad)


def test_the_engine_import_check_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "fake.py"
    fake.write_text("import mlx_whisper.load_models\n")
    monkeypatch.setitem(MODULES, "pyloader.engines.fake", fake)
    with pytest.raises(AssertionError, match=r"pyloader\.engines\.fake:1 imports an engine"):
        test_no_module_imports_an_engine_when_imported()


@pytest.mark.parametrize("source", [
    "from mlx_lm.models import cache\n",
    "import mlx_lm.utils\n",
    "try:\n    import mlx_lm\nexcept ImportError:\n    pass\n",
    "class C:\n    from mlx_lm import load\n",
])
def test_the_mlx_lm_check_can_fail(tmp_path, monkeypatch, source):
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "pyloader.kv.fake", fake)
    with pytest.raises(AssertionError, match=r"pyloader\.kv\.fake:\d+ imports mlx_lm"):
        test_lower_layers_import_mlx_lm_only_when_used()


def test_the_mlx_lm_check_allows_imports_where_used(tmp_path, monkeypatch):
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    import mlx_lm\n")
    monkeypatch.setitem(MODULES, "pyloader.kv.fake", fake)
    monkeypatch.setitem(MODULES, "pyloader.serving.fake", tmp_path / "top.py")
    (tmp_path / "top.py").write_text("import mlx_lm\n")  # serving is above loading
    test_lower_layers_import_mlx_lm_only_when_used()


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


def _bench_names() -> set[str]:
    """Top-level names the files of bench/ are imported as (bench/ is on sys.path)."""
    names = {p.stem for p in BENCH.glob("*.py")}
    names |= {p.name for p in BENCH.iterdir() if (p / "__init__.py").is_file()}
    return names


def _top_level_imports(path: Path):
    """(line, top-level module name) of every absolute import in a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module.split(".")[0]


def test_the_package_never_imports_bench():
    bench = _bench_names() | {"bench"}
    bad = [f"{m}:{line} imports {name} (bench/)" for m, path in MODULES.items()
           for line, name in _top_level_imports(path) if name in bench]
    assert not bad, "\n".join(bad)


def _bench_private_imports(path: Path):
    """Where a bench file imports an underscore module or name of pyloader."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in modules:
            parts = module.split(".")
            if parts[0] != "pyloader":
                continue
            if any(_private(p) for p in parts) or (name is not None and _private(name)):
                yield f"{path.parent.name}/{path.name}:{node.lineno} imports " + (
                    f"{module}.{name}" if name else module)


def _bench_violations(root: Path) -> list[str]:
    return [hit for path in sorted(root.rglob("*.py")) for hit in _bench_private_imports(path)]


def test_bench_uses_only_public_modules_of_pyloader():
    bad = _bench_violations(BENCH)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source", ["from pyloader import _core\n",
                                    "from pyloader._util.fs import cache_dir\n",
                                    "def f():\n    from pyloader.io.readers import _x\n"])
def test_the_bench_check_can_fail(tmp_path, source):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "fake.py").write_text(source)
    assert [hit.partition(" ")[0] for hit in _bench_violations(tmp_path / "bench")] == [
        f"bench/fake.py:{source.count(chr(10))}"]


def test_the_package_check_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "fake.py"
    fake.write_text("from benchlib.paths import RAW\n")
    monkeypatch.setitem(MODULES, "pyloader.fake", fake)
    with pytest.raises(AssertionError, match=r"pyloader\.fake:1 imports benchlib"):
        test_the_package_never_imports_bench()


def test_only_the_command_line_runs_pip():
    """Downloads of packages (the default model's wheel) are the CLI's job, never the
    library's (pyloader/cli/fetch_model.py)."""
    bad = [m for m, path in MODULES.items() if _component(m) != "cli"
           for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.Constant) and node.value == "pip"]
    assert not bad, f"modules running pip outside pyloader.cli: {sorted(set(bad))}"
