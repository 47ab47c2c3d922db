"""The notebooks' API stays small: each notebook imports from at most five labkit modules, all of
them in ``labkit.__all__``, and no notebook reaches into a private name."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import labkit

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def labkit_imports(notebook: Path) -> tuple[set[str], set[str]]:
    """(labkit modules the notebook imports from, names it takes from labkit)."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    modules: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
            for alias in node.names:
                if node.module == "labkit":
                    modules.add(f"labkit.{alias.name}")
                else:
                    modules.add(node.module)
                    names.add(alias.name)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("labkit")}
    return modules, names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_imports_from_at_most_five_public_labkit_modules(notebook):
    """Five for the lesson; ``exercises``, the learner's turn at the end, comes beside them."""
    modules, names = labkit_imports(notebook)
    assert modules, f"{notebook.name} imports nothing from labkit"
    assert len(modules - {"labkit.exercises"}) <= 5, (
        f"{notebook.name} imports from {sorted(modules)}"
    )
    top = {m.split(".")[1] for m in modules}
    assert top <= set(labkit.__all__), f"{sorted(top - set(labkit.__all__))} not in labkit.__all__"
    assert not [n for n in names if n.startswith("_")]


def test_the_counting_sees_both_import_forms(tmp_path):
    nb = tmp_path / "x.ipynb"
    source = "from labkit import lab, client\nfrom labkit.profiling import analyzer\n"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [source]}]}))
    assert labkit_imports(nb) == (
        {"labkit.lab", "labkit.client", "labkit.profiling"},
        {"analyzer"},
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_ends_on_its_takeaway_then_the_learners_turn_then_the_stop(notebook):
    """Every lesson's last word is computed (``lab.takeaway``, kept for the index). After it come
    only the learner's turn (01-08: a section headed "Your turn", whose cells end in a check) and
    the cells that stop its server."""
    cells = json.loads(notebook.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells]
    said = [i for i, s in enumerate(sources) if "lab.takeaway(" in s]
    assert len(said) == 1, f"{notebook.name}: {len(said)} cells call lab.takeaway"
    after = list(zip(cells[said[0] + 1 :], sources[said[0] + 1 :], strict=True))
    turns = [
        i
        for i, (c, s) in enumerate(after)
        if c["cell_type"] == "markdown" and s.startswith("## Your turn")
    ]
    if notebook.name[:2] == "00":
        assert not turns, notebook.name
    else:
        assert turns and turns[0] == 0, (
            f"{notebook.name}: the learner's turn must follow the takeaway"
        )
    code = [(i, s) for i, (c, s) in enumerate(after) if c["cell_type"] == "code"]
    stops = [i for i, s in code if s.startswith(("server.stop()", "replicas.stop()"))]
    assert all(i in stops or turns for i, _ in code), (notebook.name, after)
    assert not stops or all(
        i > max((j for j, s in code if "exercises.run(" in s), default=-1) for i in stops
    ), f"{notebook.name}: the server stops before an exercise that checks it"
    checks = [s for _, s in code if "exercises.run(" in s]
    assert notebook.name[:2] == "00" or checks, f"{notebook.name}: the learner's turn has no check"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_records_headline_figures_for_the_index(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "lab.record(" in code, f"{notebook.name} records no figures: its index row is empty"


#: The notebooks that compare two things in rounds and judge the difference.
JUDGING = ("03", "04", "05", "06", "07", "08")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_judging_notebook_shows_its_verdict_table_and_explains_in_markdown(notebook):
    """A notebook that judges shows the verdict table (each round, median, spread, verdict);
    every notebook's why is markdown a host can edit, not text its code prints."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    if notebook.name[:2] in JUDGING:
        assert ".verdict_table()" in code, f"{notebook.name} shows no verdict table"
    assert words >= 300, f"{notebook.name}: {words} words of markdown"
