"""The whole suite's hooks (tests/ and notebooks/): an executed notebook must look clean.

nbmake runs every shipped notebook. A notebook can pass (no exception) and still show a learner a
red stderr box: a warning, a notice written to stderr, a traceback caught and printed. Or it can
show what belongs in ``labkit bench``'s JSON, not in a lesson: a ratio key (``..._vs_...``), a
repr (``Ratio(``, ``Conclusion(``), a benchmark target's "met:" or "not measured". This hook fails
such a notebook, naming the cell and quoting what it showed, so the lesson on screen is the one
the text describes.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import nbformat
import nbmake.pytest_items
import papermill.iorw
import papermill.parameterize
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


#: What a learner must never read in a notebook's output: benchmark keys, reprs, target verdicts.
INTERNAL = re.compile(r"_vs_|\bRatio\(|\bConclusion\(|\bmet:|\bnot measured\b")
#: The scripts inside an HTML output (plotly.js, widget state): code, not words a learner reads.
_SCRIPT = re.compile(r"<script\b.*?</script>", re.DOTALL | re.IGNORECASE)


def _chart_words(figure: dict) -> str:
    """A plotly figure's words: its trace names and its layout (titles, axes, annotations)."""
    names = [str(trace.get("name", "")) for trace in figure.get("data", [])]
    return "\n".join(names) + "\n" + json.dumps(figure.get("layout", {}))


def _shown_text(output: dict) -> str:
    """What one output shows a learner: its text, its HTML without scripts, a chart's words."""
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    data = output.get("data", {})
    shown = []
    for kind in ("text/plain", "text/markdown", "text/html"):
        value = data.get(kind, "")
        shown.append("".join(value) if isinstance(value, list) else str(value))
    shown[-1] = _SCRIPT.sub("", shown[-1])
    chart = data.get("application/vnd.plotly.v1+json")
    if isinstance(chart, dict):
        shown.append(_chart_words(chart))
    return "\n".join(shown)


def internal_outputs(nb) -> list[tuple[int, str]]:
    """(cell index, the line around it) for every output that shows :data:`INTERNAL` text."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            text = _shown_text(output)
            for match in INTERNAL.finditer(text):
                start = text.rfind("\n", 0, match.start()) + 1
                end = text.find("\n", match.end())
                found.append((index, text[start : end if end >= 0 else len(text)].strip()[:200]))
    return found


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
            unclean = unclean_outputs(result.nb) + [
                (i, f"internal text a learner should not read: {shown}")
                for i, shown in internal_outputs(result.nb)
            ]
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
