"""LoRA in ``smollm2_vllm``: an adapter made offline with peft, served by name.

The fast tests make an adapter for a tiny Llama (seeded: the same files twice; ``B`` is not zero,
so it changes the model by the share it is built for), read the ``lora_adapters`` parameter
(resolved in a run's copy, its rank picked for vLLM, LoRA off when it is empty) and the request's
``lora_name`` (in ``sampling_parameters`` or as a request parameter; an unknown one is refused
naming it and the served ones). The integration tests serve the lab's adapter in a real Triton:
its greedy answers equal the adapter merged into SmolLM2 and run in transformers (float32, the
same prompt and max tokens), differ from the base model's, hold when adapter and base requests
share the engine, and an adapter the model does not serve gets a 400 that names it.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_vllm_model import (
    FIELDS,
    FakeRequest,
    LabReader,
    VLLMClientError,
    grpc_stream,
    openai_frontend_inputs,
)

from conftest import imported_as_triton_does
from labkit import client, repository
from labkit.errors import ConfigError, InferenceError
from labkit.repository import Repository, lora

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model_repository" / "smollm2_vllm"


# -- making an adapter (a tiny Llama, no server) ------------------------------------------------
def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def test_an_adapter_is_seeded_in_peft_format_and_changes_each_target_by_its_strength(tmp_path):
    import torch
    from safetensors.torch import load_file

    spec = lora.AdapterSpec(rank=8, alpha=16, seed=3, strength=0.1)
    first = lora.make_adapter(tiny_llama(), tmp_path / "first", spec)
    again = lora.make_adapter(tiny_llama(), tmp_path / "again", spec)
    saved = json.loads((first / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["lora_alpha"] == 16
    assert sorted(saved["target_modules"]) == ["q_proj", "v_proj"]
    tensors = load_file(first / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    same = load_file(again / "adapter_model.safetensors")
    assert all(torch.equal(tensors[k], same[k]) for k in tensors)  # seeded: the same values
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)  # B is not zero
    base = tiny_llama()
    merged = lora.merge_adapter(tiny_llama(), first)
    for name, weight in base.state_dict().items():
        change = merged.state_dict()[name] - weight
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            assert 0.05 < float(change.std() / weight.std()) < 0.2, name  # strength 0.1
        else:
            assert not change.any(), name


def test_an_adapter_of_an_unknown_builder_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match="unknown LoRA adapter builder 'x'; use one of smollm2"):
        lora.build_adapter("x")


def fake_builder(target: Path) -> None:
    """An adapter folder as peft writes it, without peft (its rank is what matters here)."""
    (target / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (target / "adapter_model.safetensors").write_bytes(b"")


def test_serve_adapters_names_them_in_the_config_and_a_run_copy_resolves_them(
    tmp_path, monkeypatch, settings_module
):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    builder = repository.models.Builder("fake", "fake-v1", fake_builder, "a fake adapter")
    monkeypatch.setitem(lora.ADAPTER_BUILDERS, "fake", builder)
    source = Repository(tmp_path / "source", create=True)
    (source.path / "smollm2_vllm").mkdir()
    source.write_config("smollm2_vllm", repository.read_config(MODEL / "config.pbtxt"))
    built = lora.serve_adapters(source, "smollm2_vllm", {"demo": "fake"})
    assert built == {"demo": tmp_path / "cache" / "adapters" / "fake-v1"}
    lora.serve_adapters(source, "smollm2_vllm", {"demo": "fake"})  # again: nothing changes
    copy = source.copy_to(tmp_path / "run" / "model_repository")  # as a run's copy is made
    params = {k: v.string_value for k, v in copy.config("smollm2_vllm").parameters.items()}
    assert json.loads(params["lora_adapters"]) == {"demo": "adapters/demo"}
    options = settings_module.read_engine_options(params)
    (adapter,) = settings_module.read_adapters(options, copy.model_dir("smollm2_vllm"))
    assert (adapter.name, adapter.rank) == ("demo", 8)
    assert Path(adapter.path) == built["demo"].resolve()
    arguments = settings_module.engine_arguments(options, "/w", [adapter])
    # one LoRA slot more than the adapters: vLLM's CPU ops read a base request's from the last
    assert (arguments["enable_lora"], arguments["max_loras"], arguments["max_lora_rank"]) == (
        True,
        2,
        8,
    )
    with pytest.raises(ConfigError, match="holds no model 'nope'"):
        lora.serve_adapters(source, "nope")


# -- the lora_adapters parameter (no server) ----------------------------------------------------
@pytest.fixture(scope="module")
def settings_module():
    with imported_as_triton_does(MODEL / "1", "vllm_settings") as module:
        yield module


def test_the_shipped_config_serves_no_adapter_so_lora_stays_off(settings_module):
    config = repository.read_config(MODEL / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    options = settings_module.read_engine_options(params)
    assert settings_module.read_adapters(options, MODEL) == []
    assert not {"enable_lora", "max_loras", "max_lora_rank"} & set(
        settings_module.engine_arguments(options, "/w")
    )


def test_an_adapters_rank_picks_the_smallest_max_lora_rank_vllm_takes(settings_module, tmp_path):
    for name, rank, pattern in (("small", 4, {}), ("mixed", 8, {"q_proj": 12})):
        (tmp_path / name).mkdir()
        config = {"r": rank, "rank_pattern": pattern}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
    options = settings_module.read_engine_options(
        {"lora_adapters": json.dumps({"a": "small", "b": str(tmp_path / "mixed")})}
    )
    adapters = settings_module.read_adapters(options, tmp_path)  # relative: the model's folder
    assert [(a.name, a.rank) for a in adapters] == [("a", 4), ("b", 12)]
    arguments = settings_module.engine_arguments(options, "/w", adapters)
    assert (arguments["max_loras"], arguments["max_lora_rank"]) == (3, 16)
    assert settings_module.lora_rank(1) == 1 and settings_module.lora_rank(320) == 320
    with pytest.raises(ValueError, match="rank 600 is above the largest vLLM serves"):
        settings_module.lora_rank(600)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("[1]", "'lora_adapters' must be a JSON object of adapter names and folders"),
        ("{}", "'lora_adapters' must be a JSON object"),
        ('{"demo": 3}', "adapter 'demo' -> 3 needs a name and a folder"),
        ('{" ": "adapters/x"}', "needs a name and a folder"),
    ],
)
def test_a_malformed_lora_adapters_parameter_is_refused_naming_it(settings_module, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        settings_module.read_engine_options({"lora_adapters": value})


def test_an_adapter_folder_without_peft_files_is_refused_naming_the_adapter(
    settings_module, tmp_path
):
    options = settings_module.read_engine_options({"lora_adapters": '{"demo": "adapters/demo"}'})
    with pytest.raises(ValueError, match=r"adapter 'demo' is '.*adapters/demo', which holds no"):
        settings_module.read_adapters(options, tmp_path)


# -- the request's lora_name (no server) --------------------------------------------------------
@pytest.fixture(scope="module")
def contract_module():
    with imported_as_triton_does(MODEL / "1", "contract") as module:
        yield module


def reader(contract_module, adapters: list[str]):
    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]
    return contract_module.ContractReader(
        LabReader(protocol),
        FIELDS,
        lambda fields: SimpleNamespace(**fields),
        64,
        (VLLMClientError,),
        adapters,
    ), protocol


def sampling(values: dict):
    import numpy as np

    return np.array([json.dumps(values).encode()], dtype=object)


def test_a_request_names_its_adapter_in_sampling_parameters_or_as_a_parameter(contract_module):
    read, _ = reader(contract_module, ["demo", "other"])
    assert read.read(FakeRequest()).lora_name is None  # the base model
    asked = read.read(FakeRequest(sampling_parameters=sampling({"lora_name": "demo", "n": 1})))
    assert asked.lora_name == "demo" and asked.params.n == 1  # not a SamplingParams field
    assert read.read(FakeRequest({"lora_name": "other", "max_tokens": 4})).lora_name == "other"
    both = FakeRequest({"lora_name": "other"}, sampling_parameters=sampling({"lora_name": "demo"}))
    assert read.read(both).lora_name == "demo"  # sampling_parameters win, as for every field


@pytest.mark.parametrize(
    ("adapters", "request_", "words"),
    [
        (
            ["demo"],
            FakeRequest(sampling_parameters=sampling({"lora_name": "pirate"})),
            "unknown LoRA adapter 'pirate': this model serves the LoRA adapter(s) 'demo'",
        ),
        (
            ["demo", "b"],
            FakeRequest({"lora_name": "DEMO"}),
            "unknown LoRA adapter 'DEMO': this model serves the LoRA adapter(s) 'demo', 'b'",
        ),
        (
            [],
            FakeRequest({"lora_name": "demo"}),
            "unknown LoRA adapter 'demo': this model serves no LoRA adapter (its config.pbtxt "
            "names none in parameter 'lora_adapters')",
        ),
        (
            ["demo"],
            FakeRequest(sampling_parameters=sampling({"lora_name": 1})),
            "'lora_name' must be a string naming a LoRA adapter, got 1",
        ),
    ],
)
def test_an_adapter_the_model_does_not_serve_is_refused_naming_it_and_the_served_ones(
    contract_module, adapters, request_, words
):
    read, protocol = reader(contract_module, adapters)
    with pytest.raises(protocol.RequestError, match=re.escape(words)):
        read.read(request_)


# -- against a real Triton -----------------------------------------------------------------------
PROMPTS = ["I am going", "Where is the nearest", "Once upon a time there was", "The cat"]
MAX_TOKENS = 16  # the config's default: what both sides generate


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_module_server):
    """smollm2_vllm serving the lab's adapter as ``demo``, in a run's copy."""
    repo = repository.prepare_run_repository(tmp_path_factory.mktemp("lora"), ["smollm2_vllm"])
    folders = lora.serve_adapters(repo, "smollm2_vllm")  # built once into the cache
    # Eager: LoRA layers change vLLM's compile-cache key, which make install warms only for the
    # shipped settings; compiled, this server would compile from nothing (minutes on 2 cores).
    repo.edit("smollm2_vllm", parameters={"enforce_eager": "true"})
    server = start_module_server(repo.path, load_models=["smollm2_vllm"], startup_timeout_s=900)
    return SimpleNamespace(server=server, adapter=folders["demo"], repo=repo)


@pytest.fixture(scope="module")
def reference(served) -> dict[str, dict[str, str]]:
    """Greedy answers of transformers in float32: the base checkpoint, then the adapter merged
    into its weights (peft's merge_and_unload), as the lab's smollm2 writes them (prompt first)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = served.repo.model_dir("smollm2_vllm") / "weights"
    tokenizer = AutoTokenizer.from_pretrained(weights)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()

    def answers() -> dict[str, str]:
        out = {}
        for prompt in PROMPTS:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                new = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
            head = tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=True)
            whole = tokenizer.decode(new, skip_special_tokens=True)
            out[prompt] = prompt + whole[len(head) :]
        return out

    base = answers()
    model = lora.merge_adapter(model, served.adapter)
    return {"base": base, "demo": answers()}


