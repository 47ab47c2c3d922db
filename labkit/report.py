"""What a ``labkit run`` produced: per-notebook results, the summary table, the HTML index."""

from __future__ import annotations

import copy
import html
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from labkit.lessons.conclusion import figure_text

log = logging.getLogger(__name__)

#: A notebook's headline figures, in its own folder (written by labkit.lab.record).
FIGURES_FILE = "figures.json"
#: Its takeaway, one to three lines (written by labkit.lab.takeaway).
TAKEAWAY_FILE = "takeaway.json"


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
    takeaway: list[str] = field(default_factory=list)  # its last word (labkit.lab.takeaway)
    folder: str | None = None  # the notebook's own working folder (logs, reports)
    #: what it showed a learner that a lesson must not ("cell 7: stderr: ..."; labkit.shown)
    not_for_a_learner: list[str] = field(default_factory=list)

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
            lines.append(f"{Path(r.notebook).name}: {figures_summary(r.figures)}")
        for r in self.results:
            if r.error:
                lines.append(f"{Path(r.notebook).name}: {r.where()}{r.error}")
        for r in self.results:
            for shown in r.not_for_a_learner:
                lines.append(f"{Path(r.notebook).name} showed: {shown}")
        return "\n".join(lines)


def to_html(notebook: Path) -> str | None:
    """Export an executed notebook to HTML beside it that renders offline; a failed export is
    logged, not fatal.

    Widgets (a prompt box, a progress bar) draw in Jupyter from the state the run saved; no
    offline page can run their JavaScript renderer, so each widget output first gets a transcript
    of that last state (:func:`transcribe_widgets`), saved into the notebook too.
    """
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    try:
        nb = nbformat.read(notebook, as_version=4)
        if transcribe_widgets(nb):
            nbformat.write(nb, notebook)
        page = offline_html(nb)
    except OSError:  # a notebook or page that cannot be written fails the run (headless says so)
        raise
    except Exception as exc:  # noqa: BLE001
        log.warning("could not export %s to HTML: %s", notebook.name, exc)
        return None
    remote = remote_resources(page)
    if remote:
        log.warning("%s.html still loads from the network: %s", notebook.stem, ", ".join(remote))
    target = notebook.with_suffix(".html")
    target.write_text(page, encoding="utf-8")
    return str(target)


#: nbconvert's ``lab`` page without what it loads from a CDN: require.js (no output here needs
#: it; plotly's embedded bundle then sets ``window.Plotly`` itself), MathJax, mermaid and the
#: Jupyter widgets renderer (widgets are transcribed instead). Math in markdown shows as its TeX.
_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""

#: A ``<script src=...>`` that loads from the network, inside an output (plotly adds MathJax's).
_REMOTE_SCRIPT = re.compile(
    r"""<script\b[^>]*\bsrc\s*=\s*["']?(?:https?:)?//[^>]*>\s*</script>""", re.IGNORECASE
)

#: What a browser fetches to render a page: an element's ``src``, a stylesheet or module's URL.
_REMOTE_REFERENCE = re.compile(
    r"""<(?:script|img|iframe|embed|source|audio|video|input)\b[^>]*?\bsrc\s*=\s*["']?"""
    r"""((?:https?:)?//[^"'\s>]+)"""
    r"""|<link\b[^>]*?\bhref\s*=\s*["']?((?:https?:)?//[^"'\s>]+)"""
    r"""|\bimport\s*\(?\s*(?:[\w{}\s,*]+\bfrom\s*)?["']((?:https?:)?//[^"']+)["']"""
    r"""|@import\s+(?:url\()?\s*["']?((?:https?:)?//[^"')\s;]+)"""
    r"""|url\(\s*["']?((?:https?:)?//[^"')\s]+)""",
    re.IGNORECASE,
)


def offline_html(nb) -> str:
    """A notebook's HTML page that loads nothing from the network (links are left as links).

    Widget outputs show their transcript (call :func:`transcribe_widgets` first), outputs that
    only carry a custom mimetype a line saying so, and plots their embedded plotly.js.
    """
    from nbconvert import HTMLExporter  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    shown = copy.deepcopy(nb)
    shown.metadata.pop("widgets", None)
    for cell in shown.cells:
        for output in cell.get("outputs", []):
            output.get("data", {}).pop(WIDGET_VIEW, None)
    _describe_unrenderable(shown)
    exporter = HTMLExporter(
        extra_loaders=[jinja2.DictLoader({"labkit_offline.html.j2": _OFFLINE_TEMPLATE})],
        template_file="labkit_offline.html.j2",
    )
    body, _ = exporter.from_notebook_node(shown)
    return _REMOTE_SCRIPT.sub("", body)


