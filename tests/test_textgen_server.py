"""The text-generation model served by a real Triton: same text as in-process, batching, errors.

One module-scoped server holds four models: ``tf0`` (tiny Falcon, ``max_batch_size: 0``),
``tfb`` (tiny Falcon, dynamic batching), ``tfb_join`` (the same with max_batch_size 8 and a long
queue delay, so that eight requests released together are certain to run as one batch) and
``smollm2`` (the committed folder, the real LLM).
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

from conftest import JOIN_DELAY_MICROSECONDS, sent_together
from labkit import client, repository
from labkit.errors import InferenceError, ServerError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "I am going",
    "Where is the nearest",
    "The quick brown fox jumps over the lazy dog because",
    "Hi",
    "Once upon a time there was",
    "Triton serves models",
    "Numbers: 1 2 3",
    "What is the capital of France? It is",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repo = tmp_path_factory.mktemp("repo")
    repository.add_model(repo, "tiny-falcon", name="tf0", max_tokens=12)
    repository.add_model(
        repo,
        "tiny-falcon",
        name="tfb",
        max_tokens=12,
        max_batch_size=8,
        dynamic_batching=True,
        max_queue_delay_microseconds=100_000,
    )
    repository.add_model(
        repo,
        "tiny-falcon",
        name="tfb_join",
        max_tokens=12,
        max_batch_size=len(PROMPTS),
        dynamic_batching=True,
        max_queue_delay_microseconds=JOIN_DELAY_MICROSECONDS,
    )
    repository.add_model(repo, "llama7b")  # gated: loaded by a test, never at start
    shutil.copytree(
        ROOT / "model_repository" / "smollm2",
        repo / "smollm2",
        symlinks=True,
        ignore=shutil.ignore_patterns("weights", "__pycache__"),
    )
    repository.prepare_repository(repo)
    return start_module_server(repo, load_models=["tf0", "tfb", "tfb_join", "smollm2"])


@pytest.fixture(scope="module")
def reference():
    """``reference(model_dir_name, prompt, max_tokens)``: plain transformers, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {}

    def generate(builder: str, prompt: str, max_tokens: int) -> str:
        if builder not in loaded:
            path = repository.build_weights(builder)
            loaded[builder] = (
                AutoTokenizer.from_pretrained(path),
                AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            )
        tokenizer, model = loaded[builder]
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        return tokenizer.decode(out[0], skip_special_tokens=True)

    return generate


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["tf0", "tfb"])
def test_infer_returns_what_transformers_generates_in_process(server, reference, model, protocol):
    (text,) = client.infer(
        server.http_url if protocol == "http" else server.grpc_url,
        model,
        "Where is the nearest",
        protocol,
    )
    assert text == reference("tiny-falcon", "Where is the nearest", 12)


def test_generate_endpoint_returns_the_same_text_with_request_max_tokens(server, reference):
    for model in ("tf0", "tfb"):
        answer = client.generate(server.http_url, model, "I am going", max_tokens=5)
        assert answer.text == reference("tiny-falcon", "I am going", 5)
        assert answer.raw["model_name"] == model


def test_smollm2_default_model_answers_i_am_going_like_transformers(server, reference):
    answer = client.generate(server.http_url, "smollm2", "I am going")
    assert answer.text == reference("smollm2", "I am going", 16)
    assert answer.text.startswith("I am going to")


def test_tutorial_curl_shapes_work_with_and_without_batching(server):
    for model, shape in (("tf0", [1]), ("tfb", [1, 1])):
        status, body = post(
            server,
            f"/v2/models/{model}/infer",
            {
                "inputs": [
                    {
                        "name": "text_input",
                        "datatype": "BYTES",
                        "shape": shape,
                        "data": ["I am going"],
                    }
                ]
            },
        )
        assert status == 200, body
        assert body["outputs"][0]["name"] == "text_output"
        assert body["outputs"][0]["shape"] == shape


