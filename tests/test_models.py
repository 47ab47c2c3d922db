"""Offline model builders, the catalog, add_model, and the model code's pure logic (no server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import imported_as_triton_does
from labkit import capacity, repository
from labkit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "labkit" / "templates" / "textgen"


@pytest.fixture(scope="module")
def loading():
    """The template's loading.py (where the weights come from), imported as Triton does."""
    with imported_as_triton_does(TEMPLATE, "loading") as module:
        yield module


@pytest.fixture(scope="module")
def protocol():
    """The template's protocol.py (config, requests, responses), with the server's utils."""
    with imported_as_triton_does(TEMPLATE, "protocol") as module:
        yield module


def test_committed_config_names_no_machine_specific_path():
    config = repository.read_config(ROOT / "model_repository" / "smollm2" / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["huggingface_model"] == "weights"
    assert params["labkit_weights"] == "smollm2"
    text = (ROOT / "model_repository" / "smollm2" / "config.pbtxt").read_text()
    assert str(Path.home()) not in text and "/root" not in text


def test_add_model_writes_a_config_that_protobuf_reads_back(tmp_path):
    folder = repository.add_model(
        tmp_path,
        "falcon7b",
        name="falcon",
        max_batch_size=8,
        dynamic_batching=True,
        max_queue_delay_microseconds=500,
        kind="KIND_GPU",
        instance_count=2,
        max_tokens=32,
    )
    config = repository.read_config(folder / "config.pbtxt")
    assert config.name == "falcon" and config.backend == "python"
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.instance_group[0].count == 2
    assert config.parameters["huggingface_model"].string_value == "tiiuae/falcon-7b"
    assert config.parameters["max_tokens"].string_value == "32"
    assert [i.name for i in config.input] == ["text_input"]
    assert [o.name for o in config.output] == ["text_output"]
    code = {p.name: p.read_bytes() for p in (folder / "1").glob("*.py")}
    assert code == {p.name: p.read_bytes() for p in TEMPLATE.glob("*.py")}


def test_gated_catalog_model_is_marked_gated_in_its_config(tmp_path):
    config = repository.read_config(repository.add_model(tmp_path, "llama7b") / "config.pbtxt")
    assert config.parameters["gated"].string_value == "true"
    assert config.parameters["huggingface_model"].string_value == "meta-llama/Llama-2-7b-hf"


def test_add_model_refuses_an_existing_folder_and_unknown_names(tmp_path):
    repository.add_model(tmp_path, "opt125m")
    with pytest.raises(ConfigError, match="already exists.*overwrite=True"):
        repository.add_model(tmp_path, "opt125m")
    with pytest.raises(ConfigError, match="unknown catalog model 'gpt5'.*falcon7b"):
        repository.add_model(tmp_path, "gpt5")
    with pytest.raises(ConfigError, match="dynamic batching needs max_batch_size"):
        repository.add_model(tmp_path, "opt125m", name="x", dynamic_batching=True)


def test_catalog_holds_the_tutorial_models_and_memory_estimates():
    names = {e.name for e in repository.catalog()}
    assert {"falcon7b", "persimmon8b", "llama7b", "opt125m", "smollm2", "tiny-falcon"} <= names
    falcon = capacity.estimate("falcon7b", device="gpu", repository=Path("/nonexistent"))
    assert falcon.weights_bytes == int(6.92e9 * 2)  # the catalog's 6.92 B parameters in float16


@pytest.mark.integration
def test_prepare_repository_links_built_weights_and_is_cheap_when_done(tmp_path):
    repository.add_model(tmp_path, "tiny-falcon", name="tf")
    repository.add_model(tmp_path, "opt125m")  # a hub model: nothing to build
    (link,) = repository.prepare_repository(tmp_path)
    assert link == tmp_path / "tf" / "weights" and link.is_symlink()
    assert (link / "config.json").is_file() and (link / repository.models.MARKER).is_file()
    assert not (tmp_path / "opt125m" / "weights").exists()
    checkpoint, target = link.resolve(), os.readlink(link)
    files = {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")}
    # Cheap means it reads configs and markers and builds nothing: in a fresh process, no model
    # library is even imported, and the checkpoint is left as it was.
    code = (
        "import sys\nfrom labkit.repository import prepare_repository\n"
        "print([str(p) for p in prepare_repository(sys.argv[1])])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    again = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [str([str(link)]), "[]"]
    assert os.readlink(link) == target
    assert {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")} == files


@pytest.mark.integration
def test_two_processes_building_at_once_get_one_complete_checkpoint(tmp_path):
    env = {**os.environ, "LABKIT_CACHE": str(tmp_path)}
    code = "from labkit.repository import build_weights; print(build_weights('tiny-falcon'))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert paths == {str(tmp_path / "models" / "tiny-falcon-v1")}
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == ["tiny-falcon-v1"]


def test_gated_model_without_a_token_names_hf_token(loading):
    with pytest.raises(loading.TokenError, match="HF_TOKEN.*PRIVATE_REPO_TOKEN"):
        loading.require_token("meta-llama/Llama-2-7b-hf", True, {})
    assert loading.require_token("facebook/opt-125m", False, {}) is None


def test_token_comes_from_hf_token_first_then_the_tutorial_alias(loading):
    assert loading.hub_token({"PRIVATE_REPO_TOKEN": "p"}) == ("PRIVATE_REPO_TOKEN", "p")
    assert loading.hub_token({"PRIVATE_REPO_TOKEN": "p", "HF_TOKEN": "h"}) == ("HF_TOKEN", "h")
    assert loading.hub_token({"HF_TOKEN": "  "}) == (None, None)
    assert loading.require_token("meta-llama/Llama-2-7b-hf", True, {"HF_TOKEN": "h"}) == "h"


def test_refused_token_message_never_shows_the_token(loading):
    error = OSError("401 Client Error for url https://huggingface.co/x?token=hf_secret123")
    message = loading.explain_load_error("x/y", error, {"HF_TOKEN": "hf_secret123"})
    assert "hf_secret123" not in message and "HF_TOKEN was refused" in message
    gated = OSError("You are trying to access a gated repo. 401 Client Error")
    assert "export HF_TOKEN" in loading.explain_load_error("x/y", gated, {})


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"max_tokens": -1}, "'max_tokens' must be >= 1"),
        ({"max_tokens": 2.5}, "'max_tokens' must be an integer"),
        ({"max_tokens": True}, "'max_tokens' must be an integer"),
        ({"temperature": -0.1}, "'temperature' must be >= 0"),
        ({"temperature": "hot"}, "'temperature' must be a number"),
        ({"top_p": 1.5}, r"'top_p' must be in \(0, 1\]"),
        ({"top_k": -3}, "'top_k' must be >= 0"),
    ],
)
def test_bad_generation_parameters_are_named(protocol, values, match):
    with pytest.raises(protocol.RequestError, match=match):
        protocol.parse_settings(values, protocol.Settings())


