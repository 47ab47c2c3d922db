"""The prompt UI, driven headless against a real Triton: fill its widgets, click its buttons,
read its output. The models are small numpy-only Python models written here (they load in about
a second): ``echo`` answers ``echo: <prompt>``, ``settings`` answers with the request parameters
it received, ``words`` streams the prompt back word by word (decoupled), and ``idle`` is never
loaded."""

from __future__ import annotations

import json
import os
import signal

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import wait_for
from labkit.profiling import request_counts
from labkit.widgets import PromptUI, prompt_ui

# It echoes the prompt, and refuses a max_tokens above 64 the way a real model refuses a bad
# parameter.
ECHO_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters() or "{}")
            max_tokens = params.get("max_tokens", 16)
            if max_tokens > 64:
                error = pb_utils.TritonError(f"max_tokens must be at most 64, got {max_tokens}")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            out = np.array([b"echo: " + t for t in text.reshape(-1)], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)]))
        return responses
"""

# It answers with its own name and the request parameters it received, as JSON.
SETTINGS_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            seen = {"model": self.name, "parameters": json.loads(request.parameters() or "{}")}
            out = np.array([json.dumps(seen, sort_keys=True).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)]))
        return responses
"""

# Decoupled: one response per word of the prompt, then the final flag. ``stall_s`` > 0 waits
# that long after the first word (a generation that is still running when its server stops).
WORDS_MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

STALL_S = {stall_s}


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            words = text.reshape(-1)[0].decode("utf-8").split(" ")
            for i, word in enumerate(words):
                piece = (word if i == 0 else " " + word).encode("utf-8")
                out = pb_utils.Tensor("text_output", np.array([piece], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse([out]))
                if STALL_S:
                    time.sleep(STALL_S)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def write_model(repository, name, code, *, decoupled=False):
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    config.model_transaction_policy.decoupled = decoupled
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    (repository / name / "1" / "model.py").write_text(code)


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repository = tmp_path_factory.mktemp("widgets") / "repository"
    write_model(repository, "echo", ECHO_MODEL)
    write_model(repository, "idle", ECHO_MODEL)
    write_model(repository, "settings", SETTINGS_MODEL)
    write_model(repository, "words", WORDS_MODEL.format(stall_s=0), decoupled=True)
    return start_module_server(repository, load_models=["echo", "settings", "words"])


def click(ui, prompt="Where is the nearest"):
    ui.prompt.value = prompt
    ui.button.click()
    return ui


@pytest.mark.integration
def test_the_picker_lists_the_repository_with_states_and_generate_calls_the_server(server):
    ui = prompt_ui(server)
    labels = dict((value, label) for label, value in ui.model.options)
    assert labels["echo"] == "echo" and labels["idle"].startswith("idle (")
    assert ui.model.value == "echo"
    click(ui, "hi there")
    assert ui.output.value == "echo: hi there"  # the text of the Generation /generate returned
    assert ui.error.startswith("done in") and not ui.button.disabled


@pytest.mark.integration
def test_the_controls_reach_the_model_as_request_parameters(server):
    ui = prompt_ui(server, model="settings", max_tokens=16)
    ui.temperature.value = 0.7
    click(ui)
    seen = json.loads(ui.output.value)
    assert seen == {"model": "settings", "parameters": {"max_tokens": 16, "temperature": 0.7}}
    assert ui.error.startswith("done in") and not ui.button.disabled


@pytest.mark.integration
def test_top_p_and_top_k_are_sent_only_when_set_to_the_model_the_picker_names(server):
    ui = prompt_ui(server, model="echo")
    ui.model.value = "settings"
    click(ui)
    assert json.loads(ui.output.value)["parameters"] == {"max_tokens": 32, "temperature": 0.0}
    ui.top_p.value, ui.top_k.value = 0.9, 40
    click(ui)
    seen = json.loads(ui.output.value)
    assert seen["model"] == "settings"
    assert seen["parameters"] == {"max_tokens": 32, "temperature": 0.0, "top_p": 0.9, "top_k": 40}


@pytest.mark.integration
def test_a_streaming_model_fills_the_output_piece_by_piece(server):
    ui = prompt_ui(server, model="words")
    seen = []
    ui.output.observe(lambda change: seen.append(change["new"]), names="value")
    click(ui, "I am going to")
    assert seen == ["I", "I am", "I am going", "I am going to"]
    assert ui.error.startswith("done in") and "4 pieces" in ui.error


@pytest.mark.integration
def test_a_stream_whose_server_stops_keeps_what_arrived_and_shows_the_error(tmp_path, start_server):
    repository = tmp_path / "repository"
    write_model(repository, "stalls", WORDS_MODEL.format(stall_s=300), decoupled=True)
    stopping = start_server(repository)
    ui = prompt_ui(stopping, model="stalls")

    killed_at = []

    def stop_at_the_first_piece(change):
        if change["new"] and not killed_at:
            killed_at.append(change["new"])
            os.killpg(stopping.pid, signal.SIGKILL)  # the server (and its stub) end mid-stream

    ui.output.observe(stop_at_the_first_piece, names="value")
    click(ui, "half an answer")
    assert killed_at == ["half"]
    # The stream breaks when the kernel closes the server's sockets, which is before the process
    # has finished exiting (a large address space takes a moment to tear down); CI's 2-core run
    # once saw it still running right after the click.
    wait_for(lambda: not stopping.running, 30, "the killed server's exit", interval_s=0.05)
    assert ui.output.value == "half"
    assert ui.error and not ui.error.startswith("done in"), ui.error
    assert "Traceback" not in ui.status.value and not ui.button.disabled


@pytest.mark.integration
def test_a_parameter_the_model_refuses_is_a_message_with_the_servers_reason(server):
    ui = prompt_ui(server, model="echo")
    ui.max_tokens.value = 100
    click(ui)
    assert ui.error == (
        "model 'echo' refused the request (400): max_tokens must be at most 64, got 100"
    )
    assert ui.output.value == "" and "Traceback" not in ui.status.value
    assert not ui.button.disabled


@pytest.mark.integration
def test_an_empty_prompt_asks_for_one_without_calling_the_server(server):
    ui = prompt_ui(server, model="echo")
    before = request_counts(server.metrics_url, "echo")
    click(ui, "   ")
    assert ui.error == "type a prompt first"
    assert request_counts(server.metrics_url, "echo") == before


@pytest.mark.integration
def test_a_model_that_is_not_loaded_is_named_with_how_to_load_it(server):
    ui = prompt_ui(server, model="idle")
    click(ui)
    assert "model 'idle' is " in ui.error
    assert "load it with server.load_model('idle')" in ui.error


@pytest.mark.integration
def test_a_server_that_is_down_is_a_message_for_generate_and_refresh(tmp_path, start_server):
    empty = tmp_path / "repository"
    empty.mkdir()
    triton = start_server(empty)
    ui = prompt_ui(triton, model="echo")
    assert ui.error == "no models in the repository"
    triton.stop()
    click(ui)
    assert triton.http_url in ui.error and "Traceback" not in ui.status.value
    ui.refresh.click()
    assert ui.error.startswith("cannot read the model repository")


def test_a_fake_generate_returning_something_else_is_reported():
    # Fake: no labkit client returns anything but text; a user's own generate function might.
    ui = click(PromptUI(lambda prompt, **params: 42))
    assert ui.error == "TypeError: generate returned int, not text"
    assert ui.output.value == "" and not ui.button.disabled
