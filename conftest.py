"""The whole suite's hooks (tests/ and notebooks/): an executed notebook must look clean.

nbmake runs every shipped notebook. A notebook can pass (no exception) and still show a learner a
red stderr box: a warning, a notice written to stderr, a traceback caught and printed. This hook
fails such a notebook, naming the cell and quoting the stream, so the lesson on screen is the one
the text describes.
"""

from __future__ import annotations

import nbmake.pytest_items
from nbmake.nb_result import NotebookError, NotebookResult

# tests/test_tiers.py runs planted tests through the fast tier's guard (tests/conftest.py).
pytest_plugins = ["pytester"]


def unclean_outputs(nb) -> list[tuple[int, str]]:
    """(cell index, what it showed) for every stderr stream or error output of an executed notebook."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                found.append((index, "stderr: " + output.get("text", "").strip()[:500]))
            elif output.get("output_type") == "error":
                found.append((index, f"error: {output.get('ename')}: {output.get('evalue')}"))
    return found


class _CleanRun(nbmake.pytest_items.NotebookRun):
    def execute(self) -> NotebookResult:
        result = super().execute()
        if result.error is None:
            unclean = unclean_outputs(result.nb)
            if unclean:
                index, first = unclean[0]
                shown = "\n".join(f"cell {i}: {text}" for i, text in unclean)
                result.error = NotebookError(
                    summary=f"cell {index} wrote to stderr or showed an error: {first[:200]}",
                    trace=f"an executed notebook must show no stderr and no error output:\n{shown}",
                    failing_cell_index=index,
                )
        return result


def pytest_configure(config) -> None:
    nbmake.pytest_items.NotebookRun = _CleanRun
