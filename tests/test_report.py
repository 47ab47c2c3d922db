"""What a run leaves to read offline: each notebook's HTML renders with nothing from the network,
a widget shows the state the run left it in, and the index shows every notebook's figures."""

from __future__ import annotations

import re
from pathlib import Path

import ipywidgets as w
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output
from tqdm.notebook import tqdm as notebook_tqdm

from labkit import report
from labkit.lessons import Ratio
from labkit.widgets import PromptUI


def notebook_showing(*widgets: w.Widget) -> nbformat.NotebookNode:
    """A notebook whose cells display ``widgets``, with their state saved as a run saves it."""
    cells = []
    for widget in widgets:
        data = {
            report.WIDGET_VIEW: {"model_id": widget.model_id, "version_major": 2},
            "text/plain": f"{type(widget).__name__}(...)",  # what the kernel sent when it drew
        }
        output = new_output("display_data", data=data)
        cells.append(new_code_cell("widget", outputs=[output]))
    nb = new_notebook(cells=cells)
    nb.metadata["widgets"] = {report.WIDGET_STATE: w.Widget.get_manager_state()}  # every live one
    return nb


def test_a_prompt_box_leaves_its_prompt_and_answer_as_text_and_html():
    ui = PromptUI(lambda prompt, **_: f"echo: {prompt}", prompt="I am going")
    ui.on_generate()
    nb = notebook_showing(ui.widget)

    assert report.transcribe_widgets(nb) == 1
    data = nb.cells[0].outputs[0].data
    assert "Prompt: I am going" in data["text/plain"]
    assert "Output: echo: I am going" in data["text/plain"]
    assert "[Generate]" in data["text/plain"] and "done in" in data["text/plain"]
    assert report.WIDGET_VIEW in data  # Jupyter still draws the live widget
    page = report.offline_html(nb)
    assert "echo: I am going" in page and "Generate</button>" in page
    assert report.WIDGET_VIEW not in page and report.WIDGET_STATE not in page
    assert report.remote_resources(page) == []


def test_a_progress_bar_shows_its_final_count_not_the_0_percent_it_first_drew():
    bar = notebook_tqdm(range(3), desc="perf_analyzer on", unit="level", display=False)
    for _ in bar:
        pass
    bar.close()
    nb = notebook_showing(bar.container)

    report.transcribe_widgets(nb)
    text = nb.cells[0].outputs[0].data["text/plain"]
    assert text.startswith("perf_analyzer on: 100% |####################| 3/3")
    page = report.offline_html(nb)
    assert "perf_analyzer\u2007on:\u2007100%" in page and re.search(r"<progress[^>]*value=.3", page)


def test_a_sweeps_bar_counts_levels_and_time_without_a_rate():
    from labkit.profiling.perf import LEVELS_BAR

    bar = notebook_tqdm(range(3), desc="perf_analyzer on", bar_format=LEVELS_BAR, display=False)
    for level in bar:
        bar.set_postfix(concurrency=level)
    bar.close()
    nb = notebook_showing(bar.container)

    report.transcribe_widgets(nb)
    text = nb.cells[0].outputs[0].data["text/plain"]
    assert text.startswith("perf_analyzer on: 100% |####################| 3 of 3 levels, 00:0")
    assert text.endswith("concurrency=2") and "/level" not in text and "<" not in text


def test_a_widget_whose_state_was_not_saved_says_so_and_a_password_is_not_shown():
    secret = w.Password(value="hf_not_to_be_shown", description="Token")
    nb = notebook_showing(secret)
    nb.cells.append(
        new_code_cell(
            "x",
            outputs=[
                new_output(
                    "display_data",
                    data={report.WIDGET_VIEW: {"model_id": "0" * 32}, "text/plain": "VBox(...)"},
                )
            ],
        )
    )

    assert report.transcribe_widgets(nb) == 2
    assert nb.cells[0].outputs[0].data["text/plain"] == "Token: (hidden)"
    unsaved = nb.cells[1].outputs[0].data["text/plain"]
    assert "did not save" in unsaved and "in Jupyter" in unsaved
    assert "hf_not_to_be_shown" not in report.offline_html(nb)


def test_remote_resources_finds_what_a_browser_would_fetch_and_ignores_links():
    page = (
        '<script src="https://cdn.example/require.js"></script>'
        "<link rel='stylesheet' href='//fonts.example/a.css'>"
        '<script type="module">const m = (await import("https://cdn.example/m.mjs")).default'
        "</script><style>@import url(https://css.example/b.css);</style>"
        '<img src="data:image/png;base64,AAAA"><a href="https://docs.example/page">docs</a>'
    )
    assert report.remote_resources(page) == [
        "https://cdn.example/require.js",
        "//fonts.example/a.css",
        "https://cdn.example/m.mjs",
        "https://css.example/b.css",
    ]


def test_the_page_of_a_plain_notebook_loads_nothing_from_the_network():
    nb = new_notebook(
        cells=[
            new_code_cell(
                "1 + 1",
                outputs=[new_output("execute_result", data={"text/plain": "2"}, execution_count=1)],
            )
        ]
    )
    page = report.offline_html(nb)
    assert "require.min.js" not in page and "mathjax" not in page.lower()
    assert report.remote_resources(page) == []


