"""Lint, types and layers, checked in every test run (``.ci/run`` runs them through pytest).

ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade, async
pitfalls), mypy on the package, and import-linter's contracts from
pyproject.toml: arrows between the layers only point down (the top level's
and the shared tier's), the FUSE protocol layer imports nothing of the
rest, the shared tier's backends import nothing of one another.  And the
code's shape, measured here with ``ast`` so it holds as the code grows: no
class over 400 lines, no module over 600 without a stated reason, no import
cycle (imports inside functions count); in the shared tier, no ``isinstance``
on a store class outside the dispatch and no reaching into another object's
``_private`` attributes.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
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
# Code shape: sizes and import cycles
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


def _imports(nodes: Iterable[ast.AST], *, typing: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import in *nodes*, at any depth: at module level (into ``if``, ``try``, ``with``) and inside
    classes and functions (methods, nested functions, the blocks inside them: they run too, only later);
    ``if TYPE_CHECKING:`` blocks only for *typing*."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not typing:
            yield from _imports(node.orelse, typing=typing)
        else:
            yield from _imports(ast.iter_child_nodes(node), typing=typing)


def import_graph(package: Path, *, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function (``from a import
    b``: ``a.b`` when that is a module, else ``a``)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in _imports([ast.parse(path.read_text())], typing=typing):
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


# ----------------------------------------------------------------------
# The shared tier: one dispatch, no reaching into another object's privates
# ----------------------------------------------------------------------
#: The shared tier's stores, one package per backend under it, relative to the package's root.
STORES = Path("shared", "stores")
#: The one module that may ask which backend a store is (it builds them).
DISPATCH = STORES / "connect.py"
#: Underscore names that are public API (``namedtuple``'s).
PUBLIC_UNDERSCORED = frozenset({"_replace", "_asdict", "_fields", "_make"})


def store_classes(package: Path) -> set[str]:
    """The classes defined in the backends' packages (``shared/stores/<backend>/``)."""
    stores = package / STORES
    return {node.name for backend in sorted(stores.iterdir()) if backend.is_dir()
            for path in sorted(backend.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}


def _class_name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def backend_questions(package: Path) -> list[str]:
    """Each ``isinstance``/``issubclass`` on a store class outside the dispatch, as ``path:line: Class``
    (through ``from ... import Class as Alias`` too)."""
    classes = store_classes(package)
    found: list[tuple[str, int, str]] = []
    for path in _modules(package).values():
        if path == package / DISPATCH:
            continue
        tree = ast.parse(path.read_text())
        alias = {a.asname: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for a in node.names if a.asname}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                kinds = node.args[1]
                for kind in kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]:
                    name = _class_name(kind)
                    if name is not None and alias.get(name, name) in classes:
                        where = path.relative_to(package.parent).as_posix()
                        found.append((where, node.lineno, f"{node.func.id}(..., {name})"))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def _own_privates(tree: ast.Module) -> set[str]:
    """The underscore names a module defines: functions, classes, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_")}


def _is_own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes, wherever its class is written."""
    return (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")


def foreign_privates(package: Path, under: Path = Path("shared")) -> list[str]:
    """Each read or write of another object's ``_private`` attribute (one underscore; dunders are
    public) that this module does not define itself, in the modules under *under*: as
    ``path:line: value._name``."""
    found: list[tuple[str, int, str]] = []
    for path in _modules(package).values():
        if not path.is_relative_to(package / under):
            continue
        tree = ast.parse(path.read_text())
        own = _own_privates(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in PUBLIC_UNDERSCORED and node.attr not in own and not _is_own(node.value)):
                where = path.relative_to(package.parent).as_posix()
                found.append((where, node.lineno, ast.unparse(node)))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def test_only_the_dispatch_asks_which_backend() -> None:
    """No ``isinstance`` on a store class outside ``shared/stores/connect.py``: each backend exports what
    the tier needs (its store, feed, collector) and ``connect`` is the one place that picks them."""
    found = backend_questions(REPO / "mithrilfs")
    assert not found, "ask the store (a method of the interface), not its class:\n" + "\n".join(found)


def test_no_part_of_the_shared_tier_reaches_into_another_objects_privates() -> None:
    """No module of ``shared/`` reads or writes another object's ``_private`` attribute: a part gets its
    collaborators and calls their public methods."""
    found = foreign_privates(REPO / "mithrilfs")
    assert not found, "use (or add) a public method of the object's interface:\n" + "\n".join(found)


def test_no_class_or_module_is_too_big() -> None:
    """No class over 400 lines, no module over 600 without a reason (a ``Size:`` line in its docstring)."""
    found = oversized(REPO / "mithrilfs")
    assert not found, "split by responsibility (one job per module):\n" + "\n".join(found)


@pytest.mark.parametrize("typing", [False, True], ids=["as-run", "for-the-type-checker"])
def test_no_import_cycle(typing: bool) -> None:
    """The modules' imports (at module level and inside functions, as run; with *typing*, the
    ``TYPE_CHECKING`` ones too) form no cycle: an import moved into a function hides a cycle, it does not
    break it; a part is handed its collaborators (``shared.remote_tier`` builds them), never its owner,
    so it never imports the owner's module back."""
    found = cycles(import_graph(REPO / "mithrilfs", typing=typing))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


#: What a docstring or comment must not cite: its history is the commit log's, its figures docs/benchmarks.md's.
HISTORY = re.compile(r"\bissues? #?[0-9]+\b|\(#[0-9]+\)|\bflaky\b", re.IGNORECASE)


def cites_history(package: Path) -> list[str]:
    """Each line of *package*'s code that cites an issue number or a flaky test, as ``path:line``."""
    return [f"{path.relative_to(package.parent).as_posix()}:{n}"
            for path in _modules(package).values()
            for n, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]


def test_no_docstring_or_comment_cites_an_issue_or_a_flaky_test() -> None:
    """Docstrings and comments state the contract in the present tense: an issue number or a flaky test's
    story belongs to the commit message, a figure to docs/benchmarks.md (cited by its section)."""
    found = cites_history(REPO / "mithrilfs")
    assert not found, "history in the code (move it to the commit message or docs/):\n" + "\n".join(found)


def test_the_shape_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The checks above fail for a class or module too big and for a cycle (through an import inside a
    nested function's ``try``, or a ``TYPE_CHECKING`` block for the type checker), in a package made here."""
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
    (pkg / "f.py").write_text("from pkg import g\n")
    (pkg / "g.py").write_text("class G:\n    def m(self):\n        def inner():\n            if self:\n"
                              "                try:\n                    from pkg import f\n"
                              "                except ImportError:\n                    pass\n")
    assert sorted(f.split(": ")[0] for f in oversized(pkg)) == ["pkg/big.py::Big", "pkg/long.py"]
    as_run = [("pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"), ("pkg.f", "pkg.g", "pkg.f")]
    assert sorted(map(tuple, cycles(import_graph(pkg)))) == as_run
    assert sorted(map(tuple, cycles(import_graph(pkg, typing=True)))) == sorted([*as_run, ("pkg.d", "pkg.e", "pkg.d")])
    (pkg / "story.py").write_text('"""Fixed for issue 33."""\n\n# was flaky under load\nx = 1  # a tissue 3 is no issue\n')
    assert cites_history(pkg) == ["pkg/story.py:1", "pkg/story.py:3"]


def test_the_shared_tier_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The dispatch and privacy checks fail for a backend asked its class outside ``connect`` (through an
    alias and a tuple too) and for another object's ``_private`` read across modules, in a package made
    here; the store's own privates, ``super()``'s, dunders and ``namedtuple``'s API pass."""
    shared = tmp_path / "pkg" / "shared"
    (shared / "stores" / "redis").mkdir(parents=True)
    (shared / "fleet").mkdir()
    for init in ("", "shared", "shared/stores", "shared/stores/redis", "shared/fleet"):
        (tmp_path / "pkg" / init / "__init__.py").write_text("")
    (shared / "stores" / "base.py").write_text("class RemoteStore:\n    pass\n")
    (shared / "stores" / "redis" / "store.py").write_text(
        "from pkg.shared.stores.base import RemoteStore\n\n\nclass RedisStore(RemoteStore):\n"
        "    def _call(self):\n        return self._conn\n\n    def keys(self):\n        return super()._keys\n")
    (shared / "stores" / "connect.py").write_text(
        "from pkg.shared.stores.redis.store import RedisStore\n\n\ndef feed(store):\n"
        "    return isinstance(store, RedisStore)\n")
    (shared / "fleet" / "gc.py").write_text(
        "from pkg.shared.stores.base import RemoteStore\nfrom pkg.shared.stores.redis import store\n"
        "from pkg.shared.stores.redis.store import RedisStore as Fast\n\n\nclass Plan:\n"
        "    def run(self, s, row):\n        self._mine = isinstance(s, RemoteStore)\n"
        "        if isinstance(s, (int, Fast)) or issubclass(type(s), store.RedisStore):\n"
        "            return s._call(), s.__class__, row._replace(), self._mine, Plan()._mine\n")
    assert sorted(store_classes(tmp_path / "pkg")) == ["RedisStore"]
    assert backend_questions(tmp_path / "pkg") == [
        "pkg/shared/fleet/gc.py:9: isinstance(..., Fast)", "pkg/shared/fleet/gc.py:9: issubclass(..., RedisStore)"]
    assert foreign_privates(tmp_path / "pkg") == ["pkg/shared/fleet/gc.py:10: s._call"]