def remote_resources(page: str) -> list[str]:
    """The network addresses an HTML page needs to render (scripts, stylesheets, images, ES
    module imports, CSS ``url()``), in order, each once; plain links are not counted."""
    found = (next(g for g in m.groups() if g) for m in _REMOTE_REFERENCE.finditer(page))
    return list(dict.fromkeys(found))


def _describe_unrenderable(nb) -> None:
    """Give outputs that only carry custom mimetypes (plotly's JSON, a widget whose state was not
    saved) a text line, so nbconvert renders the rest of the notebook instead of refusing it."""
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


# -- widgets, as the run left them ----------------------------------------------------------------
#: The notebook metadata that holds every widget's last state (nbclient writes it after a run).
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
#: An output that draws a widget: ``{"model_id": ...}`` names its state.
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def transcribe_widgets(nb) -> int:
    """Give every widget output a static transcript of the widget's last saved state, as
    ``text/plain`` and ``text/html`` beside the widget view: a prompt box shows its prompt,
    settings and answer; a progress bar its final count (``3/3``), not the ``0%`` it showed when
    it first drew. Jupyter still draws the live widget. Returns how many outputs it transcribed.
    """
    states = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    count = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if not isinstance(view, dict):
                continue
            if view.get("model_id") in states:
                text, markup = _widget(states, view["model_id"])
                markup = f"<div class='labkit-widget'>{markup}</div>"
            else:
                text = "[a widget whose state this run did not save: run the notebook in Jupyter]"
                markup = f"<pre>{html.escape(text)}</pre>"
            output["data"]["text/plain"] = text
            output["data"]["text/html"] = markup
            count += 1
    return count


_BOXES = {"HBoxModel", "VBoxModel", "BoxModel", "GridBoxModel", "AccordionModel", "TabModel"}
_CHOICES = {"DropdownModel", "SelectModel", "RadioButtonsModel", "ToggleButtonsModel"}


def _widget(states: dict, ref: str, depth: int = 0) -> tuple[str, str]:
    """One widget (and its children) as ``(text, html)``; a name the state lacks is empty."""
    model = states.get(ref.removeprefix("IPY_MODEL_"))
    if model is None or depth > 32:
        return "", ""
    s = model.get("state", {})
    kind = model.get("model_name") or s.get("_model_name", "")
    label = s.get("description") or ""
    if kind in _BOXES or "children" in s:
        parts = [p for p in (_widget(states, c, depth + 1) for c in s.get("children", [])) if p[0]]
        row = kind == "HBoxModel"
        text = (" " if row else "\n").join(t for t, _ in parts)
        style = "display:flex;gap:0.6em;" + (
            "align-items:center" if row else "flex-direction:column"
        )
        return text, f"<div style='{style}'>{''.join(h for _, h in parts)}</div>"
    if kind in ("IntProgressModel", "FloatProgressModel"):
        value, low, high = s.get("value") or 0, s.get("min") or 0, s.get("max") or 0
        done = (value - low) / (high - low) if high > low else 0.0
        filled = round(20 * min(max(done, 0.0), 1.0))
        text = f"{label} |{'#' * filled}{'.' * (20 - filled)}|".strip()
        return text, f"<progress value='{value - low}' max='{max(high - low, 0)}'></progress>"
    if kind in ("HTMLModel", "HTMLMathModel"):
        value = s.get("value") or ""
        text = html.unescape(re.sub(r"<[^>]+>", "", value))
        text = text.replace("\u2007", " ").replace("\xa0", " ").strip()  # tqdm's fixed spaces
        return (
            (f"{label} {text}".strip(), f"<span>{_label(label)}{value}</span>")
            if text
            else ("", "")
        )
    if kind == "ButtonModel":
        return f"[{label}]", f"<button disabled>{html.escape(label)}</button>"
    if kind in _CHOICES:
        options, index = s.get("_options_labels") or [], s.get("index")
        value = options[index] if isinstance(index, int) and 0 <= index < len(options) else ""
        return _field(label, value or "(none)")
    if kind == "PasswordModel":
        return _field(label, "(hidden)")
    if kind in ("TextareaModel", "TextModel"):
        value = s.get("value") or ""
        text = f"{label}: {value}" if value else f"{label}: (empty)"
        shown = html.escape(value) if value else "<i>(empty)</i>"
        box = "white-space:pre-wrap;border:1px solid #ccc;padding:4px 6px;margin:0;flex:1"
        return text.strip(": "), (
            f"<div style='display:flex;gap:0.6em'>{_label(label)}<pre style='{box}'>{shown}</pre>"
            "</div>"
        )
    if kind == "CheckboxModel":
        return _field(label, "yes" if s.get("value") else "no")
    if kind == "OutputModel":
        text = "".join(_output_text(o) for o in s.get("outputs", [])).rstrip()
        return text, f"<pre>{html.escape(text)}</pre>" if text else ""
    if "value" in s:
        return _field(label, s["value"])
    return "", ""


