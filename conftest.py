"""The whole suite's hooks (tests/ and notebooks/): an executed notebook must look clean.

nbmake runs every shipped notebook. A notebook can pass (no exception) and still show a learner a
red stderr box, or text that belongs in ``labkit bench``'s JSON (:mod:`labkit.shown` says which).
This hook fails such a notebook, naming the cell and quoting what it showed, so the lesson on
screen is the one the text describes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat
import nbmake.pytest_items
import papermill.iorw
import papermill.parameterize
from nbmake.nb_result import NotebookError, NotebookResult

from labkit.shown import not_for_a_learner

# tests/test_tiers.py runs planted tests through the fast tier's guard (tests/conftest.py).
pytest_plugins = ["pytester"]


#: The sizes ``make test`` runs the long notebooks at, injected after each one's parameters cell
#: as papermill injects ``labkit run -p``'s. A test proves that a notebook runs clean end to end on
#: a real server; the full sizes, where each lesson's effect shows, are ``make demo``'s (and the
#: executed HTML a learner reads). Every name here must be a parameter of its notebook
#: (tests/test_notebook_hygiene.py checks it), so a renamed parameter cannot quietly undo a size.
TEST_PARAMETERS: dict[str, dict[str, object]] = {
    # 4 new tokens a request: every window, and the paced arrivals (spaced by its compute), halve
    "03_dynamic_batching.ipynb": {"CONCURRENCY": [1, 8], "REQUEST_COUNT": 8, "MAX_TOKENS": 4},
    # one instance, one batch size searched (4): the default and that change, two rounds
    "04_model_analyzer.ipynb": {
        "MAX_INSTANCE_COUNT": 1,
        "MAX_MODEL_BATCH_SIZE": 4,
        "REQUEST_COUNT": 6,
        "ROUNDS": 2,
    },
    # no bfloat16 twin (the vllm way's code in another dtype; demo-only), one round, one answer
    # of at most 32 tokens per client; vLLM's own server stays: the suite's one real run of it
    "06_inflight_batching.ipynb": {
        "WAYS": ["inflight", "vllm", "vllm-standalone"],
        "ROUNDS": 1,
        "REQUESTS": 8,
        "MAX_TOKENS_HIGH": 32,
        "ANSWERS": 2,
    },
    "07_beyond_one_machine.ipynb": {
        "REQUEST_COUNT": 8,
        "MAX_TOKENS": 16,
        "WARMUP_S": 2.0,
        "SETTLE_S": 2.0,
    },
    "08_pipelines_and_caching.ipynb": {
        "ROUNDS": 2,
        "REQUEST_COUNT": 6,
        "HIT_ROUNDS": 2,
        "TEXTS_PER_ROUND": 5,
    },
}
#: Every exercise runs with its reference solution put in (as ``labkit run --solutions`` does), so
#: the suite shows each check passing against the live server; a failing one fails its notebook.
for _notebook in sorted((Path(__file__).parent / "notebooks").glob("0[1-8]_*.ipynb")):
    TEST_PARAMETERS.setdefault(_notebook.name, {})["SOLUTIONS"] = True


class _CleanRun(nbmake.pytest_items.NotebookRun):
    def execute(self) -> NotebookResult:
        parameters = TEST_PARAMETERS.get(Path(self.filename).name)
        if not parameters:
            return self._checked(super().execute())
        # nbmake runs the file it is given: give it a copy with the test sizes injected
        shipped = Path(self.filename)
        nb = papermill.parameterize.parameterize_notebook(
            papermill.iorw.load_notebook_node(str(shipped)), parameters
        )
        with tempfile.TemporaryDirectory(prefix="nbmake-") as folder:
            self.filename = Path(folder) / shipped.name
            nbformat.write(nb, self.filename)
            try:
                return self._checked(super().execute())
            finally:
                self.filename = shipped

    def _checked(self, result: NotebookResult) -> NotebookResult:
        if result.error is None:
            unclean = not_for_a_learner(result.nb)
            if unclean:
                index, first = unclean[0]
                shown = "\n".join(f"cell {i}: {text}" for i, text in unclean)
                result.error = NotebookError(
                    summary=f"cell {index} showed a learner what it should not: {first[:200]}",
                    trace=(
                        "an executed notebook must show no stderr, no error output and no "
                        f"benchmark keys, reprs or target verdicts:\n{shown}"
                    ),
                    failing_cell_index=index,
                )
        return result


def pytest_configure(config) -> None:
    nbmake.pytest_items.NotebookRun = _CleanRun
