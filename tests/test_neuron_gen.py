"""Unit tests of labkit.neuron (compiler, generator) that need no server and no Neuron SDK.
The LLM on vLLM with the Neuron plugin is tested in test_neuron_vllm.py."""

from __future__ import annotations

import json
import logging
import py_compile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import add_sub
from labkit import hardware
from labkit.cli import neuron as neuron_cli
from labkit.errors import ConfigError, MissingDependencyError, ToolError
from labkit.neuron import compiler as neuron
from labkit.neuron.gen import (
    TEMPLATE_DIR,
    TEMPLATES,
    GenOptions,
    TensorSpec,
    assign_cores,
    generate_model,
    signature_specs,
)

IO = {
    "inputs": [TensorSpec.parse("INPUT__0,INT64,4"), TensorSpec.parse("INPUT__1,INT64,4")],
    "outputs": [TensorSpec.parse("OUTPUT__0,INT64,4"), TensorSpec.parse("OUTPUT__1,INT64,4")],
}


def read_config(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def cli(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    neuron_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["neuron", *argv])
    return args.handler(args)


# -- tensor specs and cores ---------------------------------------------------------------------
def test_tensor_spec_reads_name_type_and_x_separated_shape():
    assert TensorSpec.parse("INPUT__0,INT64,4x384") == TensorSpec("INPUT__0", "INT64", (4, 384))
    assert TensorSpec.parse("x__1,TYPE_FP16,-1x4").dims == (-1, 4)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("INPUT__0,INT64", "NAME,DATATYPE,SHAPE"),
        ("INPUT__0,INT65,4", "not a Triton type"),
        ("INPUT__0,INT64,4,384", "NAME,DATATYPE,SHAPE"),
        ("INPUT__0,INT64,4*384", "integers separated by x"),
        ("INPUT__0,INT64,0x4", "0 or below -1"),
    ],
)
def test_tensor_spec_errors_name_the_value_and_the_form(text, match):
    with pytest.raises(ConfigError, match=match):
        TensorSpec.parse(text)


def test_cores_split_equally_and_leftover_cores_are_reported():
    even = assign_cores(0, 7, 4)
    assert [even.visible_cores(i) for i in range(4)] == ["0-1", "2-3", "4-5", "6-7"]
    assert even.unused == ()
    odd = assign_cores(0, 7, 3)
    assert [odd.visible_cores(i) for i in range(3)] == ["0-1", "2-3", "4-5"]
    assert odd.unused == (6, 7)
    assert assign_cores(0, 0, 1).visible_cores(0) == "0"
    with pytest.raises(ConfigError, match="cannot give 3 model instances"):
        assign_cores(0, 1, 3)


# -- config.pbtxt from every option --------------------------------------------------------------
def test_every_option_lands_in_the_protobuf_config(tmp_path):
    made = generate_model(
        GenOptions(
            tmp_path / "bert",
            "bert.pt",
            "2:5",
            target="inf2",
            triton_model_instance_count=2,
            threads_per_core=3,
            enable_dynamic_batching=True,
            max_batch_size=16,
            preferred_batch_size=[4, 8],
            max_queue_delay_microseconds=100,
            disable_batch_requests_to_neuron=True,
            model_version=4,
            **IO,
        )
    )
    config = read_config(tmp_path / "bert")
    assert config.name == "bert" and config.backend == "python" and config.max_batch_size == 16
    assert [(i.name, mc.DataType.Name(i.data_type), list(i.dims)) for i in config.input] == [
        ("INPUT__0", "TYPE_INT64", [4]),
        ("INPUT__1", "TYPE_INT64", [4]),
    ]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert config.instance_group[0].count == 2
    assert list(config.version_policy.specific.versions) == [4]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params == {
        "TARGET": "inf2",
        "MODEL_TYPE": "pytorch",
        "COMPILED_MODEL": "bert.pt",
        "NEURON_CORE_START_INDEX": "2",
        "NEURON_CORE_END_INDEX": "5",
        "NUM_THREADS_PER_CORE": "3",
        "BATCH_REQUESTS_TO_NEURON": "false",
    }
    assert (tmp_path / "bert" / "4" / "model.py").is_file()  # upstream always wrote 1/model.py
    assert not (tmp_path / "bert" / "1").exists()
    assert [made.cores.visible_cores(i) for i in range(2)] == ["2-3", "4-5"]


