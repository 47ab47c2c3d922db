"""notebooks/05_inferentia.ipynb runs headless end to end (cpu target here, Neuron on a Neuron host)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "05_inferentia.ipynb"


def test_notebook_is_committed_without_outputs_and_has_a_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    assert all(len(c.source.splitlines()) < 15 for c in code)


@pytest.mark.notebook
@pytest.mark.integration
def test_notebook_compiles_serves_matches_pytorch_and_profiles(tmp_path):
    import papermill

    out = tmp_path / "05_out.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(out),
        parameters={"run_dir": str(tmp_path / "run")},
        cwd=str(NOTEBOOK.parent),
        progress_bar=False,
    )
    nb = nbformat.read(out, as_version=4)
    text = "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "compile target:" in text and "sentence embedding" in text
    assert (tmp_path / "run" / "add_sub_perf.csv").is_file()