def test_the_index_and_the_summary_show_each_notebooks_figures_or_say_there_are_none(tmp_path):
    results = [
        report.NotebookResult(
            "00_setup_check.ipynb", "x", "ok", 1.0, figures={"checks": {"ok": 14, "warn": 5}}
        ),
        report.NotebookResult(
            "03_dynamic_batching.ipynb",
            "x",
            "ok",
            2.0,
            figures={
                "throughput_ratio_c8": Ratio(2.614, "infer/s").as_figure(),
                "avg_batch_size_c8": 4.1,
            },
        ),
        report.NotebookResult("07_beyond_one_machine.ipynb", "x", "failed", 3.0),
    ]
    run = report.RunReport(tmp_path, results)

    index = report.write_index(run).read_text()
    assert "<li>checks: <b>ok 14, warn 5</b></li>" in index
    assert "<li>throughput ratio at concurrency 8: <b>x2.61 infer/s</b></li>" in index
    assert index.count(report.NO_FIGURES) == 1
    table = run.table()
    assert (
        "03_dynamic_batching.ipynb: throughput ratio at concurrency 8 x2.61 infer/s; "
        "average batch size at concurrency 8 4.1" in (table)
    )
    assert f"07_beyond_one_machine.ipynb: {report.NO_FIGURES}" in table


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("time_to_first_token_s", "time to first token (s)"),
        ("stream_tokens_per_s", "stream (tokens/s)"),
        ("replicas_infer_s_c4", "replicas at concurrency 4 (infer/s)"),
        ("one_instance_infer_s", "one instance (infer/s)"),
        ("queue_ms", "queue (ms)"),
        ("vllm_vs_inflight", "vllm against inflight"),
        ("answer", "answer"),
    ],
)
def test_a_figures_name_reads_as_a_label_with_its_unit(name, label):
    assert report.figure_label(name) == label


def test_the_index_shows_at_most_six_figures_and_says_where_the_rest_are(tmp_path):
    figures = {f"figure_{i}": i for i in range(9)}
    results = [report.NotebookResult("06_x.ipynb", "x", "ok", 1.0, figures=figures)]
    index = report.write_index(report.RunReport(tmp_path, results)).read_text()
    assert index.count("<li>figure ") == report.MAX_INDEX_FIGURES == 6
    assert "3 more in the run's figures.json" in index


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed")
def test_a_page_with_a_plot_and_a_widget_renders_in_a_browser_that_has_no_network(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")  # the test extra
    import plotly.graph_objects as go
    import plotly.io as pio

    plot = pio.to_html(go.Figure(go.Bar(x=["a", "b"], y=[1, 2])), full_html=False)
    ui = PromptUI(lambda prompt, **_: "offline-answer", prompt="hello")
    ui.on_generate()
    nb = notebook_showing(ui.widget)
    nb.cells.append(
        new_code_cell("fig", outputs=[new_output("display_data", data={"text/html": plot})])
    )
    report.transcribe_widgets(nb)
    path = tmp_path / "page.html"
    path.write_text(report.offline_html(nb), encoding="utf-8")

    fetched, errors = [], []
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page()
            page.route(
                "**/*",
                lambda route: (
                    route.continue_()
                    if route.request.url.startswith(("file:", "data:"))
                    else (fetched.append(route.request.url), route.abort())
                ),
            )
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(path.as_uri(), wait_until="load")
            page.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=60_000)
            transcript = page.locator(".labkit-widget").inner_text()
        finally:
            browser.close()
    assert fetched == [] and errors == []
    assert "hello" in transcript and "offline-answer" in transcript


def test_figures_keep_the_order_the_notebook_recorded_them_in(tmp_path):
    import json

    from labkit import lab

    lab.record(tmp_path, zeta_headline=1.0, alpha_detail=2)
    lab.record(tmp_path, beta_later=3)
    recorded = json.loads((tmp_path / "figures.json").read_text())
    assert list(recorded) == ["zeta_headline", "alpha_detail", "beta_later"]


def test_the_index_escapes_what_a_notebook_wrote_and_links_its_files(tmp_path):
    (tmp_path / "01_x").mkdir()
    results = [
        report.NotebookResult(
            "01_<x>.ipynb",
            str(tmp_path / "01_x.ipynb"),
            "failed",
            1.0,
            html=str(tmp_path / "01_x.html"),
            purpose="<script>alert(1)</script>",
            takeaway=["a <b>bold</b> claim"],
            figures={"label": "<i>value</i>"},
            folder=str(tmp_path / "01_x"),
            cell=2,
            error="ValueError: <bad> & worse",
        )
    ]
    index = report.write_index(report.RunReport(tmp_path, results)).read_text()
    assert "<script>" not in index and "&lt;script&gt;alert(1)&lt;/script&gt;" in index
    assert "<b>01_&lt;x&gt;.ipynb</b>" in index
    assert "<li>a &lt;b&gt;bold&lt;/b&gt; claim</li>" in index
    assert "<li>label: <b>&lt;i&gt;value&lt;/i&gt;</b></li>" in index
    assert "<td>cell 2: ValueError: &lt;bad&gt; &amp; worse</td>" in index
    assert (
        "<a href='01_x.html'>HTML</a> · <a href='01_x.ipynb'>ipynb</a> · <a href='01_x/'>files</a>"
        in index
    )
    assert "<p>0 of 1 notebooks passed.</p>" in index
