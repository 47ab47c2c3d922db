"""Every notebook's last word: three lines computed from its figures, shown at its end and kept
for the run's index. A gain, a tie and a loss read differently in each takeaway."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from test_lesson_batching import sweep
from test_lesson_scale_out import conclude as scale_out
from test_lessons import in_rounds, search

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


def test_setup_says_whether_the_lab_can_start_what_warned_and_what_did_not_run():
    checks = pd.DataFrame(
        {"check": ["python", "docker", "hf token", "perf_analyzer", "gpu"],
         "status": ["ok", "warn", "warn", "ok", "skipped"]}
    )  # fmt: skip
    said = lessons.setup_takeaway(checks)
    assert said.lines == (
        "2 of 5 checks passed and 0 failed: this machine can run the lab's notebooks.",
        "2 warned (docker, hf token): each row says what the lab does without it.",
        "1 did not run (gpu): their rows say why.",
    )
    assert sentence_count(said.lines) == 3
    failed = lessons.setup_takeaway(checks.assign(status=["fail", "ok", "ok", "ok", "ok"])).lines
    assert failed == ("4 of 5 checks passed and 1 failed: fix python first, as their rows say.",)
    with pytest.raises(ConfigError, match="doctor.to_frame"):
        lessons.setup_takeaway(pd.DataFrame())


def test_deploy_says_what_serving_took_that_every_way_agreed_and_the_stream():
    ways = {"HTTP infer": "I am going to be. I'm", "gRPC": "I am going to be. I'm"}
    said = lessons.deploy_takeaway(
        "smollm2_first", ways, 0.1234, 27.04, model_py_lines=99, stream_model="smollm2_stream"
    ).lines
    assert said == (
        "Serving smollm2_first took a folder with a config.pbtxt and a 99-line model.py, whose "
        "initialize loads the model and whose execute answers each request.",
        "Greedy decoding picks the likeliest next token each time, so HTTP infer and gRPC all "
        "returned the same answer.",
        "Streamed token by token by smollm2_stream, the first token came after 0.12 s, then "
        "27.0 tokens/s.",
    )
    assert sentence_count(said) == 3  # the answers, which hold sentences, are not quoted
    ways["streaming"] = "I am going away"
    differed = lessons.deploy_takeaway("m", ways, 1, 2, model_py_lines=9, stream_model="s")
    assert differed.lines[1].startswith("streaming returned another answer than HTTP infer and")
    with pytest.raises(ConfigError, match="needs the answers"):
        lessons.deploy_takeaway("m", {}, 1, 2, model_py_lines=9, stream_model="s")


def test_multi_model_tells_a_search_by_words_from_one_by_meaning():
    docs = ["trains to the airport.", "fresh bread every morning."]
    by_words = lessons.search_conclusion(
        "Where is a train?", pd.DataFrame({"document": docs, "score": [0.39, 0.36]})
    )
    by_meaning = lessons.search_conclusion(
        "breakfast", pd.DataFrame({"document": docs[::-1], "score": [0.5, 0.1]})
    )
    said = lessons.multi_model_takeaway(
        ["smollm2", "minilm"], [by_words, by_meaning], measured_gib=1.31, estimated_gib=1.7
    ).lines
    assert said[0] == (
        "One server held 2 models (smollm2, minilm), each in its own process, in 1.31 GiB of "
        "memory against the 1.70 GiB estimated."
    )
    assert said[1].startswith('Asked "Where is a train?", the search ranked "trains to the')
    assert 'sharing the word "train" with the question' in said[1] and "0.030 ahead" in said[1]
    assert "sharing no word with the question: it was found by meaning" in said[2]
    assert sentence_count(said) == 3  # a quoted question or passage ends no sentence
    fits = lessons.multi_model_takeaway(
        ["minilm"], [], measured_gib=0.41, estimated_gib=0.6, free_gib=21.34
    ).lines
    assert fits[0].endswith(
        "against the 0.60 GiB estimated, out of 21.3 GiB free: as many models fit as their "
        "estimates add up to within the free memory."
    )
    alone = lessons.multi_model_takeaway(["minilm"], []).lines
    assert alone == ("One server held 1 model (minilm), each in its own process.",)


@pytest.mark.parametrize(
    ("on_8", "expected"),
    [
        (8.0, "Dynamic batching served 3.2 times as many requests per second with 8 clients"),
        (2.6, "With 8 clients, dynamic batching's 2.60 against 2.50 requests per second is within"),
        (1.0, "With 8 clients, dynamic batching served fewer requests per second (1.00 against"),
    ],
    ids=["gain", "tie", "loss"],
)
def test_batching_takeaway_carries_the_conclusions_verdict(on_8, expected):
    off = sweep({1: 2.0, 8: 2.5})
    on = sweep({1: 2.0, 8: on_8}, {8: 5.0})
    said = lessons.batching_conclusion(off, on).takeaway
    assert len(said) == 1 and said[0].startswith(expected)
    assert sentence_count(said) == 1


@pytest.mark.parametrize(
    ("winner_runs", "said"),
    [([6.2, 6.1], "A max batch size of 4 was faster in every round against the default's 8"),
     ([5.1, 4.8], "A max batch size of 4 tied with the default's 8 (x0.96 to x1.02 over 2 rounds)"),
     ([4.0, 4.1], "A max batch size of 4 was slower in every round against the default's 8")],
    ids=["gain", "tie", "loss"],
)  # fmt: skip
def test_analyzer_takeaway_gives_a_verdict_per_setting_and_the_pick(winner_runs, said):
    rounds = in_rounds({"d": [5.0, 5.0], "w": winner_runs, "two": [3.0, 3.1]})
    takeaway = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=2).takeaway
    assert takeaway[0].startswith(said)
    assert takeaway[1].startswith("Two instances lost")
    assert takeaway[2].startswith("Model Analyzer picked max batch size 8 -> 4 from one")
    assert sentence_count(takeaway) == 3


@pytest.mark.parametrize(
    ("replicas", "verdict", "said"),
    [(26.0, "gain", "replicas gained more than instances here"),
     (28.0, "tie", "no difference beyond the noise of these rounds"),
     (4.4, "loss", "replicas gained less than instances")],
    ids=["gain", "tie", "loss"],
)  # fmt: skip
def test_scale_out_takeaway_says_what_replicas_buy(replicas, verdict, said):
    instances = 15.0 if verdict == "gain" else 30.0
    lines = scale_out(one=20.0, instances=instances, replicas=replicas).takeaway
    assert lines[0].startswith("On 2 cores, 2 replicas behind HAProxy") and said in lines[0]
    assert "failover" in lines[2] and sentence_count(lines) == 3


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


def test_notebook_02s_takeaway_answers_its_question_first_what_fits_and_what_changed_live():
    import pandas as pd

    from labkit.lessons import Conclusion

    words = Conclusion(pd.DataFrame(), {"question": "q", "winner": "w", "winner_score": 0.4})
    meaning = Conclusion(pd.DataFrame(), {"question": "r", "winner": "m", "winner_score": 0.5})
    said = lessons.multi_model_takeaway(["a", "b"], [words, meaning], live=("b", "a"))
    assert said.lines[1].startswith("b was unloaded and loaded again, and a's configuration")
    assert said.lines[2].startswith('Asked "r", the search ranked "m" first')
    assert len(said.lines) == 3


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
