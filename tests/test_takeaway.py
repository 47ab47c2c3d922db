"""Every notebook's last word: at most three lines of figures and verdicts, shown at its end and
kept for the run's index; 00, 01 and 02's own takeaways, by their figures."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from labkit import lab, lessons, report
from labkit.errors import ConfigError
from labkit.lessons import Takeaway
from labkit.lessons.takeaway import sentence_count


def test_a_takeaway_is_one_to_three_non_empty_lines():
    assert str(Takeaway(("a", " b "))) == "a\nb"
    for bad in [(), ("a", "b", "c", "d"), ("a", "  ")]:
        with pytest.raises(ConfigError, match="1 to 3 non-empty lines"):
            Takeaway(bad)
    assert "<li>x &lt; y</li>" in Takeaway(("x < y",))._repr_html_()
    with pytest.raises(ConfigError, match="no takeaway"):
        Takeaway.of(lessons.Conclusion(pd.DataFrame()))


def test_setup_says_ready_or_not_with_each_status_counted_and_named():
    checks = pd.DataFrame(
        {"check": ["python", "docker", "hf token", "perf_analyzer", "gpu"],
         "status": ["ok", "warn", "warn", "ok", "skipped"]}
    )  # fmt: skip
    said = lessons.setup_takeaway(checks).lines
    assert said[0].startswith("Ready:") and "2 ok, 0 fail, 2 warn, 1 skipped" in said[0]
    assert said[1:] == ("Warned: docker, hf token.", "Skipped: gpu.")
    failed = lessons.setup_takeaway(checks.assign(status=["fail", "warn", "warn", "ok", "skipped"]))
    assert failed.lines[0].startswith("Not ready:") and failed.lines[1] == "Failed: python."
    assert len(failed.lines) == 3  # the failure first; skipped checks give way
    with pytest.raises(ConfigError, match="doctor.to_frame"):
        lessons.setup_takeaway(pd.DataFrame())


def test_deploy_gives_the_model_py_lines_the_answers_agreement_and_the_stream():
    ways = {"HTTP infer": "I am going to be. I'm", "gRPC": "I am going to be. I'm"}
    said = lessons.deploy_takeaway(
        "smollm2_first", ways, 0.1234, 27.04, model_py_lines=99, stream_model="smollm2_stream"
    ).lines
    assert "99-line model.py" in said[0]
    assert said[1].startswith("Same greedy answer by all 2 ways")
    assert "0.12 s" in said[2] and "27.0 tokens/s" in said[2]
    assert sentence_count(said) == 3  # the answers, which hold sentences, are not quoted
    ways["streaming"] = "I am going away"
    differed = lessons.deploy_takeaway("m", ways, 1, 2, model_py_lines=9, stream_model="s")
    assert differed.lines[1] == "Answers differed: streaming against HTTP infer."
    with pytest.raises(ConfigError, match="needs the answers"):
        lessons.deploy_takeaway("m", {}, 1, 2, model_py_lines=9, stream_model="s")


def test_multi_model_answers_how_many_fit_first_then_memory_live_changes_and_the_search():
    from labkit.lessons.search import how_many_fit

    fit = how_many_fit(pd.Series({"smollm2": 1.131}), 22.83).loc["smollm2"]
    found = lessons.search_conclusion(
        "breakfast?", pd.DataFrame({"document": ["fresh bread. Open daily.", "trains"],
                                    "score": [0.5, 0.1]})
    )  # fmt: skip
    said = lessons.multi_model_takeaway(
        ["smollm2", "minilm"], held_gib=1.31, estimated_gib=1.7, fit=fit,
        live=("minilm", "smollm2"), search=found,
    ).lines  # fmt: skip
    assert said[0].startswith("Copies of smollm2 that fit in memory: 20")
    assert "22.83 / 1.131 = 20.18" in said[0]
    assert "1.31 GiB measured" in said[1] and "1.70 GiB estimated" in said[1]
    assert "minilm reloaded and smollm2 reconfigured" in said[1]
    assert "(0.500, 0.400 ahead)" in said[2] and "sharing no word" in said[2]
    assert sentence_count(said) == 3  # a quoted passage ends no sentence
    alone = lessons.multi_model_takeaway(["minilm"], held_gib=0.41, estimated_gib=0.6).lines
    assert alone == ("One server held minilm: 0.41 GiB measured against 0.60 GiB estimated.",)
    with pytest.raises(ConfigError, match="models the server held"):
        lessons.multi_model_takeaway([], held_gib=0, estimated_gib=0)


def test_the_takeaway_is_kept_for_the_index_and_a_missing_one_is_said(tmp_path):
    shown = lab.takeaway(tmp_path, ["one", "two"])
    assert json.loads((tmp_path / report.TAKEAWAY_FILE).read_text()) == ["one", "two"]
    assert str(shown) == "one\ntwo"
    results = [
        report.NotebookResult("00_setup_check.ipynb", "x", "ok", 1.0, takeaway=["one", "two"]),
        report.NotebookResult("01_deploy_transformer.ipynb", "x", "failed", 2.0),
    ]
    index = report.write_index(report.RunReport(tmp_path, results)).read_text()
    assert "<th>takeaway</th>" in index and "<ol><li>one</li><li>two</li></ol>" in index
    assert index.count(report.NO_TAKEAWAY) == 1


def test_the_tutorials_dockerfile_is_set_beside_the_labs(tmp_path):
    from labkit.server import image

    (tmp_path / "Dockerfile").write_text(
        "ARG TRITON_RELEASE=26.06\nFROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3\n"
        'ARG TORCH_VERSION=2.13.0\nARG TRANSFORMERS_REF=""\nENV HF_HOME=/root/.cache/hf\n'
    )
    (tmp_path / "requirements.txt").write_text("# pins\ntransformers==5.24.0\nnumpy==1.26.4\n")
    table = image.compare_with_tutorial(tmp_path).set_index("what")
    ours, theirs = table["docker/Dockerfile"], table["the tutorial's Dockerfile"]
    assert ours["base image"] == "nvcr.io/nvidia/tritonserver:26.06-py3"
    assert theirs["base image"] == image.TUTORIAL_BASE_IMAGE
    assert (theirs["transformers"], ours["transformers"]) == ("4.34.0", "5.24.0")
    assert (theirs["torch"], ours["torch"]) == ("-", "2.13.0")
    assert (theirs["einops"], ours["einops"]) == ("0.6.1", "-")
    assert ours["Day Zero transformers"] == "--build-arg TRANSFORMERS_REF=<git ref>"
    assert ours["Hugging Face cache"].startswith("HF_HOME")
    assert theirs["Hugging Face cache"].startswith("TRANSFORMERS_CACHE")
    # the lab's own Dockerfile reads too, with the release the settings name
    from labkit.settings import TRITON_RELEASE

    shipped = image.compare_with_tutorial().set_index("what")["docker/Dockerfile"]
    assert shipped["base image"] == f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-py3"


@pytest.mark.integration
def test_the_labkit_command_runs_in_the_kernels_python_and_names_its_failure():
    from labkit.errors import ToolError

    assert lab.labkit_command("image", "build", "--dry-run").startswith("docker build -t ")
    with pytest.raises(ToolError, match="invalid choice"):
        lab.labkit_command("no-such-command")


def test_a_takeaway_reads_as_numbered_lines_in_text():
    assert repr(Takeaway(("a", "b"))) == "Takeaway:\n1. a\n2. b"


def test_a_shown_table_keeps_its_numbers_as_rounded_not_padded_to_six_decimals():
    frame = pd.DataFrame(
        {"configuration": ["one", "two"], "clients": [4, 4], "infer/s": [10.1, 455.0],
         "bytes": [float("nan"), 1234567.8]}
    )  # fmt: skip
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", lab.show_table(frame).to_html())
    assert cells == ["one", "4", "10.1", "", "two", "4", "455", "1234568"]


def test_a_shown_table_shows_text_as_text_not_as_html_tags():
    frame = pd.DataFrame({"way": ["Triton's /v2/models/<model>/generate"], "tokens": [3]})
    html = lab.show_table(frame).to_html()
    assert "/v2/models/&lt;model&gt;/generate" in html
    assert "<model>" not in html
