"""labkit's shape holds: no import cycles (not even through an annotation's import or a package's
``__init__``), no upward imports between layers, ``cli`` imported by nobody, and no labkit import
hidden in a function. The layers are documented in ``labkit/__init__.py``; this test is their
definition."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import labkit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labkit"

#: Each top-level part of labkit and its layer, from the bottom.
LAYERS = {
    "errors": 1,
    "settings": 1,
    "proc": 1,
    "runs": 1,
    "shown": 1,
    "hardware": 2,
    "repository": 2,
    "server": 3,
    "client": 4,
    "streaming": 4,
    "load": 4,
    "embedding": 4,
    "profiling": 4,
    "capacity": 4,
    "neuron": 4,
    "cluster": 4,
    "deploy": 4,
    "lab": 5,
    "headless": 5,
    "report": 5,
    "widgets": 5,
    "plots": 5,
    "doctor": 5,
    "bench": 5,
    "llm_serving": 5,
    "soak": 5,
    "pipeline": 5,
    "gpu_check": 5,
    "lessons": 5,
    "exercises": 5,
    "cli": 6,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def labkit_modules() -> dict[str, Path]:
    """Every module of the package except the model templates (they run inside Triton)."""
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if "templates" not in p.relative_to(PACKAGE).parts
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> tuple[set[str], set[str]]:
    """(imported at module level, imported inside a function) labkit modules of ``path``.

    Imports under ``if TYPE_CHECKING:`` are for annotations only and are not counted
    (:func:`annotation_imports` has them).
    """
    return _imports(path)[:2]


def annotation_imports(path: Path) -> set[str]:
    """The labkit modules ``path`` imports under ``if TYPE_CHECKING:``, for annotations only."""
    return _imports(path)[2]


def _imports(path: Path) -> tuple[set[str], set[str], set[str]]:
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top: set[str] = set()
    inner: set[str] = set()
    typing: set[str] = set()

    def targets(node: ast.AST) -> set[str]:
        found = set()
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            if stem == "labkit" or stem.startswith("labkit."):
                submodules = {f"{stem}.{a.name}" for a in node.names} & KNOWN
                found.update(submodules)
                if len(submodules) < len(node.names):  # names defined by the module itself
                    found.add(stem)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("labkit"))
        return found

    def visit(node: ast.AST, in_function: bool, for_typing: bool = False) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = targets(child)
                (typing if for_typing else inner if in_function else top).update(found)
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            visit(
                child, nested, for_typing or isinstance(child, ast.If) and _is_type_checking(child)
            )

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return top & KNOWN, inner & KNOWN, typing & KNOWN


def part(module: str) -> str:
    """``labkit.server.live`` -> ``server``; ``labkit`` -> ``labkit``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "labkit"


KNOWN = set(labkit_modules())
GRAPH = {name: imports(path) for name, path in labkit_modules().items()}


def test_every_part_of_labkit_has_a_layer():
    parts = {part(m) for m in GRAPH} - {"labkit"}
    assert parts <= set(LAYERS), f"give these a layer in LAYERS: {parts - set(LAYERS)}"


def test_no_module_imports_from_a_higher_layer():
    upward = [
        f"{module} (layer {LAYERS[part(module)]}) imports {target} (layer {LAYERS[part(target)]})"
        for module, (top, inner) in GRAPH.items()
        if part(module) != "labkit"
        for target in top | inner
        if part(target) != "labkit" and LAYERS[part(target)] > LAYERS[part(module)]
    ]
    assert upward == []


def test_nothing_outside_cli_imports_cli():
    users = [
        module
        for module, (top, inner) in GRAPH.items()
        if part(module) != "cli" and any(part(t) == "cli" for t in top | inner)
    ]
    assert users == []


def test_no_labkit_import_is_hidden_inside_a_function():
    hidden = {module: sorted(inner) for module, (_, inner) in GRAPH.items() if inner}
    assert hidden == {}


def packages_run_by(target: str) -> set[str]:
    """What importing ``target`` runs: the module and each package above it (their ``__init__``)."""
    parts = target.split(".")
    return {".".join(parts[:n]) for n in range(2, len(parts) + 1)} & KNOWN


def import_edges() -> dict[str, set[str]]:
    """module -> the labkit modules importing it runs: its module-level imports, its imports for
    annotations (a circle through ``TYPE_CHECKING`` is still a circle between the two designs),
    and the packages above each (``labkit.a.b`` runs ``labkit/a/__init__.py`` first).

    A package's ``__init__`` re-exports its submodules: an edge from a submodule to its own
    package is the submodule reading a sibling through the package, which
    :func:`test_a_submodule_never_imports_its_own_package` forbids; it is left out here."""
    edges = {}
    for module, path in labkit_modules().items():
        top, _ = GRAPH[module]
        run = set().union(*(packages_run_by(t) for t in top | annotation_imports(path)))
        edges[module] = {t for t in run if t != module and not module.startswith(t + ".")}
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of ``edges`` meets, each as the modules along it."""
    state: dict[str, int] = {}
    cycles = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    return cycles


def test_the_module_import_graph_has_no_cycle():
    assert find_cycles(import_edges()) == []


def test_the_cycle_check_finds_a_circle_through_an_annotation_and_a_package():
    """The circle a review found, as it was: ``lessons/inflight.py`` imported ``llm_serving``'s
    ``Comparison`` for annotations, and ``llm_serving/__init__`` imported ``charts``, which
    imported ``way_name`` from ``lessons/inflight.py``."""
    edges = {
        "labkit.lessons.inflight": packages_run_by("labkit.llm_serving.rounds"),
        "labkit.llm_serving": {"labkit.llm_serving.charts"},
        "labkit.llm_serving.charts": {"labkit.lessons.inflight"},
        "labkit.llm_serving.rounds": set(),
    }
    assert find_cycles(edges) == [
        ["labkit.lessons.inflight", "labkit.llm_serving", "labkit.llm_serving.charts",
         "labkit.lessons.inflight"]
    ]  # fmt: skip


def test_a_submodule_never_imports_its_own_package():
    """``labkit/server/live.py`` importing ``labkit.server`` would run the package's
    ``__init__`` (which imports live.py) half-way: siblings are imported by their own names."""
    offenders = [
        (module, target)
        for module, (top, _) in GRAPH.items()
        for target in top
        if module.startswith(target + ".") and not module.endswith(".__main__")
    ]
    assert offenders == []


def test_the_top_level_lists_the_modules_the_notebooks_use():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    code = "\n".join(
        "".join(cell["source"])
        for nb in notebooks
        for cell in json.loads(nb.read_text())["cells"]
        if cell["cell_type"] == "code"
    )
    for name in labkit.__all__:
        assert importlib.import_module(f"labkit.{name}")
        assert f"labkit.{name}" in code or f" {name}" in code, f"no notebook uses labkit.{name}"
