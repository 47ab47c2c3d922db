"""What an executed notebook shows a learner that a lesson must not.

A notebook can run to its end and still show a red stderr box (a warning, a notice written to
stderr, a traceback caught and printed), or text that belongs in ``labkit bench``'s JSON: a ratio
key (``..._vs_...``), a repr (``Ratio(``, ``Conclusion(``), a benchmark target's "met:" or "not
measured". ``make test`` fails a notebook that shows either (the suite's root ``conftest.py``, at
the test sizes); ``labkit run`` names them in its summary and index (at the sizes the learner
runs).
"""

from __future__ import annotations

import json
import re

#: What a learner must never read in a notebook's output: benchmark keys, reprs, target verdicts.
INTERNAL = re.compile(r"_vs_|\bRatio\(|\bConclusion\(|\bmet:|\bnot measured\b")
#: The scripts inside an HTML output (plotly.js, widget state): code, not words a learner reads.
_SCRIPT = re.compile(r"<script\b.*?</script>", re.DOTALL | re.IGNORECASE)


def unclean_outputs(nb) -> list[tuple[int, str]]:
    """(cell index, what it showed) for every stderr stream or error output of an executed
    notebook (an ``nbformat`` node)."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                found.append((index, "stderr: " + output.get("text", "").strip()[:500]))
            elif output.get("output_type") == "error":
                found.append((index, f"error: {output.get('ename')}: {output.get('evalue')}"))
    return found


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


def not_for_a_learner(nb) -> list[tuple[int, str]]:
    """Both lists in cell order: stderr and errors, then internal text, each named as such."""
    found = unclean_outputs(nb) + [
        (i, f"internal text a learner should not read: {shown}")
        for i, shown in internal_outputs(nb)
    ]
    return sorted(found, key=lambda item: item[0])
