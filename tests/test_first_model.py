"""The learner's first model (``smollm2_first``, notebook 01) served by a real Triton.

One module-scoped server holds the first model and the lab's full model (``smollm2``) from the
committed folders, on the same weights; ``gated_first`` (the first model's code, a gated hub
model) is loaded by a test, never at start. The first model must answer what the full model
answers, keep each request's answers to itself, count ``max_tokens`` as new tokens, and refuse
bad requests and a gated model without a token with messages that name the fix.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from labkit import client, repository
from labkit.errors import InferenceError, ServerError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
FIRST, FULL = "smollm2_first", "smollm2"
PROMPTS = ["I am going", "Where is the nearest", "What is the capital of France? It is"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repo = tmp_path_factory.mktemp("repo")
    for name in (FIRST, FULL):
        shutil.copytree(
            ROOT / "model_repository" / name,
            repo / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("weights", "__pycache__"),
        )
    shutil.copytree(repo / FIRST / "1", repo / "gated_first" / "1")
    hub = {"huggingface_model": "meta-llama/Llama-2-7b-hf", "gated": "true", "labkit_weights": None}
    gated = repository.apply_edits(
        repository.read_config(repo / FIRST / "config.pbtxt"), parameters=hub
    )
    gated.name = "gated_first"
    repository.write_config(repo / "gated_first" / "config.pbtxt", gated)
    repository.prepare_repository(repo)
    return start_module_server(repo, load_models=[FIRST, FULL])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_first_model_answers_what_the_full_model_answers(server, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    for prompt in PROMPTS:
        (first,) = client.infer(url, FIRST, [prompt], protocol, max_tokens=16)
        (full,) = client.infer(url, FULL, [prompt], protocol, max_tokens=16)
        assert first == full and first.startswith(prompt) and len(first) > len(prompt)


def test_the_generate_endpoint_gives_the_same_answer_as_infer(server):
    answer = client.generate(server.http_url, FIRST, "I am going", temperature=0.0)  # the box's
    assert answer.text == client.generate(server.http_url, FULL, "I am going").text
    assert answer.text.startswith("I am going to")
    assert answer.raw["model_name"] == FIRST and "text_output" in answer.raw


def test_one_request_with_several_prompts_gets_each_its_own_answer(server):
    alone = [client.infer(server.http_url, FIRST, [p], max_tokens=6)[0] for p in PROMPTS]
    assert client.infer(server.http_url, FIRST, PROMPTS, max_tokens=6) == alone
    assert len(set(alone)) == len(PROMPTS)  # the tutorial's shared list would repeat answers


def test_max_tokens_counts_new_tokens_not_the_prompt(server):
    prompt = "The quick brown fox jumps over the lazy dog because it wanted to see " * 2
    (first,) = client.infer(server.http_url, FIRST, [prompt], max_tokens=4)
    assert first == client.infer(server.http_url, FULL, [prompt], max_tokens=4)[0]
    assert len(first) > len(prompt)  # with max_length=4 a long prompt would get nothing new


@pytest.mark.parametrize(
    ("prompt", "params", "named"),
    [
        ("   ", {}, "empty or only spaces"),
        ("Hi", {"max_tokens": 0}, "max_tokens must be a whole number of at least 1"),
        ("Hi", {"max_tokens": "ten"}, "max_tokens must be a whole number"),
        ("Hi", {"temperature": 0.7}, "this model answers greedily: temperature must be 0"),
        ("Hi", {"top_k": 5}, "unknown parameter(s) ['top_k']"),
    ],
)
def test_a_bad_request_gets_a_400_naming_the_problem_and_serving_goes_on(
    server, prompt, params, named
):
    with pytest.raises(InferenceError, match=re.escape(named)) as info:
        client.generate(server.http_url, FIRST, prompt, **params)
    assert info.value.status == 400
    assert client.generate(server.http_url, FIRST, "Hi", max_tokens=2).text.startswith("Hi")


def test_a_gated_model_without_a_token_fails_to_load_naming_hf_token(server):
    with pytest.raises(ServerError, match="gated on the Hugging Face Hub.*HF_TOKEN"):
        server.load_model("gated_first")
    assert client.generate(server.http_url, FIRST, "Hi", max_tokens=2).text.startswith("Hi")
