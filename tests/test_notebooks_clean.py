"""Every shipped notebook is committed clean, parameterised, and keeps its logic in labkit."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MAX_CODE_LINES = 15


def load(path: Path) -> dict:
    """The notebook's JSON as committed (read raw, so nothing is normalised on the way)."""
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def is_parameters(cell: dict) -> bool:
    return "parameters" in cell.get("metadata", {}).get("tags", [])


def test_the_lab_ships_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs_or_execution_counts(path):
    nb = load(path)
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs or execution counts; clear them"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name}: saved widget state; clear it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_has_a_parameters_cell(path):
    nb = load(path)
    tagged = [c for c in nb["cells"] if is_parameters(c)]
    assert len(tagged) == 1 and tagged[0]["cell_type"] == "code", (
        f"{path.name}: needs exactly one code cell tagged 'parameters' (papermill), "
        f"found {len(tagged)}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_code_cells_are_short(path):
    """The parameters cell is exempt: it holds settings, not logic (the next test holds it to that)."""
    nb = load(path)
    lines = {i: len(source(c).splitlines()) for i, c in enumerate(nb["cells"])}
    long = {
        i: n
        for i, n in lines.items()
        if nb["cells"][i]["cell_type"] == "code"
        and not is_parameters(nb["cells"][i])
        and n > MAX_CODE_LINES
    }
    assert not long, (
        f"{path.name}: code cells longer than {MAX_CODE_LINES} lines (index: lines) {long}; "
        "move that logic into labkit, with a test"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_cells_have_ids(path):
    nb = load(path)
    missing = [i for i, c in enumerate(nb["cells"]) if not c.get("id")]
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5) and not missing, (
        f"{path.name}: nbformat {nb['nbformat']}.{nb['nbformat_minor']}, cells {missing} have "
        "no id (nbformat warns on every read, an error under -W error); save it from "
        "JupyterLab 4, or write it with nbformat.v4.new_notebook / new_code_cell"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_parameters_cell_holds_only_literal_assignments(path):
    """papermill overrides these names; a call or a computed value there would be logic in disguise."""
    cell = next(c for c in load(path)["cells"] if is_parameters(c))
    not_settings = []
    for node in ast.parse(source(cell)).body:
        try:
            literal = isinstance(node, ast.Assign) and ast.literal_eval(node.value) is not Ellipsis
        except ValueError:
            literal = False
        if not (literal and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)):
            not_settings.append(ast.unparse(node))
    assert not not_settings, (
        f"{path.name}: the parameters cell may only set UPPER_CASE names to literals, found "
        f"{not_settings}"
    )
