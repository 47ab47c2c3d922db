"""The prompt UI, driven headless: fill its widgets, click its buttons, read its output."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from labkit.client import Generation
from labkit.errors import ConfigError
from labkit.server import TritonServer
from labkit.widgets import PromptUI, prompt_ui

# A real Python-backend model for the widget's server tests: it echoes the prompt, and refuses
# a max_tokens above 64 the way a real model refuses a bad parameter.
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


def write_echo_model(repository, name):
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    (repository / name / "1" / "model.py").write_text(ECHO_MODEL)


class Recorder:
    """A generate callable that records its calls and returns (or yields) what it is given."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, prompt, **params):
        self.calls.append((prompt, params))
        return self.result


def click(ui, prompt="Where is the nearest"):
    ui.prompt.value = prompt
    ui.button.click()
    return ui


# -- headless, with plain callables -------------------------------------------------------------
def test_a_callable_returning_text_fills_the_output_with_the_controls_as_parameters():
    fn = Recorder("star to the Sun?")
    ui = PromptUI(fn, max_tokens=16)
    ui.temperature.value = 0.7
    click(ui)
    assert ui.output.value == "star to the Sun?"
    assert fn.calls == [("Where is the nearest", {"max_tokens": 16, "temperature": 0.7})]
    assert ui.error.startswith("done in") and not ui.button.disabled


def test_top_p_and_top_k_are_passed_only_when_set_and_the_model_when_there_is_a_picker():
    fn = Recorder("x")
    ui = PromptUI(fn, models=["a", "b"], model="b")
    ui.top_p.value, ui.top_k.value = 0.9, 40
    click(ui)
    assert fn.calls[0][1] == {
        "max_tokens": 32,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 40,
        "model": "b",
    }


def test_a_generator_streams_its_pieces_into_the_output_as_they_arrive():
    seen = []

    def stream(prompt, **params):
        yield from ["I am", " going", " to"]

    ui = PromptUI(stream)
    ui.output.observe(lambda change: seen.append(change["new"]), names="value")
    click(ui, "I am going")
    assert seen == ["I am", "I am going", "I am going to"]
    assert "3 pieces" in ui.error


def test_a_generation_object_shows_its_text():
    ui = click(PromptUI(Recorder(Generation("a part of the team", {"text_output": "..."}, 0.1))))
    assert ui.output.value == "a part of the team"


def test_an_error_is_a_message_in_the_widget_not_a_traceback(caplog):
    def refuse(prompt, **params):
        raise ConfigError("max_tokens must be at least 1, got 0; pass max_tokens=1 or more")

    ui = click(PromptUI(refuse))
    assert ui.error == "max_tokens must be at least 1, got 0; pass max_tokens=1 or more"
    assert "Traceback" not in ui.status.value and ui.output.value == ""
    assert not ui.button.disabled


def test_a_stream_that_breaks_keeps_what_arrived_and_shows_the_error():
    def stream(prompt, **params):
        yield "half an"
        raise ConnectionResetError("server closed the stream")

    ui = click(PromptUI(stream))
    assert ui.output.value == "half an"
    assert ui.error == "ConnectionResetError: server closed the stream"


def test_an_empty_prompt_asks_for_one_without_calling():
    fn = Recorder("never")
    ui = click(PromptUI(fn), "   ")
    assert fn.calls == [] and ui.error == "type a prompt first"


def test_a_callable_returning_something_else_is_reported():
    ui = click(PromptUI(Recorder(42)))
    assert ui.error == "TypeError: generate returned int, not text"


# -- against a real Triton ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("widgets") / "repository"
    write_echo_model(repository, "echo")
    write_echo_model(repository, "idle")
    triton = TritonServer(
        repository,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        load_models=["echo"],
        startup_timeout_s=120,
        log_path=repository.parent / "tritonserver.log",
    )
    try:
        yield triton.start()
    finally:
        triton.stop()


@pytest.mark.integration
def test_the_picker_lists_the_repository_with_states_and_generate_calls_the_server(server):
    ui = prompt_ui(server)
    labels = dict((value, label) for label, value in ui.model.options)
    assert labels["echo"] == "echo" and labels["idle"].startswith("idle (")
    assert ui.model.value == "echo"
    click(ui, "hi there")
    assert ui.output.value == "echo: hi there"
    assert ui.error.startswith("done in")


@pytest.mark.integration
def test_a_parameter_the_model_refuses_is_shown_with_the_servers_reason(server):
    ui = prompt_ui(server, model="echo")
    ui.max_tokens.value = 100
    click(ui)
    assert "max_tokens must be at most 64, got 100" in ui.error
    assert ui.output.value == "" and "Traceback" not in ui.status.value


@pytest.mark.integration
def test_a_model_that_is_not_loaded_is_named_with_how_to_load_it(server):
    ui = prompt_ui(server, model="idle")
    click(ui)
    assert "model 'idle' is " in ui.error
    assert "load it with server.load_model('idle')" in ui.error


@pytest.mark.integration
def test_a_server_that_is_down_is_a_message_for_generate_and_refresh(tmp_path):
    empty = tmp_path / "repository"
    empty.mkdir()
    triton = TritonServer(
        empty,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        startup_timeout_s=60,
        log_path=tmp_path / "log",
    )
    try:
        ui = prompt_ui(triton.start(), model="echo")
        assert ui.error == "no models in the repository"
    finally:
        triton.stop()
    click(ui)
    assert triton.http_url in ui.error and "Traceback" not in ui.status.value
    ui.refresh.click()
    assert ui.error.startswith("cannot read the model repository")
