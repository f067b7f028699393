"""Lint, types and layers, checked in every test run (``.ci/run`` runs them through pytest).

ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade, async
pitfalls), mypy on the package, and import-linter's contracts from
pyproject.toml: arrows between the layers only point down, and the FUSE
protocol layer imports nothing of the rest.  And the code's shape (issue
35): no class over 400 lines, no module over 600 without a stated reason,
no import cycle; measured here with ``ast`` so the shape holds as the code
grows.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("command", [
    ["ruff", "check", "mithrilfs", "tests", "scripts"],
    ["mypy"],
    ["lint-imports"],
], ids=["ruff", "mypy", "import-linter"])
def test_clean(command: list[str]) -> None:
    res = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


# ----------------------------------------------------------------------
# Code shape: sizes and import cycles (issue 35)
# ----------------------------------------------------------------------
#: A class longer than this does more than one job: split it by responsibility.
MAX_CLASS_LINES = 400
#: A module longer than this needs a stated reason: a line of its docstring starting with ``Size:``.
MAX_MODULE_LINES = 600
SIZE_REASON = "Size:"

def _modules(package: Path) -> dict[str, Path]:
    """Every module of *package* by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def oversized(package: Path) -> list[str]:
    """Each class over ``MAX_CLASS_LINES`` and module over ``MAX_MODULE_LINES`` (without a reason), as
    ``path::Class`` or ``path``, with its length."""
    found = []
    for path in _modules(package).values():
        text = path.read_text()
        tree = ast.parse(text)
        where = path.relative_to(package.parent).as_posix()
        lines = len(text.splitlines())
        doc = ast.get_docstring(tree) or ""
        if lines > MAX_MODULE_LINES and not any(line.strip().startswith(SIZE_REASON) for line in doc.splitlines()):
            found.append(f"{where}: {lines} lines (over {MAX_MODULE_LINES}, no '{SIZE_REASON}' line in its docstring)")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                size = (node.end_lineno or node.lineno) - first + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{where}::{node.name}: {size} lines (over {MAX_CLASS_LINES})")
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt], *, typing: bool) -> Iterator[ast.stmt]:
    """The statements run when the module is imported (into ``if`` and ``try``, not into functions);
    ``if TYPE_CHECKING:`` blocks only for *typing*."""
    for node in body:
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test) or typing:
                yield from _module_level(node.body, typing=typing)
            yield from _module_level(node.orelse, typing=typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block, typing=typing)
        else:
            yield node


def import_graph(package: Path, *, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (``from a import b``: ``a.b`` when
    that is a module, else ``a``)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in _module_level(ast.parse(path.read_text()).body, typing=typing):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = f"{base}.{source}" if source else base
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        out.add(f"{source}.{alias.name}")
                    elif source in modules:
                        out.add(source)
        out.discard(name)
        graph[name] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle, as a path back to its start, through each group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            group.add(v)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        todo = [start]
        while todo:  # breadth first inside the group, until an arrow leads back to the start
            v = todo.pop(0)
            if start in graph[v]:
                found.append([*paths[v], start])
                break
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    todo.append(w)
    return found


def test_no_class_or_module_is_too_big() -> None:
    """No class over 400 lines, no module over 600 without a reason (a ``Size:`` line in its docstring)."""
    found = oversized(REPO / "mithrilfs")
    assert not found, "split by responsibility (one job per module):\n" + "\n".join(found)


@pytest.mark.parametrize("typing", [False, True], ids=["as-run", "for-the-type-checker"])
def test_no_import_cycle(typing: bool) -> None:
    """The modules' imports (at module level, as run; with *typing*, the ``TYPE_CHECKING`` ones too) form
    no cycle: a part handed its owner types it by a protocol of what it uses (``shared.tier_state``),
    never by importing the owner's module back."""
    found = cycles(import_graph(REPO / "mithrilfs", typing=typing))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_shape_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The checks above fail for a class or module too big and for a cycle, in a package made here."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (pkg / "big.py").write_text(f'"""A big class."""\n\n\nclass Big:\n{body}\n\n\nclass Small:\n    pass\n')
    (pkg / "long.py").write_text("\n" * (MAX_MODULE_LINES + 1))
    (pkg / "reason.py").write_text(f'"""Long.\n\n{SIZE_REASON} a table.\n"""\n' + "\n" * MAX_MODULE_LINES)
    (pkg / "a.py").write_text("from pkg.sub.b import f\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg import big\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import big\n\n\nfrom ..c import g\n")
    (pkg / "c.py").write_text("import pkg.a\n\n\ndef g():\n    pass\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("from pkg import d\n")
    assert sorted(f.split(": ")[0] for f in oversized(pkg)) == ["pkg/big.py::Big", "pkg/long.py"]
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert sorted(map(tuple, cycles(import_graph(pkg, typing=True)))) == [
        ("pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"), ("pkg.d", "pkg.e", "pkg.d")]