@pytest.mark.integration
@pytest.mark.slow
def test_the_adapters_greedy_answers_equal_it_merged_in_transformers_and_differ_from_the_base(
    served, reference
):
    url = served.server.http_url
    adapted = {p: client.generate(url, "smollm2_vllm", p, lora_name="demo").text for p in PROMPTS}
    base = {p: client.generate(url, "smollm2_vllm", p).text for p in PROMPTS}
    print("adapter:", json.dumps(adapted, indent=1), "base:", json.dumps(base, indent=1))
    assert adapted == reference["demo"]
    assert base == reference["base"]
    assert all(adapted[p] != base[p] for p in PROMPTS), (adapted, base)


@pytest.mark.integration
@pytest.mark.slow
def test_adapter_and_base_requests_sharing_the_engine_each_get_their_own_answer(served, reference):
    url = served.server.http_url
    asks = [(p, name) for p in PROMPTS for name in ("demo", None)]

    def ask(item):
        prompt, name = item
        params = {"lora_name": name} if name else {}
        return client.generate(url, "smollm2_vllm", prompt, **params).text

    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(ask, asks))
    assert answers == [reference[name or "base"][p] for p, name in asks]


@pytest.mark.integration
@pytest.mark.slow
def test_the_openai_frontends_lora_name_in_sampling_parameters_picks_the_adapter(served, reference):
    # Triton's OpenAI frontend (--lora-separator) sends the adapter as lora_name in
    # sampling_parameters; echo=True keeps the prompt in the answer, as the reference has it
    prompt = PROMPTS[0]
    fields = {"temperature": 0, "max_tokens": MAX_TOKENS, "lora_name": "demo"}
    (result,) = grpc_stream(served.server, openai_frontend_inputs(prompt, fields, False, True))
    assert result.as_numpy("text_output")[0].decode() == reference["demo"][prompt]


@pytest.mark.integration
def test_an_adapter_the_model_does_not_serve_gets_a_400_naming_it_and_the_served_one(served):
    url = served.server.http_url
    words = "unknown LoRA adapter 'pirate': this model serves the LoRA adapter(s) 'demo'"
    as_parameter = {"lora_name": "pirate"}
    as_field = {"sampling_parameters": json.dumps({"lora_name": "pirate"})}
    for params in (as_parameter, as_field):
        with pytest.raises(InferenceError, match=re.escape(words)) as refused:
            client.generate(url, "smollm2_vllm", "Hi", **params)
        assert refused.value.status == 400 and words in refused.value.server_message, params