def test_config_defaults_are_parsed_from_strings_and_sampling_follows_temperature(protocol):
    defaults = protocol.parse_settings(
        {"max_tokens": "32", "temperature": "0.7", "top_p": "0.9"},
        protocol.Settings(),
        from_config=True,
    )
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p) == (32, 0.7, 0.9)
    assert defaults.do_sample and not protocol.Settings().do_sample


def test_weights_path_resolves_relative_to_the_model_folder(loading, tmp_path):
    (tmp_path / "weights").mkdir()
    assert loading.resolve_source("weights", tmp_path) == (str(tmp_path / "weights"), True)
    assert loading.resolve_source("tiiuae/falcon-7b", tmp_path) == ("tiiuae/falcon-7b", False)
    with pytest.raises(loading.ConfigError, match="does not exist.*labkit prepare"):
        loading.resolve_source("./missing", tmp_path)


@pytest.mark.integration
@pytest.mark.slow
def test_the_converted_smollm2_checkpoint_claims_no_gguf_quantization():
    """The float32 checkpoint made from the GGUF file is plain weights: its config.json keeps no
    ``quantization_config`` (vLLM refused the folder for it: "Unknown quantization method: gguf")."""
    folder = repository.build_weights("smollm2")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config


def test_requests_that_differ_only_in_max_tokens_share_one_generate_group(protocol):
    """Dynamic batching's fair baseline: a batch is generated to its longest max_tokens and each
    answer cut at its own, so mixed lengths still batch; other settings still split groups."""

    def prompts(max_tokens: int, temperature: float = 0.0):
        settings = protocol.Settings(max_tokens=max_tokens, temperature=temperature)
        return protocol.Prompts(shape=(1,), texts=["Hi"], ids=[[1]], settings=settings,
                                full_text=False)  # fmt: skip

    requests = [prompts(4), prompts(9), prompts(6, temperature=0.7), prompts(2)]
    groups = protocol.group_by_settings(requests, lambda r: r, lambda i, m: None)
    by_members = {tuple(m.index for m in members): s for s, members in groups.items()}
    assert set(by_members) == {(0, 1, 3), (2,)}
    assert by_members[(0, 1, 3)].max_tokens == 9 and not by_members[(0, 1, 3)].do_sample
    assert by_members[(2,)] == protocol.Settings(max_tokens=6, temperature=0.7)


