"""Notebook 06's one request each way (labkit.llm_serving.apis), without starting a server: the
request the ``openai`` client and Triton's ``/generate`` are sent, what is read from their answers,
a failure kept as text instead of raised, and the table and words a learner reads.

The HTTP answers here come from a small stand-in on a loopback port that records what it was sent:
it checks the requests' shape and the reading of the answers. The real servers answer in notebook
06 (``compare`` asks vLLM's own server and vLLM in Triton while both are up).

The tests that drive the ``openai`` client are marked integration: the client runs ``uname -p``
(Python's ``platform.platform()``, for its request headers) on its first request in a process."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from labkit import proc
from labkit.llm_serving import Comparison, apis, apis_frame
from labkit.llm_serving.charts import way_name
from labkit.repository import Repository
from labkit.runs import write_result
from labkit.settings import project_root

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "reference",
    "choices": [{"index": 0, "text": " to be a part", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
}
GENERATED = {
    "model_name": "smollm2_vllm",
    "model_version": "1",
    "text_output": " to be a part",
    "finish_reason": "stop",
    "num_input_tokens": 3,
    "num_output_tokens": 5,
}


class StandIn(BaseHTTPRequestHandler):
    """Answers ``POST`` by path from ``server.answers`` ({path: (status, JSON)}); records bodies."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body))
        status, answer = self.server.answers.get(self.path, (404, {"error": "no such path"}))
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet: the test reads what was sent instead
        pass


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    server.seen, server.answers = [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def address(server) -> str:
    return f"127.0.0.1:{server.server_address[1]}"


def test_both_requests_ask_the_same_greedy_answer_with_the_same_stop_string_and_length():
    request = apis.Request(prompt="Hello", stop=(".", "\n"), max_tokens=7)
    openai = apis.openai_arguments(request, "reference")
    body = apis.generate_body(request)
    sampling = json.loads(body.pop("sampling_parameters"))
    assert openai == {"model": "reference", "prompt": "Hello", "max_tokens": 7,
                      "temperature": 0, "stop": [".", "\n"]}  # fmt: skip
    assert sampling == {"max_tokens": 7, "temperature": 0, "stop": [".", "\n"]}
    # the answer alone (the OpenAI API's), and every output beside the text switched on
    assert body == {
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }


def test_every_field_sent_to_generate_is_an_input_of_the_served_vllm_model():
    config = Repository(project_root() / "model_repository").config("smollm2_vllm")
    inputs = {i.name: i for i in config.input}
    for name in apis.generate_body(apis.REQUEST):
        assert name in inputs and inputs[name].optional, name
    outputs = {o.name for o in config.output}
    assert set(apis.COLUMNS) - {"answer", "prompt_tokens", "answer_tokens"} <= outputs
    assert {"num_input_tokens", "num_output_tokens"} <= outputs


@pytest.mark.integration  # the openai client runs `uname -p`
def test_the_openai_client_and_generate_are_sent_the_request_and_their_answers_read(stand_in):
    stand_in.answers = {
        "/v1/completions": (200, COMPLETION),
        "/v2/models/smollm2_vllm/generate": (200, GENERATED),
    }
    url = address(stand_in)
    answers = apis.ask_both(url, "reference", url, "smollm2_vllm")
    (path, sent), (path2, sent2) = stand_in.seen
    assert path == "/v1/completions"
    assert {k: sent[k] for k in ("model", "prompt", "max_tokens", "temperature", "stop")} == (
        apis.openai_arguments(apis.REQUEST, "reference")
    )
    assert path2 == "/v2/models/smollm2_vllm/generate"
    assert sent2 == {"text_input": apis.REQUEST.prompt, **apis.generate_body(apis.REQUEST)}
    read = [{k: a[k] for k in ("way", *apis.COLUMNS, "error")} for a in answers]
    same = {"answer": " to be a part", "finish_reason": "stop", "prompt_tokens": 3,
            "answer_tokens": 5, "error": None}  # fmt: skip
    assert read == [{"way": "vllm-standalone", **same}, {"way": "vllm", **same}]
    assert all(a["seconds"] >= 0 for a in answers)
    assert apis.problems(answers) == []


@pytest.mark.integration  # the openai client runs `uname -p`
def test_a_failed_request_is_kept_as_its_error_and_the_other_way_still_answers(stand_in):
    stand_in.answers = {
        "/v1/completions": (500, {"error": {"message": "engine died", "type": "InternalError"}}),
        "/v2/models/smollm2_vllm/generate": (200, GENERATED),
    }
    url = address(stand_in)
    answers = apis.ask_both(url, "reference", url, "smollm2_vllm")
    assert answers[0]["answer"] is None and "engine died" in answers[0]["error"]
    assert url in answers[0]["error"]
    assert answers[1]["answer"] == " to be a part" and answers[1]["error"] is None
    assert apis.problems(answers)[0].startswith(
        "vLLM's own server, with the openai client (/v1/completions) failed: InternalServerError"
    )


def test_a_model_answering_without_the_asked_outputs_is_named_as_not_speaking_the_contract(
    stand_in,
):
    stand_in.answers = {"/v2/models/smollm2/generate": (200, {"text_output": " to be"})}
    (answer,) = apis.ask_both(None, "reference", address(stand_in), "smollm2")
    assert "answered without finish_reason, num_input_tokens, num_output_tokens" in answer["error"]
    assert "does not speak the contract" in answer["error"]


@pytest.mark.integration  # the openai client runs `uname -p`
def test_a_server_that_is_not_there_is_an_error_naming_its_address_not_a_raise():
    url = f"127.0.0.1:{proc.free_port()}"
    answers = apis.ask_both(url, "reference", url, "smollm2_vllm", timeout_s=5)
    assert [a["way"] for a in answers] == ["vllm-standalone", "vllm"]
    assert all(url in a["error"] and a["answer"] is None for a in answers)


def test_problems_name_each_output_the_two_ways_disagree_on():
    base = {"answer": " to be", "finish_reason": "stop", "prompt_tokens": 3, "answer_tokens": 5}
    answers = [
        {"way": "vllm-standalone", **base, "error": None},
        {"way": "vllm", **base, "prompt_tokens": 4, "error": None},
    ]
    assert apis.problems(answers) == [
        f"the prompt tokens differ: 3 from {apis.APIS['vllm-standalone']}; 4 from "
        f"{apis.APIS['vllm']}"
    ]
    assert apis.problems(answers[:1]) == []


def test_the_table_has_one_row_per_way_and_shows_a_failure_in_words():
    answers = [
        {"way": "vllm-standalone", "answer": " to be", "finish_reason": "stop",
         "prompt_tokens": 3, "answer_tokens": 5, "error": None},
        {"way": "vllm", "answer": None, "finish_reason": None, "prompt_tokens": None,
         "answer_tokens": None, "error": "InferenceError: refused"},
    ]  # fmt: skip
    frame = apis_frame(answers)
    assert list(frame.columns) == [
        "way", "answer", "finish reason", "prompt tokens", "answer tokens"
    ]  # fmt: skip
    assert list(frame["way"]) == [apis.APIS["vllm-standalone"], apis.APIS["vllm"]]
    assert list(frame["answer"]) == [" to be", "failed: InferenceError: refused"]
    assert frame["prompt tokens"].iloc[0] == 3 and frame["prompt tokens"].isna().iloc[1]


def test_each_way_is_named_as_the_lessons_table_and_charts_name_it():
    for way, label in apis.APIS.items():
        assert label.startswith(way_name(way) + ", with "), label


def test_a_comparisons_json_keeps_the_answers_of_both_apis(tmp_path):
    answer = {"way": "vllm", "answer": " to be", "finish_reason": "stop", "error": None}
    comparison = Comparison(settings={}, host={}, run_dir=str(tmp_path), apis=[answer])
    path = write_result(tmp_path, "inflight", comparison)
    assert json.loads(path.read_text())["apis"] == [answer]