def _field(label: str, value: object) -> tuple[str, str]:
    text = f"{label}: {value}" if label else str(value)
    return text, f"<span>{_label(label)}<b>{html.escape(str(value))}</b></span>"


def _label(label: str) -> str:
    return f"<span style='color:#555'>{html.escape(label)}</span> " if label else ""


def _output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    text = output.get("data", {}).get("text/plain", "")
    return ("".join(text) if isinstance(text, list) else text) + "\n"


#: The index page's template, rendered with autoescape (every value is escaped).
INDEX_TEMPLATE = "index.html.j2"
_PAGES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def write_index(report: RunReport) -> Path:
    """``index.html``: one row per notebook: its purpose, status, duration, headline figures, and
    links to its HTML, the executed notebook and its working folder (logs, reports)."""
    rows = []
    for r in report.results:
        links = [("ipynb", _href(r.output, report.run_dir))]
        if r.html:
            links.insert(0, ("HTML", _href(r.html, report.run_dir)))
        if r.folder and Path(r.folder).is_dir():
            links.append(("files", f"{_href(r.folder, report.run_dir)}/"))
        shown = list(r.figures.items())[:MAX_INDEX_FIGURES]
        rows.append(
            {
                "name": Path(r.notebook).name,
                "purpose": r.purpose,
                "status": r.status,
                "duration_s": r.duration_s,
                "figures": [(figure_label(k), figure_value(v)) for k, v in shown],
                "more_figures": len(r.figures) - len(shown),
                "takeaway": r.takeaway,
                "links": links,
                "error": f"{r.where()}{r.error}" if r.error else "",
                "not_for_a_learner": r.not_for_a_learner,
            }
        )
    page = _PAGES.get_template(INDEX_TEMPLATE).render(
        run_name=report.run_dir.name,
        rows=rows,
        passed=sum(r.status == "ok" for r in report.results),
        no_figures=NO_FIGURES,
        no_takeaway=NO_TAKEAWAY,
        figures_file=FIGURES_FILE,
    )
    index = report.run_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


#: What the summary and the index say for a notebook that recorded no figures.
NO_FIGURES = "no figures recorded"
#: The most figures the index shows for one notebook, beside its takeaway; figures.json keeps all.
MAX_INDEX_FIGURES = 6

#: A recorded figure's name ends in its unit: how that unit reads in a label.
_UNITS = {
    "tokens_per_s": "tokens/s",
    "infer_s": "infer/s",
    "per_s": "/s",
    "ms": "ms",
    "s": "s",
    "pct": "%",
}
#: Short words of a figure's name, as a learner reads them.
_WORDS = {"vs": "against", "avg": "average", "p50": "median", "ttft": "time to first token",
          "itl": "inter-token latency"}  # fmt: skip


def figure_label(name: str) -> str:
    """A recorded figure's name as the index labels it: ``time_to_first_token_s`` reads "time to
    first token (s)", ``avg_batch_size_c8`` "average batch size at concurrency 8"."""
    words = str(name).split("_")
    unit, level = "", ""
    if len(words) > 1 and re.fullmatch(r"c\d+", words[-1]):
        words, level = words[:-1], f" at concurrency {words[-1][1:]}"
    for key, said in _UNITS.items():
        tail = key.split("_")
        if len(words) > len(tail) and words[-len(tail) :] == tail:
            words, unit = words[: -len(tail)], said
            break
    out = []
    for word in words:
        if re.fullmatch(r"c\d+", word):
            out.append(f"at concurrency {word[1:]}")
        else:
            out.append(_WORDS.get(word.lower(), word))
    label = " ".join(out) + level
    return f"{label} ({unit})" if unit else label


#: What the index says for a notebook that stopped before its takeaway (or never had one).
NO_TAKEAWAY = "no takeaway recorded"


def figure_value(value: object) -> str:
    """A recorded figure as the index shows it: a ratio as ``x1.82 infer/s``; a mapping as
    ``ok 14, warn 5``; a list comma-separated; anything else as itself."""
    if isinstance(value, dict) and set(value) != {"ratio", "of"}:
        return ", ".join(f"{k} {figure_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(figure_value(v) for v in value)
    return figure_text(value)


def figures_summary(figures: dict) -> str:
    """A notebook's figures on one line, ``name value; name value``, or :data:`NO_FIGURES`."""
    return (
        "; ".join(f"{figure_label(k)} {figure_value(v)}" for k, v in figures.items()) or NO_FIGURES
    )


def _href(path: str, root: Path) -> str:
    """A link from the run folder to ``path`` (the template escapes it)."""
    target = Path(path)
    return str(target.relative_to(root)) if target.is_relative_to(root) else target.name


def purpose(notebook: Path) -> str:
    """A notebook's title: its first markdown heading, without the ``#``."""
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""