@pytest.mark.parametrize("model", ["tf0", "tfb"])
def test_one_request_with_n_prompts_gets_n_answers_in_order(server, reference, model):
    answers = client.infer(server.http_url, model, PROMPTS[:4], max_tokens=6)
    assert answers == [reference("tiny-falcon", p, 6) for p in PROMPTS[:4]]


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, reference):
    def one(prompt):
        return client.infer(server.http_url, "tfb_join", prompt, batched=True)[0]

    answers, counts = sent_together(server, "tfb_join", one, PROMPTS)
    assert answers == [reference("tiny-falcon", p, 12) for p in PROMPTS]
    assert counts["inference_count"] == len(PROMPTS)
    assert counts["execution_count"] == 1, f"not one batch: {counts}"


def test_requests_with_different_settings_in_one_batch_keep_their_own_settings(server, reference):
    jobs = [(p, 3 + i % 2) for i, p in enumerate(PROMPTS)]

    def one(job):
        prompt, max_tokens = job
        return client.infer(
            server.http_url, "tfb_join", prompt, batched=True, max_tokens=max_tokens
        )[0]

    answers, counts = sent_together(server, "tfb_join", one, jobs)
    assert counts["execution_count"] == 1, f"not one batch: {counts}"
    assert answers == [reference("tiny-falcon", p, n) for p, n in jobs]


def test_sampling_with_a_seed_is_repeatable(server):
    runs = [
        client.generate(
            server.http_url,
            "tf0",
            "Hi",
            temperature=0.9,
            top_p=0.95,
            top_k=50,
            seed=7,
            max_tokens=8,
        ).text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("prompt", "params", "named"),
    [
        ("   ", {}, "empty or only whitespace"),
        ("", {}, "empty or only whitespace"),
        ("word " * 300, {}, "exceeds the model's context of 256 tokens"),
        ("Hi", {"max_tokens": -2}, "'max_tokens' must be >= 1"),
        ("Hi", {"max_tokens": "ten"}, "'max_tokens' must be an integer"),
        ("Hi", {"temperature": -1.0}, "'temperature' must be >= 0"),
        ("Hi", {"top_p": 1.5}, "'top_p' must be in"),
        ("Hi", {"maxtokens": 3}, "unknown parameter(s) 'maxtokens'"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_problem_and_serving_goes_on(
    server, prompt, params, named
):
    with pytest.raises(InferenceError, match=re.escape(named)) as info:
        client.generate(server.http_url, "tfb", prompt, **params)
    assert info.value.status == 400 and named in str(info.value)
    assert client.generate(server.http_url, "tfb", "Hi", max_tokens=2).text.startswith("Hi")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_invalid_utf8_is_refused_naming_utf8(server, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    with pytest.raises(InferenceError, match="not valid UTF-8"):
        client.infer(url, "tf0", [b"ok", b"caf\xe9 \xff"], protocol)
    assert client.infer(url, "tf0", "Hi", protocol, max_tokens=2)[0].startswith("Hi")


@pytest.mark.parametrize(
    ("inputs", "named"),
    [
        ([{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}], "'prompt'"),
        ([{"name": "text_input", "datatype": "INT32", "shape": [1], "data": [1]}], "INT32"),
        (
            [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Hi"]}],
            "unexpected shape",
        ),
    ],
)
def test_triton_refuses_wrong_names_types_and_shapes_with_400(server, inputs, named):
    status, body = post(server, "/v2/models/tf0/infer", {"inputs": inputs})
    assert status == 400 and named in body["error"]
    assert client.infer(server.http_url, "tf0", "Hi", max_tokens=2)[0].startswith("Hi")


def test_gated_model_without_a_token_fails_to_load_naming_hf_token(server):
    with pytest.raises(ServerError, match="HF_TOKEN"):
        server.load_model("llama7b")
    assert client.infer(server.http_url, "tf0", "Hi", max_tokens=2)[0].startswith("Hi")
