"""Which r3srv packages may import which, read from the sources (every import, at the top of a
module or inside a function; `if TYPE_CHECKING:` blocks aside, which never run):

- kernels/ imports nothing of the models, the ops, the engine or the settings (a backend hands a
  kernel what it needs);
- ops/ imports nothing of the models or the engine (the layers call the ops, not the other way);
- no two modules of the engine import each other, directly or through others;
- no module of the engine reaches for another object's private names (`obj._name`), its own
  and its class's aside.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "r3srv"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The r3srv modules `path` imports (a `from r3srv.x import y` counts as r3srv.x.y where
    that is a module, else r3srv.x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(node) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for node in ast.walk(node)}
    names = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names |= {f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base for alias in node.names}
    return {name for name in names if name == "r3srv" or name.startswith("r3srv.")}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


GRAPH = {module_name(path): imports(path) for path in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("package, forbidden", [
    ("r3srv.kernels", ("r3srv.models", "r3srv.ops", "r3srv.engine", "r3srv.settings")),
    ("r3srv.ops", ("r3srv.models", "r3srv.engine")),
])
def test_a_lower_package_imports_nothing_above_it(package, forbidden):
    found = {module: sorted(name for name in names if name.startswith(forbidden))
             for module, names in GRAPH.items() if module.startswith(package)}
    assert {module: names for module, names in found.items() if names} == {}


def test_the_graph_is_read():  # the checks above would pass on an empty graph
    assert "r3srv.ops.table" in GRAPH["r3srv.models.model"] or "r3srv.ops" in GRAPH["r3srv.models.model"]
    assert "r3srv.kernels.rust_core" in GRAPH["r3srv.kernels.linear_cpu"]
    assert "r3srv.engine.scheduler" in GRAPH["r3srv.engine.core"]


def engine_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The engine modules that import themselves through other engine modules."""
    engine = {m: {n for n in names if n.startswith("r3srv.engine.")} for m, names in graph.items()
              if m.startswith("r3srv.engine.")}

    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for n in engine.get(stack.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    stack.append(n)
        return seen

    return sorted(m for m in engine if m in reach(m))


def test_no_engine_module_imports_itself_through_others():
    assert engine_cycles(GRAPH) == []
    # the check sees a cycle where there is one
    assert engine_cycles({"r3srv.engine.a": {"r3srv.engine.b"}, "r3srv.engine.b": {"r3srv.engine.a"}}) == [
        "r3srv.engine.a", "r3srv.engine.b"]


STDLIB_PRIVATES = {("os", "_exit")}


def private_reaches(path: Path) -> list[str]:
    """`obj._name` in a module, obj neither self nor cls (nor os._exit)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner not in ("self", "cls") and (owner, node.attr) not in STDLIB_PRIVATES:
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
    return found


def test_the_engine_uses_no_other_objects_private_names():
    assert [hit for path in sorted((PACKAGE / "engine").glob("*.py")) for hit in private_reaches(path)] == []

