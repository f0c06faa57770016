"""The package's shape: no import cycle between specd's modules, and an engine that names no proposer or k policy.

Imports are read from the source (AST), wherever they stand: at module level or inside a function (a lazy
import that closes a cycle is still a cycle). Only `if TYPE_CHECKING:` blocks are left out: they never run and
exist for annotations alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import specd
from specd.speculation.policies import K_POLICIES
from specd.speculation.registry import PROPOSERS

SRC = Path(specd.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """specd modules that `tree` imports at run time (`from a.b import c` imports a.b.c when that is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in SRC.rglob("*.py")}
    return {name: _imported(ast.parse(path.read_text()), set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None. Depth-first search with an explicit path."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    lazy = ast.parse("def f():\n    import x.y\nif TYPE_CHECKING:\n    import x.z\n")
    assert _imported(lazy, {"x.y", "x.z"}) == {"x.y"}  # function-level counts, TYPE_CHECKING does not


def test_no_import_cycle_in_specd() -> None:
    graph = import_graph()
    assert "specd.engine.engine" in graph and "specd.model.loader" in graph["specd.llm"]  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_engine_names_no_proposer_and_no_k_policy() -> None:
    """Neither as a string nor as a word. `draft` is both a proposer and what every proposer makes, so for it only
    string literals count."""
    names = set(PROPOSERS) | set(K_POLICIES)
    for path in sorted((SRC / "engine").glob("*.py")):
        text = path.read_text()
        strings = {node.value for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Constant)}
        assert not names & strings, f"{path.name} compares against {names & strings}"
        words = set(re.findall(r"[a-z0-9]+", text.lower()))
        assert not (names - {"draft"}) & words, f"{path.name} names {(names - {'draft'}) & words}"
