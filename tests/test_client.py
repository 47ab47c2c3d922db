"""labkit.client against a real Triton serving a tiny Falcon, with and without batching."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from labkit import client, repository
from labkit.errors import ConfigError, InferenceError
from labkit.proc import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repo = tmp_path_factory.mktemp("repo")
    repository.add_model(repo, "tiny-falcon", name="tf0", max_tokens=4)
    repository.add_model(
        repo, "tiny-falcon", name="tfb", max_tokens=4, max_batch_size=4, dynamic_batching=True
    )
    repository.prepare_repository(repo)
    return start_module_server(repo)


def run_curl(line: str) -> dict:
    args = shlex.split(line)
    args[1:1] = ["-sS", "--fail-with-body"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.mark.integration
@pytest.mark.parametrize(("model", "batched"), [("tf0", False), ("tfb", True)])
def test_printed_curl_commands_run_and_answer_like_the_client(server, model, batched):
    prompt = 'It\'s "quoted" & spaced'
    expected = client.infer(server.http_url, model, prompt)[0]
    infer = run_curl(client.curl_command(server.http_url, model, prompt, batched=batched))
    assert infer["outputs"][0]["data"] == [expected]
    generate = run_curl(client.curl_command(server.http_url, model, prompt, endpoint="generate"))
    assert generate["text_output"] == expected


def test_the_tutorial_curl_line_is_what_curl_command_prints():
    line = client.curl_command("localhost:8000", "falcon7b", "I am going")
    assert line == (
        "curl -X POST localhost:8000/v2/models/falcon7b/infer -d "
        """'{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], """
        """"data": ["I am going"]}]}'"""
    )


def test_the_curl_line_and_a_load_send_the_same_infer_body():
    from labkit.load import Load

    line = client.curl_command("h:1", "m", "Hi", batched=True, max_tokens=3)
    printed = json.loads(shlex.split(line)[-1])
    assert printed == client.infer_body("Hi", batched=True, parameters={"max_tokens": 3})
    assert printed["inputs"][0]["shape"] == [1, 1] and printed["parameters"] == {"max_tokens": 3}
    load = Load("h:1", "m", endpoint="infer", batched=True)
    assert json.loads(load._body("Hi", None, 3, True)) == printed
    assert "parameters" not in client.infer_body("Hi")


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_learns_whether_a_model_batches(server, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    assert client.model_batches(url, "tf0", protocol) is False
    assert client.model_batches(url, "tfb", protocol) is True


@pytest.mark.integration
def test_generate_returns_text_raw_json_and_timing(server):
    answer = client.generate(f"http://{server.http_url}/", "tfb", "Hi", max_tokens=2)
    assert answer.raw["model_name"] == "tfb" and answer.raw["text_output"] == answer.text
    assert answer.text.startswith("Hi") and answer.seconds > 0
    assert client.infer(server.http_url, "tfb", "Hi", max_tokens=2) == [answer.text]


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_refusals_carry_the_server_reason(server, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    with pytest.raises(InferenceError, match="'top_p' must be in") as info:
        client.infer(url, "tf0", "Hi", protocol, top_p=3.0)
    assert info.value.status in (400, "StatusCode.INVALID_ARGUMENT")
    with pytest.raises(InferenceError, match="unknown model.*'no-such-model'"):
        client.infer(url, "no-such-model", "Hi", protocol, batched=False)


def test_generate_without_a_server_names_the_address():
    url = f"127.0.0.1:{free_port()}"
    with pytest.raises(InferenceError, match=f"cannot reach Triton at '{url}'"):
        client.generate(url, "tf0", "Hi", timeout_s=5)
    with pytest.raises(InferenceError, match=f"cannot reach Triton at '{url}'"):
        client.infer(url, "tf0", "Hi", batched=False, timeout_s=5)


def test_client_rejects_unknown_protocols_and_empty_prompt_lists():
    with pytest.raises(ConfigError, match="protocol 'ws'"):
        client.infer("127.0.0.1:1", "m", "Hi", "ws", batched=False)
    with pytest.raises(ConfigError, match="prompts is empty"):
        client.infer("127.0.0.1:1", "m", [], batched=False)
    with pytest.raises(ConfigError, match="endpoint 'stream'"):
        client.curl_command("127.0.0.1:1", "m", "Hi", endpoint="stream")
