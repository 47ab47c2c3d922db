"""What a ``labkit run`` produced: per-notebook results, the summary table, the HTML index."""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass, field
from pathlib import Path

from labkit.lessons.conclusion import figure_text

log = logging.getLogger(__name__)

#: A notebook's headline figures, in its own folder (written by labkit.lab.record).
FIGURES_FILE = "figures.json"


@dataclass
class NotebookResult:
    """One executed notebook: where it went, whether it passed, and the failing cell if not."""

    notebook: str
    output: str
    status: str  # "ok" or "failed"
    duration_s: float
    html: str | None = None
    cell: int | None = None  # index of the failing cell in the executed notebook
    source: str | None = None  # the failing cell's first line
    error: str | None = None
    purpose: str = ""  # the notebook's title line
    figures: dict = field(default_factory=dict)  # what the notebook recorded (labkit.lab.record)
    folder: str | None = None  # the notebook's own working folder (logs, reports)

    def where(self) -> str:
        """``cell 3 (`x = f()`): `` for a failure inside a cell, else an empty string."""
        if self.cell is None:
            return ""
        return f"cell {self.cell} (`{self.source}`): " if self.source else f"cell {self.cell}: "


@dataclass
class RunReport:
    """The outcome of one ``labkit run``."""

    run_dir: Path
    results: list[NotebookResult] = field(default_factory=list)
    index: Path | None = None

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.results)

    def table(self) -> str:
        """The summary table: notebook, status, duration (and the error of a failed one)."""
        rows = [("notebook", "status", "duration")]
        rows += [(Path(r.notebook).name, r.status, f"{r.duration_s:.1f} s") for r in self.results]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for r in self.results:
            if r.figures:
                shown = ", ".join(f"{k} {figure_text(v)}" for k, v in r.figures.items())
                lines.append(f"{Path(r.notebook).name}: {shown}")
        for r in self.results:
            if r.error:
                lines.append(f"{Path(r.notebook).name}: {r.where()}{r.error}")
        return "\n".join(lines)


def to_html(notebook: Path) -> str | None:
    """Export an executed notebook to HTML beside it; a failed export is logged, not fatal."""
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)
    from nbconvert import HTMLExporter  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    try:
        nb = nbformat.read(notebook, as_version=4)
        _describe_unrenderable(nb)
        body, _ = HTMLExporter().from_notebook_node(nb)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not export %s to HTML: %s", notebook.name, exc)
        return None
    target = notebook.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return str(target)


def _describe_unrenderable(nb) -> None:
    """Give outputs that only carry custom mimetypes (a widget, plotly's JSON) a text line, so
    nbconvert renders the rest of the notebook instead of refusing it."""
    shown = {
        "text/html",
        "text/plain",
        "text/markdown",
        "text/latex",
        "image/png",
        "image/jpeg",
        "image/svg+xml",
        "application/javascript",
        "application/pdf",
    }
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data is not None and not shown & set(data):
                data["text/plain"] = f"[{', '.join(data)} output: shown in Jupyter only]"


def write_index(report: RunReport) -> Path:
    """``index.html``: one row per notebook: its purpose, status, duration, headline figures, and
    links to its HTML, the executed notebook and its working folder (logs, reports)."""
    rows = []
    for r in report.results:
        name = Path(r.notebook).name
        links = [f"<a href='{_href(r.output, report.run_dir)}'>ipynb</a>"]
        if r.html:
            links.insert(0, f"<a href='{_href(r.html, report.run_dir)}'>HTML</a>")
        if r.folder and Path(r.folder).is_dir():
            links.append(f"<a href='{_href(r.folder, report.run_dir)}/'>files</a>")
        figures = "".join(
            f"<li>{html.escape(str(k))}: <b>{html.escape(figure_text(v))}</b></li>"
            for k, v in r.figures.items()
        )
        error = html.escape(f"{r.where()}{r.error}" if r.error else "")
        rows.append(
            f"<tr class='{r.status}'><td><b>{html.escape(name)}</b><br>"
            f"<span class='purpose'>{html.escape(r.purpose)}</span></td><td>{r.status}</td>"
            f"<td>{r.duration_s:.1f} s</td><td><ul>{figures}</ul></td>"
            f"<td>{' · '.join(links)}</td><td>{error}</td></tr>"
        )
    passed = sum(r.status == "ok" for r in report.results)
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>labkit run "
        f"{html.escape(report.run_dir.name)}</title><style>body{{font-family:sans-serif;"
        "margin:2em}table{border-collapse:collapse}td,th{padding:6px 12px;text-align:left;"
        "vertical-align:top;border-bottom:1px solid #ddd}ul{margin:0;padding-left:1.2em}"
        ".failed td{color:#b00}.purpose{color:#555}</style></head><body>"
        f"<h1>labkit run {html.escape(report.run_dir.name)}</h1>"
        f"<p>{passed} of {len(report.results)} notebooks passed.</p><table>"
        "<tr><th>notebook</th><th>status</th><th>duration</th><th>headline figures</th>"
        f"<th>links</th><th>error</th></tr>{''.join(rows)}</table></body></html>\n"
    )
    index = report.run_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def _href(path: str, root: Path) -> str:
    target = Path(path)
    return html.escape(
        str(target.relative_to(root)) if target.is_relative_to(root) else target.name
    )


def purpose(notebook: Path) -> str:
    """A notebook's title: its first markdown heading, without the ``#``."""
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""
