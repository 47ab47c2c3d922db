"""The lab runner executes real notebooks with papermill; each test bounds its cells' time."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import write_notebook
from labkit import headless, runs
from labkit.cli import main
from labkit.errors import ConfigError, MissingFileError
from labkit.report import remote_resources

CELL_TIMEOUT_S = 60


@pytest.fixture
def notebooks(tmp_path: Path) -> Path:
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(
        folder / "01_good.ipynb",
        "import json, sys\nfrom labkit.runs import run_folder\nrun = run_folder(RUN_DIR)",
        "facts = {'python': sys.executable, 'count': count, 'label': label, 'run': str(run),\n"
        "         'solutions': SOLUTIONS}\n"
        "(run / 'facts.json').write_text(json.dumps(facts))",
        "import plotly.graph_objects as go\n"
        "go.Figure(go.Bar(x=['a', 'b'], y=[count, 7], name='bars-from-the-notebook'))",
        parameters="count = 1\nlabel = 'default'\nRUN_DIR = None\nSOLUTIONS = False",
    )
    write_notebook(
        folder / "02_bad.ipynb",
        "print('before the failure')",
        "ratio = 1 / divisor",
        "print('never reached')",
        parameters="divisor = 0",
    )
    return folder


def run(nbs, out, params=None, **kwargs):
    kwargs.setdefault("cell_timeout_s", CELL_TIMEOUT_S)
    return headless.run_notebooks(nbs, out, params, progress_bar=False, **kwargs)


@pytest.mark.integration
def test_a_notebook_runs_in_this_python_with_typed_parameters_into_its_run_folder(
    notebooks, tmp_path
):
    params = headless.parse_parameters([("count", "3"), ("label", "'42'")])
    report = run([notebooks / "01_good.ipynb"], tmp_path / "out", params)

    assert report.ok, report.table()
    facts = json.loads((tmp_path / "out" / "01_good" / "facts.json").read_text())
    assert facts == {
        "python": sys.executable,
        "count": 3,
        "label": "42",
        "run": str(tmp_path / "out" / "01_good"),
        "solutions": False,
    }
    executed = nbformat.read(tmp_path / "out" / "01_good.ipynb", as_version=4)
    assert "injected-parameters" in executed.cells[2].metadata.tags
    page = (tmp_path / "out" / "01_good.html").read_text()
    assert "bars-from-the-notebook" in page and "Plotly.newPlot" in page
    assert remote_resources(page) == []
    index = (tmp_path / "out" / "index.html").read_text()
    assert re.search(r"href=[\"']01_good\.html[\"']", index) and ">ok<" in index
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(s["status"], Path(s["notebook"]).name) for s in summary] == [("ok", "01_good.ipynb")]
    assert report.results[0].not_for_a_learner == []


@pytest.mark.integration
def test_a_failing_notebook_is_saved_with_its_cell_and_error_and_the_next_one_still_runs(
    notebooks, tmp_path
):
    report = run([notebooks / "02_bad.ipynb", notebooks / "01_good.ipynb"], tmp_path / "out")

    bad, good = report.results
    assert not report.ok
    assert (bad.status, good.status) == ("failed", "ok")
    assert bad.error == "ZeroDivisionError: division by zero"
    assert bad.source == "ratio = 1 / divisor"
    saved = nbformat.read(bad.output, as_version=4)
    failing = saved.cells[bad.cell]
    assert failing.source == "ratio = 1 / divisor"
    assert any(o.get("ename") == "ZeroDivisionError" for o in failing.outputs)
    assert saved.cells[bad.cell + 1].get("outputs") == []
    assert "cell" in report.table() and "ZeroDivisionError" in report.table()
    assert "ZeroDivisionError" in (tmp_path / "out" / "index.html").read_text()
    assert Path(bad.html).is_file()


@pytest.mark.integration
def test_what_a_notebook_shows_a_learner_by_mistake_is_named_in_the_summary_and_the_index(
    tmp_path,
):
    """A notebook that runs to its end but prints to stderr or shows a benchmark key stays "ok"
    (it ran), and the run names each thing it showed, with its cell, where the author looks."""
    nb = write_notebook(
        tmp_path / "leaky.ipynb",
        "print('tokens/s 12.5')",
        "import sys\nprint('careful', file=sys.stderr)",
        "print('inflight_vs_vllm 1.13')",
    )
    report = run([nb], tmp_path / "out")
    (result,) = report.results
    assert result.status == "ok" and report.ok
    assert result.not_for_a_learner == [
        "cell 1: stderr: careful",
        "cell 2: internal text a learner should not read: inflight_vs_vllm 1.13",
    ]
    assert "leaky.ipynb" in report.table() and "cell 1: stderr: careful" in report.table()
    index = (tmp_path / "out" / "index.html").read_text()
    assert "cell 1: stderr: careful" in index and "inflight_vs_vllm 1.13" in index
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary[0]["not_for_a_learner"] == result.not_for_a_learner


@pytest.mark.integration
def test_a_cell_that_runs_past_its_timeout_fails_that_notebook(tmp_path):
    sleep = "import time\ntime.sleep(seconds)"
    nb = write_notebook(
        tmp_path / "slow.ipynb", sleep, "print('woke up')", parameters="seconds = 3600"
    )
    report = run([nb], tmp_path / "out", cell_timeout_s=3)
    (result,) = report.results
    assert result.status == "failed"
    assert "timed out" in result.error.lower() or "timeout" in result.error.lower()
    assert (result.cell, result.source) == (2, "import time"), "the report names the cell that hung"
    # the hour-long sleep was cut short: the cell after it never ran
    cells = nbformat.read(result.output, as_version=4).cells
    after = [c for c in cells if c.source == "print('woke up')"]
    assert len(after) == 1 and after[0].get("outputs") == []


@pytest.mark.integration
def test_a_run_page_reads_offline_with_widgets_and_progress_bars_as_the_run_left_them(tmp_path):
    nb = write_notebook(
        tmp_path / "widgets.ipynb",
        "from tqdm.auto import tqdm\nfor _ in tqdm(range(4), desc='levels-of-the-sweep'): pass",
        "import ipywidgets as w\nbox = w.Textarea(description='Prompt', value='first')\nbox",
        "box.value = 'the-answer-set-after-display'",
        "import plotly.graph_objects as go\ngo.Figure(go.Bar(x=['a'], y=[1]))",
    )
    (result,) = run([nb], tmp_path / "out").results
    assert result.status == "ok", result.error
    assert result.not_for_a_learner == []  # tqdm.auto draws a widget, not a stderr stream

    page = Path(result.html).read_text()
    assert remote_resources(page) == []
    assert "Plotly.newPlot" in page  # the plot draws from the plotly.js embedded in the page
    assert "levels-of-the-sweep:\u2007100%" in page and "4/4" in page
    assert "the-answer-set-after-display" in page
    saved = nbformat.read(result.output, as_version=4).cells
    bar, box = (c.outputs[-1].data["text/plain"] for c in saved[:2])
    assert bar.startswith("levels-of-the-sweep: 100% |####################| 4/4"), bar
    assert box == "Prompt: the-answer-set-after-display"


@pytest.mark.integration
def test_cli_runs_every_notebook_in_order_and_exits_nonzero_on_failure_with_a_fake_project(
    notebooks, tmp_path, monkeypatch, capsys
):
    # Fake: the project's notebooks/ is this test's two throwaway notebooks (the shipped ones
    # take minutes each and run under nbmake); the CLI, papermill and the kernel are real.
    monkeypatch.setattr(headless, "project_root", lambda: tmp_path)
    code = main(["run", "--out", str(tmp_path / "all"), "--cell-timeout", str(CELL_TIMEOUT_S)])
    printed = capsys.readouterr().out
    assert code == 1
    lines = printed.splitlines()
    assert lines[0].split() == ["notebook", "status", "duration"]
    assert lines[2].split()[:2] == ["01_good.ipynb", "ok"]
    assert lines[3].split()[:2] == ["02_bad.ipynb", "failed"]
    assert "ZeroDivisionError" in printed and str(tmp_path / "all") in printed


@pytest.mark.integration
def test_a_notebook_named_by_prefix_runs_and_the_cli_exits_zero_with_a_fake_project(
    notebooks, tmp_path, monkeypatch
):
    # Fake: the project's notebooks/ is this test's throwaway notebooks, as above.
    monkeypatch.setattr(headless, "project_root", lambda: tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text("count: 5\nlabel: from-yaml\n")
    code = main(
        [
            "run",
            "01",
            "--out",
            str(tmp_path / "o"),
            "--params",
            str(params),
            "-p",
            "count",
            "6",
            "--cell-timeout",
            str(CELL_TIMEOUT_S),
            "--solutions",
        ]
    )
    assert code == 0
    facts = json.loads((tmp_path / "o" / "01_good" / "facts.json").read_text())
    assert (facts["count"], facts["label"], facts["solutions"]) == (6, "from-yaml", True)


# -- bad input is refused before anything starts ------------------------------------------------
def test_a_notebook_that_does_not_exist_is_refused_naming_the_available_ones(notebooks, tmp_path):
    with pytest.raises(MissingFileError, match=r"'03_missing'.*01_good\.ipynb, 02_bad\.ipynb"):
        headless.find_notebooks(["03_missing"], notebooks)
    assert main(["run", str(tmp_path / "nope.ipynb"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_an_undeclared_parameter_is_an_error_naming_the_declared_ones(notebooks, tmp_path):
    with pytest.raises(
        ConfigError, match=r"'cuont' is not declared.*RUN_DIR, SOLUTIONS, count, label"
    ):
        run([notebooks / "01_good.ipynb"], tmp_path / "out", {"cuont": 3})
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="use --out"):
        run([notebooks / "01_good.ipynb"], tmp_path / "out", {"RUN_DIR": "/tmp"})


def test_solutions_for_notebooks_without_exercises_is_refused(notebooks, tmp_path, monkeypatch):
    monkeypatch.setattr(headless, "project_root", lambda: tmp_path)
    assert main(["run", "02", "--solutions", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_a_parameter_goes_only_to_the_notebooks_that_declare_it(notebooks):
    plan = headless.plan_parameters(
        [notebooks / "01_good.ipynb", notebooks / "02_bad.ipynb"], {"count": 2, "divisor": 4}
    )
    assert plan == {
        notebooks / "01_good.ipynb": {"count": 2},
        notebooks / "02_bad.ipynb": {"divisor": 4},
    }


def test_a_run_folder_that_cannot_be_written_is_refused(notebooks, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"a-file/runs.*cannot be written.*--out"):
        run([notebooks / "01_good.ipynb"], blocker / "runs")


def test_a_kernel_that_runs_another_python_is_refused(tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / "otherpy"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "other",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    with pytest.raises(ConfigError, match=r"'otherpy' runs /usr/bin/python3.*ipykernel install"):
        headless.check_kernel("otherpy")
    with pytest.raises(ConfigError, match="'no-such-kernel' is not installed"):
        headless.check_kernel("no-such-kernel")
    assert headless.check_kernel("python3") == sys.executable


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3", 3),
        ("-2", -2),
        ("0.5", 0.5),
        ("1e3", 1000.0),
        ("True", True),
        ("false", False),
        ("None", None),
        ("null", None),
        ("smollm2", "smollm2"),
        ("'8000'", "8000"),
        ("[1, 2]", [1, 2]),
        ("{a: 1}", {"a": 1}),
        ("yes", "yes"),
        ("2024-01-01", "2024-01-01"),
    ],
)
def test_parameter_values_are_typed_like_papermill(text, value):
    parsed = headless.parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_a_params_file_must_hold_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        headless.parse_parameters(params_file=bad)
    with pytest.raises(MissingFileError, match="does not exist"):
        headless.parse_parameters(params_file=tmp_path / "missing.yaml")


# -- run folders for notebooks ------------------------------------------------------------------
def test_run_folder_uses_the_folder_papermill_passes(tmp_path):
    assert runs.run_folder(tmp_path / "given" / "nb") == (tmp_path / "given" / "nb").resolve()
    assert (tmp_path / "given" / "nb").is_dir()


def test_two_interactive_runs_never_share_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/notebooks/01_serve.ipynb")
    first, second = runs.run_folder(), runs.run_folder()
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == (tmp_path / "runs").resolve()
    assert first.name.endswith("-01_serve") and second.name.startswith(first.name)


def test_each_invocation_gets_its_own_timestamped_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "runs"))
    first, second = runs.invocation_folder(), runs.invocation_folder()
    assert first != second and first.parent == second.parent == (tmp_path / "runs").resolve()
    assert re.fullmatch(r"\d{8}-\d{6}(-\d+)?", second.name)