# -- torch threads: each instance's share of the cores -----------------------------------------
@pytest.fixture
def engine_settings():
    """The template's engine_settings.py (the thread budget), imported as Triton does."""
    with imported_as_triton_does(TEMPLATE, "engine_settings") as module:
        yield module


@pytest.mark.parametrize(
    ("cores", "instances", "servers", "threads"),
    [
        (2, 1, None, 2),  # one server, one instance: every core (labkit bench threads)
        (2, 2, None, 1),  # instance_group { count: 2 }: one thread each
        (2, 1, "2", 1),  # two replicas on the host: one thread each, like two instances
        (2, 3, None, 1),  # more instances than cores: never 0
        (1, 1, None, 1),  # a single core: one thread
        (8, 1, None, 8),
        (8, 2, None, 4),
        (16, 2, "2", 4),
        (8, 1, "not a number", 8),
    ],
)
def test_each_instance_gets_its_share_of_the_cores(
    engine_settings, monkeypatch, cores, instances, servers, threads
):
    monkeypatch.setattr(engine_settings, "usable_cores", lambda: cores)
    if servers is None:
        monkeypatch.delenv(engine_settings.SERVERS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(engine_settings.SERVERS_VARIABLE, servers)
    assert engine_settings.thread_budget(instances) == threads


@pytest.mark.parametrize(
    ("cores", "instances", "servers", "threads"),
    [(2, 1, 1, 1), (8, 1, 1, 7), (8, 2, 1, 3), (16, 2, 2, 3), (1, 1, 1, 1)],
)
def test_the_inflight_engine_leaves_a_core_for_its_own_threads(
    engine_settings, monkeypatch, cores, instances, servers, threads
):
    monkeypatch.setattr(engine_settings, "usable_cores", lambda: cores)
    assert engine_settings.thread_budget(instances, servers, inflight=True) == threads
    assert engine_settings.thread_budget(instances, servers) == max(
        1, cores // (instances * servers)
    )


def test_the_instance_count_is_read_from_the_served_config(engine_settings):
    assert engine_settings.instance_count({}) == 1
    assert (
        engine_settings.instance_count({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}) == 2
    )
    two_gpus = {"instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}]}
    assert engine_settings.instance_count(two_gpus) == 4
    mixed = {"instance_group": [{"count": 1, "kind": "KIND_CPU"}, {"count": 3}]}
    assert engine_settings.instance_count(mixed) == 4


def test_num_threads_is_read_from_the_config_and_zero_means_the_share(protocol):
    def options(**params):
        config = {"name": "m", "parameters": {"huggingface_model": {"string_value": "w"}}}
        for key, value in params.items():
            config["parameters"][key] = {"string_value": value}
        return protocol.read_options(config)

    assert options().num_threads == 0
    assert options(num_threads="3").num_threads == 3
    with pytest.raises(protocol.ConfigError, match="'num_threads' must be >= 0"):
        options(num_threads="-1")


@pytest.mark.parametrize(
    ("template", "module", "function"),
    [("embedding", "model", "thread_budget"), ("neuron", "pytorch_model", "host_share")],
)
def test_the_other_torch_templates_share_the_cores_the_same_way(
    monkeypatch, template, module, function
):
    """The embedding and Neuron (TARGET cpu) templates are self-contained files: each carries
    the same rule as the text model's engine_settings.thread_budget."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    with imported_as_triton_does(ROOT / "labkit" / "templates" / template, module) as code:
        share = getattr(code, function)
        two = (
            {"instance_group": [{"count": 2, "kind": "KIND_CPU"}]} if template == "embedding" else 2
        )
        monkeypatch.delenv(code.SERVERS_VARIABLE, raising=False)
        assert share(two) == 4  # 8 cores, for two instances
        monkeypatch.setenv(code.SERVERS_VARIABLE, "2")
        assert share(two) == 2  # 8 cores for two servers of two instances
        monkeypatch.setenv(code.SERVERS_VARIABLE, "8")
        assert share(two) == 1
