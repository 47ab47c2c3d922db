"""notebooks/05_inferentia.ipynb is committed clean. The suite executes it under nbmake (testpaths
includes notebooks/); its own asserts check the PyTorch comparison and the profile."""

from __future__ import annotations

from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "05_inferentia.ipynb"


def test_notebook_is_committed_without_outputs_and_has_a_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    assert all(len(c.source.splitlines()) < 15 for c in code)