def test_unused_cores_give_a_loud_warning_that_names_them(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="labkit.neuron.gen"):
        made = generate_model(
            GenOptions(
                tmp_path / "m", "m.pt", "0:7", target="cpu", triton_model_instance_count=3, **IO
            )
        )
    assert "UNUSED NEURON CORES" in made.warnings[0] and "(6, 7)" in made.warnings[0]
    assert "0:7" in made.warnings[0]
    assert "UNUSED NEURON CORES" in caplog.text


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"enable_dynamic_batching": True}, "needs --max_batch_size >= 1"),
        (
            {"enable_dynamic_batching": True, "max_batch_size": 4, "preferred_batch_size": [8]},
            "between 1 and --max_batch_size 4",
        ),
        ({"neuron_core_range": "3:1"}, "end must be >= the start"),
        ({"neuron_core_range": "0-3"}, "not <start>:<end>"),
        ({"threads_per_core": 0}, "threads_per_core must be >= 1"),
        ({"model_version": 0}, "model_version must be >= 1"),
        ({"target": "inf3"}, "not one of inf1, inf2, trn1, cpu"),
        ({"model_type": "tensorflow", "target": "cpu"}, "cpu target serves TorchScript only"),
        ({"inputs": [TensorSpec("INPUT0", "INT64", (4,))]}, "does not follow <name>__<index>"),
        (
            {"inputs": [TensorSpec("IN__0", "INT64", (4,)), TensorSpec("IN__2", "INT64", (4,))]},
            r"indices \[0, 2\] must be 0..1",
        ),
        ({"outputs": [TensorSpec("OUT__0", "STRING", (1,))]}, "cannot take or return STRING"),
        ({"triton_model_instance_count": 0}, "must be >= 1"),
    ],
)
def test_generator_errors_say_what_and_how_to_fix(tmp_path, change, match):
    opts = GenOptions(tmp_path / "m", "m.pt", **{"neuron_core_range": "0:3", **IO, **change})
    with pytest.raises(ConfigError, match=match):
        generate_model(opts)


def test_batching_options_without_dynamic_batching_are_reported_as_ignored(tmp_path):
    made = generate_model(
        GenOptions(tmp_path / "m", "m.pt", "0:0", max_queue_delay_microseconds=5, **IO)
    )
    assert any("--max_queue_delay_microseconds is ignored" in w for w in made.warnings)
    assert not read_config(tmp_path / "m").HasField("dynamic_batching")


def test_enable_dynamic_batching_alone_turns_the_batcher_on(tmp_path):
    generate_model(GenOptions(tmp_path / "m", "m.pt", enable_dynamic_batching=True,
                              max_batch_size=8, **IO))  # fmt: skip
    config = read_config(tmp_path / "m")
    assert config.HasField("dynamic_batching")  # `dynamic_batching { }`, not left out
    assert "dynamic_batching {" in (tmp_path / "m" / "config.pbtxt").read_text()


def test_a_compiled_model_made_elsewhere_is_pending_not_a_warning(tmp_path, caplog):
    elsewhere = generate_model(
        GenOptions(tmp_path / "a", "1/a.inf2.pt", target="inf2", compiled_elsewhere=True, **IO)
    )
    assert elsewhere.pending == "1/a.inf2.pt" and elsewhere.warnings == []
    assert "does not exist yet" not in caplog.text
    missing = generate_model(GenOptions(tmp_path / "b", "1/b.inf2.pt", target="inf2", **IO))
    assert missing.pending == "" and "does not exist yet" in missing.warnings[0]


def test_copy_compiled_model_points_the_config_at_the_copy(tmp_path):
    artifact = tmp_path / "add_sub.pt"
    artifact.write_bytes(b"x")
    generate_model(
        GenOptions(tmp_path / "m", artifact, "0:0", copy_compiled_model=True, model_version=2, **IO)
    )
    assert read_config(tmp_path / "m").parameters["COMPILED_MODEL"].string_value == "2/add_sub.pt"
    assert (tmp_path / "m" / "2" / "add_sub.pt").read_bytes() == b"x"


