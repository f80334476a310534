"""The modules of services/runtime import one another without a cycle.

Every import counts, at module level and inside functions (a function-level import only hides a
cycle until the function runs), except those under `if TYPE_CHECKING:` (never executed). An
import names the module it loads: `from pkg import sub` the submodule `pkg.sub` where one exists,
else `pkg` itself; the parent packages Python initialises on the way are not counted (a package
`__init__` that re-exports its submodules is not a cycle of theirs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services" / "runtime"
PACKAGE = "hybridcache.services.runtime"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The runtime modules that the module at `path` imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    me = _module_name(path)
    base = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                mod = f"{parent}.{node.module}" if node.module else parent
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for name in names:
            # the deepest runtime module the dotted name reaches
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                out.add(name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_of_counts_function_level_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hybridcache.services.runtime import c\n"
        "def f():\n    from hybridcache.services.runtime.b import thing\n")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "c.py").write_text("")
    modules = _modules()
    assert imports_of(tmp_path / "a.py", modules) == {f"{PACKAGE}.b"}


def test_runtime_has_no_import_cycle():
    modules = _modules()
    assert len(modules) > 20, modules  # the walk found the runtime
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    cycle = find_cycle(graph)
    if cycle is not None:
        pytest.fail("import cycle under services/runtime: " + " -> ".join(c.removeprefix(PACKAGE + ".") for c in cycle))
