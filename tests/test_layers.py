"""service/'s layers, read from its imports: no circle, the launcher above the front ends, one door to the pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = "service.launch"
PIPELINE = "service.pipeline"
PIPELINE_DOOR = "service.pipeline.api"
ONE_DOOR_FRONTENDS = ("service.frontends",)
"""Front ends that reach the pipeline through its door only."""


def module_name(path: Path, root: Path) -> str:
    """A source file's dotted module name under `root` (a package's is its folder's)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules among `modules` that `name` imports, typing-only ones too (`from a import b`: a.b if a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return found & modules


def import_graph(root: Path, package: str = "service") -> dict[str, set[str]]:
    """Each module of the package in `root` -> the package's modules it imports."""
    paths = {module_name(path, root): path for path in (root / package).rglob("*.py")}
    modules = set(paths)
    return {name: imported(name, path, modules) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's import circles: each set of modules that reach one another (or a module importing itself)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1 or module in graph[module]:
                found.append(sorted(members))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def within(module: str, package: str) -> bool:
    """Whether a module is the package or one of its modules."""
    return module == package or module.startswith(package + ".")


def test_no_import_circle_in_service() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_no_front_end_imports_the_launcher() -> None:
    graph = import_graph(ROOT)
    reaching = {
        module: sorted(other for other in imports if within(other, LAUNCHER))
        for module, imports in graph.items()
        if within(module, "service.frontends")
    }
    assert {module: found for module, found in reaching.items() if found} == {}


def test_the_grpc_front_end_enters_the_pipeline_through_its_api_only() -> None:
    graph = import_graph(ROOT)
    reaching = {
        module: sorted(other for other in imports if within(other, PIPELINE) and other != PIPELINE_DOOR)
        for module, imports in graph.items()
        if any(within(module, frontend) for frontend in ONE_DOOR_FRONTENDS)
    }
    assert {module: found for module, found in reaching.items() if found} == {}


def test_the_checks_catch_a_circle_and_a_side_door(tmp_path: Path) -> None:
    pipeline = tmp_path / "service" / "pipeline"
    pipeline.mkdir(parents=True)
    for package in (tmp_path / "service", pipeline):
        (package / "__init__.py").write_text("")
    (pipeline / "a.py").write_text("from service.pipeline import b\n")
    (pipeline / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import A\n")
    (pipeline / "api.py").write_text("from service.pipeline.b import B\n")
    graph = import_graph(tmp_path)
    assert graph["service.pipeline.api"] == {"service.pipeline.b"}
    assert cycles(graph) == [["service.pipeline.a", "service.pipeline.b"]]