# -- the command line keeps upstream's spellings ------------------------------------------------
def test_upstream_inf2_command_works_unchanged(tmp_path, capsys):
    out = tmp_path / "bert-large-mlperf-bs1x4"
    code = cli(
        [
            "gen-model",
            "--inf2",
            "--model_type",
            "pytorch",
            "--triton_input",
            "INPUT__0,INT64,4x384",
            "INPUT__1,INT64,4x384",
            "INPUT__2,INT64,4x384",
            "--triton_output",
            "OUTPUT__0,INT64,4x384",
            "OUTPUT__1,INT64,4x384",
            "--compiled_model",
            "bert_large_mlperf_neuron_hack_bs1_dynamic.pt",
            "--neuron_core_range",
            "0:3",
            "--triton_model_dir",
            str(out),
        ]
    )
    assert code == 0
    config = read_config(out)
    assert [i.name for i in config.input] == ["INPUT__0", "INPUT__1", "INPUT__2"]
    assert config.parameters["TARGET"].string_value == "inf2"
    assert "NEURON_RT_VISIBLE_CORES=0-3" in capsys.readouterr().out


def test_repeated_triton_input_flags_and_default_target_inf1(tmp_path):
    cli(
        [
            "gen-model",
            "--triton_input",
            "INPUT__0,INT64,4",
            "--triton_input",
            "INPUT__1,INT64,4",
            "--triton_output",
            "OUTPUT__0,INT64,4",
            "--compiled_model",
            "m.pt",
            "--neuron_core_range",
            "0:0",
            "--triton_model_dir",
            str(tmp_path / "m"),
        ]
    )
    config = read_config(tmp_path / "m")
    assert len(config.input) == 2 and config.parameters["TARGET"].string_value == "inf1"


