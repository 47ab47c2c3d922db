"""The learner's first model (``smollm2_first``, notebook 01) served by a real Triton.

One module-scoped server holds the first model and the lab's full model (``smollm2``) from the
committed folders, on the same weights; ``gated_first`` (the first model's code, a gated hub
model) is loaded by a test, never at start. The first model must answer what the full model
answers, keep each request's answers to itself, count ``max_tokens`` as new tokens, and refuse
bad requests and a gated model without a token with messages that name the fix. ``faulty_first``
(the first model's code with a fault injected for one prompt, batching four requests; loaded by a
test) shows that an unexpected error fails its own request alone.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import JOIN_DELAY_MICROSECONDS, sent_together
from labkit import client, repository
from labkit.errors import InferenceError, ServerError
from labkit.server import served_config

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
    add_faulty_twin(repo)
    repository.prepare_repository(repo)
    return start_module_server(repo, load_models=[FIRST, FULL])


#: Appended to the first model's code in ``faulty_first``: the prompt FAULT raises an error that is
#: not a ValueError, as a bug or a failing device would.
FAULT = "Fail here"
FAULTY_CODE = f"""

_generate = TritonPythonModel.generate


def _faulty_generate(self, prompt, max_tokens):
    if prompt == {FAULT!r}:
        raise RuntimeError("a fault injected by the test")
    return _generate(self, prompt, max_tokens)


TritonPythonModel.generate = _faulty_generate
"""


def add_faulty_twin(repo: Path) -> None:
    """``faulty_first``: the first model's code and FAULTY_CODE, batching four requests."""
    shutil.copytree(repo / FIRST / "1", repo / "faulty_first" / "1")
    code = repo / "faulty_first" / "1" / "model.py"
    code.write_text(code.read_text() + FAULTY_CODE)
    config = repository.apply_edits(
        repository.read_config(repo / FIRST / "config.pbtxt"),
        max_batch_size=4,
        preferred_batch_size=[4],
        max_queue_delay_microseconds=JOIN_DELAY_MICROSECONDS,
    )
    config.name = "faulty_first"
    repository.write_config(repo / "faulty_first" / "config.pbtxt", config)


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


def test_max_tokens_over_the_configs_limit_is_refused_at_once(server):
    params = served_config(server, FIRST)["parameters"]
    limit = int(params["max_tokens_limit"]["string_value"])
    with pytest.raises(
        InferenceError,
        match=re.escape(f"max_tokens 1000000 is over this model's max_tokens_limit of {limit}"),
    ) as info:  # it held the model's only instance for minutes
        client.generate(server.http_url, FIRST, "Count: 1, 2,", max_tokens=1_000_000, timeout_s=60)
    assert info.value.status == 400


def test_a_prompt_and_max_tokens_past_the_models_context_are_refused(server):
    weights = Path(server.model_repository) / FIRST / "weights" / "config.json"
    context = json.loads(weights.read_text())["max_position_embeddings"]
    prompt = "Count: " + "1, " * (context // 2)  # "1, " is 3 tokens: over the context
    with pytest.raises(
        InferenceError,
        match=rf"the prompt and max_tokens 8 are \d+ tokens, over the model.s context of {context}",
    ) as info:
        client.generate(server.http_url, FIRST, prompt, max_tokens=8, timeout_s=60)
    assert info.value.status == 400


def test_an_unexpected_error_fails_its_own_request_and_the_batch_is_answered(server):
    server.load_model("faulty_first")
    try:
        prompts = ["I am going", FAULT, "Where is the nearest", "I am going"]
        alone = {
            p: client.infer(server.http_url, FIRST, [p], max_tokens=4)[0] for p in prompts[::2]
        }

        def ask(prompt: str):
            try:
                return client.infer(server.http_url, "faulty_first", [prompt], max_tokens=4)[0]
            except InferenceError as exc:
                return exc

        results, counts = sent_together(server, "faulty_first", ask, prompts)
    finally:
        server.unload_model("faulty_first")
    assert counts["execution_count"] == 1, counts  # the four ran as one batch
    assert [results[i] for i in (0, 2, 3)] == [alone[prompts[i]] for i in (0, 2, 3)]
    failed = results[1]
    assert isinstance(failed, InferenceError) and failed.status == 500, failed
    assert "RuntimeError" in str(failed) and "fault injected" in str(failed)
    assert "Traceback" not in str(failed) and "At:" not in str(failed)


def test_a_gated_model_without_a_token_fails_to_load_naming_hf_token(server):
    with pytest.raises(ServerError, match="gated on the Hugging Face Hub.*HF_TOKEN"):
        server.load_model("gated_first")
    assert client.generate(server.http_url, FIRST, "Hi", max_tokens=2).text.startswith("Hi")
