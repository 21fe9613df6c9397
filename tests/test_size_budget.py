"""The package and its docs stay the size a newcomer can read (issue 55's budgets): the
package's Python at most 20,000 lines, no module over 600, no function over 8 parameters
(``load_model`` excepted: mlx_lm.load's arguments and pyloader's own, each named), docs/ at
most 25,000 words, the README at most 800 words in at most 8 sections."""

from __future__ import annotations

import ast
from pathlib import Path

import pyloader

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(pyloader.__file__).resolve().parent
PACKAGE_LINES, MODULE_LINES, PARAMETERS = 20_000, 600, 8
DOCS_WORDS, README_WORDS, README_SECTIONS = 25_000, 800, 8
#: Functions allowed more parameters, by qualified name.
WIDE = {"pyloader.loading.load_model"}


def line_counts(package: Path) -> dict[str, int]:
    """Lines of each module of ``package``, by path relative to its parent."""
    return {str(p.relative_to(package.parent)): len(p.read_text().splitlines())
            for p in sorted(package.rglob("*.py"))}


def wide_functions(package: Path, limit: int) -> list[str]:
    """``module.function (n)`` for each function of more than ``limit`` parameters
    (``self`` and ``cls`` not counted) outside :data:`WIDE`."""
    out = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                         if x.arg not in ("self", "cls")]
                name = f"{module}.{node.name}"
                if len(names) > limit and name not in WIDE:
                    out.append(f"{name} ({len(names)})")
    return out


def words(paths: list[Path]) -> int:
    """Whitespace-separated words in ``paths`` (as ``wc -w`` counts them)."""
    return sum(len(p.read_text().split()) for p in paths)


def test_the_package_keeps_its_line_budget():
    counts = line_counts(PACKAGE)
    total = sum(counts.values())
    assert total <= PACKAGE_LINES, f"the package is {total} lines > {PACKAGE_LINES}"
    big = {p: n for p, n in counts.items() if n > MODULE_LINES}
    assert not big, f"modules over {MODULE_LINES} lines: {big}"


def test_no_function_takes_more_than_eight_parameters():
    assert not wide_functions(PACKAGE, PARAMETERS)


def test_the_docs_keep_their_word_budget():
    n = words(sorted((ROOT / "docs").glob("*.md")))
    assert n <= DOCS_WORDS, f"docs/ is {n} words > {DOCS_WORDS}"
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= README_WORDS
    sections = [line for line in readme.splitlines() if line.startswith("## ")]
    assert len(sections) <= README_SECTIONS, sections


def test_the_budget_checks_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(a, b, c, d, e, f, g, h, i):\n    pass\n" + "x = 1\n" * 700)
    (pkg / "b.py").write_text("class C:\n    def m(self, a, b, c, d, e, f, g, h):\n"
                              "        pass\n")
    assert line_counts(pkg) == {"pkg/a.py": 702, "pkg/b.py": 3}
    assert wide_functions(pkg, PARAMETERS) == ["pkg.a.f (9)"]
    (tmp_path / "d.md").write_text("two words\nand three more\n")
    assert words([tmp_path / "d.md"]) == 5