def test_max_queue_delay_help_says_microseconds(capsys):
    with pytest.raises(SystemExit, match="^0$"):  # --help exits 0
        cli(["gen-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "in microseconds" in text
    assert "(ms)" not in text


# -- hardware detection --------------------------------------------------------------------------
TRN1_NEURON_LS = json.dumps(
    [
        {
            "neuron_device": 0,
            "bdf": "0000:00:1e.0",
            "nc_count": 2,
            "memory_size": 34359738368,
            "neuroncore_ids": [0, 1],
        }
    ]
)


def test_neuron_ls_json_gives_kind_devices_and_cores():
    hw = hardware.parse_neuron_ls(TRN1_NEURON_LS, "trn1.2xlarge")
    assert (hw.kind, hw.devices, hw.cores, hw.target) == ("trn1", 1, 2, "trn1")
    inf1 = hardware.parse_neuron_ls(json.dumps([{"nc_count": 4}] * 4))
    assert (inf1.kind, inf1.cores) == ("inf1", 16)
    with pytest.raises(ToolError, match="not JSON"):
        hardware.parse_neuron_ls("Failed to discover Neuron devices")


def test_detect_counts_dev_neuron_devices_with_a_fake_dev_and_sys_tree(tmp_path):
    (tmp_path / "dev").mkdir()
    for i in range(6):
        (tmp_path / "dev" / f"neuron{i}").touch()
    dmi = tmp_path / "sys" / "devices/virtual/dmi/id"
    dmi.mkdir(parents=True)
    (dmi / "product_name").write_text("inf2.24xlarge\n")
    hw = hardware.detect_neuron(
        neuron_ls=str(tmp_path / "absent"), dev_dir=tmp_path / "dev", sys_dir=tmp_path / "sys"
    )
    assert (hw.kind, hw.devices, hw.cores, hw.source) == ("inf2", 6, 12, "/dev")


def test_detect_reports_none_on_this_kind_of_host(tmp_path):
    hw = hardware.detect_neuron(
        neuron_ls=str(tmp_path / "absent"), dev_dir=tmp_path, sys_dir=tmp_path
    )
    assert (hw.kind, hw.cores, hw.target, hw.present) == ("none", 0, "cpu", False)


# -- compile -------------------------------------------------------------------------------------
def test_cpu_compile_saves_torchscript_and_the_second_call_is_a_cache_hit(tmp_path):
    example = (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64))
    first = neuron.compile(add_sub(), example, "cpu", cache_dir=tmp_path)
    second = neuron.compile(add_sub(), example, "cpu", cache_dir=tmp_path)
    assert (first.cached, second.cached, first.path) == (False, True, second.path)
    loaded = neuron.load(first.path)
    a, b = torch.tensor([[1, 2, 3, 4]] * 3), torch.ones(3, 4, dtype=torch.int64)
    assert [t.tolist() for t in loaded(a, b)] == [[[2, 3, 4, 5]] * 3, [[0, 1, 2, 3]] * 3]
    wider = (torch.zeros(1, 8, dtype=torch.int64),) * 2
    other = neuron.compile(add_sub(), wider, "cpu", cache_dir=tmp_path)
    assert other.key != first.key  # input shapes are part of the key


def test_cache_key_changes_with_weights_target_and_compiler_args():
    lin = torch.nn.Linear(2, 2)
    x = torch.zeros(1, 2)
    base = neuron.cache_key(lin, x, "inf2")
    assert neuron.cache_key(lin, x, "inf2", ["--auto-cast", "none"]) != base
    assert neuron.cache_key(lin, x, "trn1") != base
    with torch.no_grad():
        lin.weight.add_(1)
    assert neuron.cache_key(lin, x, "inf2") != base


def test_neuron_targets_without_the_sdk_say_how_to_install_it(tmp_path):
    x = torch.zeros(1, 2)
    for target, package in (("inf2", "torch-neuronx"), ("inf1", "torch-neuron")):
        with pytest.raises(MissingDependencyError, match=f"{package}.*setup-neuron-host.sh"):
            neuron.compile(torch.nn.Linear(2, 2), x, target, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="not one of"):
        neuron.compile(torch.nn.Linear(2, 2), x, "gpu", cache_dir=tmp_path)


# -- generated code that needs an SDK: what can be checked here ---------------------------------
def test_tensorflow_generation_from_a_fake_signature_without_tensorflow(tmp_path):
    # Fake: TensorFlow is not in the lab's environment (its Neuron path runs on an inf host), so
    # a SavedModel signature's TensorInfo entries are given as plain objects of the same shape.
    def info(dt, *dims):  # a TensorInfo's shape, as a SavedModel signature holds it
        shape = SimpleNamespace(dim=[SimpleNamespace(size=d) for d in dims])
        return SimpleNamespace(dtype=dt, tensor_shape=shape)

    specs = signature_specs(
        [("input_ids", info("int32", -1, 128)), ("mask", info("int32", -1, 128))]
    )
    assert specs[0] == TensorSpec("input_ids", "INT32", (-1, 128))
    with pytest.raises(ConfigError, match="has no Triton type"):
        signature_specs([("x", info("complex64", 1))])
    with pytest.raises(MissingDependencyError, match="pass --triton_input"):
        generate_model(
            GenOptions(tmp_path / "tf", tmp_path / "saved", "0:3", model_type="tensorflow")
        )
    made = generate_model(
        GenOptions(
            tmp_path / "tf",
            "saved",
            "0:3",
            model_type="tensorflow",
            target="inf2",
            inputs=specs,
            outputs=specs[:1],
        )
    )
    params = made.config.parameters
    assert (params["TAG_SET"].string_value, params["SIGNATURE_DEF_KEY"].string_value) == (
        "serve",
        "serving_default",
    )
    py_compile.compile(str(tmp_path / "tf" / "1" / "model.py"), doraise=True)


def test_every_template_compiles_without_the_sdk():
    templates = sorted(TEMPLATE_DIR.glob("*.py"))
    assert {t.name for t in templates} == set(TEMPLATES.values())  # each one gen writes from
    for template in templates:  # compiled in memory: no __pycache__ beside a packaged template
        compile(template.read_text(), str(template), "exec", dont_inherit=True)


def test_the_neuron_docker_command_mounts_each_device_and_publishes_on_loopback(tmp_path):
    import shlex

    from labkit.neuron import walkthrough

    words = shlex.split(
        walkthrough.docker_command("inf2.48xlarge", tmp_path, "tritonserver-neuron")
    )
    assert [w for w in words if w.startswith("--device=")] == [
        f"--device=/dev/neuron{i}" for i in range(12)
    ]
    published = [words[i + 1] for i, w in enumerate(words) if w == "-p"]
    assert published == [f"127.0.0.1:{port}:{port}" for port in (8000, 8001, 8002)]
    assert f"{tmp_path.resolve()}:/models" in words
    assert words[-3:] == ["tritonserver-neuron", "tritonserver", "--model-repository=/models"]
    with pytest.raises(ConfigError, match="unknown instance type 'inf9.xlarge'"):
        walkthrough.docker_command("inf9.xlarge", tmp_path, "tritonserver-neuron")
