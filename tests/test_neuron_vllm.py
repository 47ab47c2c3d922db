"""The Neuron LLM on vLLM with the vllm-neuron plugin: written and validated offline (no Neuron
device or SDK here; vLLM on NeuronCores runs only on an inf2/trn1 host)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from labkit.errors import ConfigError
from labkit.neuron.vllm import (
    INSTANCE_CORES,
    SETUP_TEMPLATE,
    NeuronVllmConfig,
    base_vllm_config,
    write_neuron_vllm_model,
)
from labkit.repository import config_to_text, read_config

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_instance_types_have_the_documented_neuron_core_counts():
    assert INSTANCE_CORES["inf2.xlarge"] == 2
    assert INSTANCE_CORES["inf2.24xlarge"] == 12
    assert INSTANCE_CORES["inf2.48xlarge"] == 24
    assert INSTANCE_CORES["trn1.32xlarge"] == 32


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"instance_type": "inf3.large"}, r"inf3.large.*one of inf2.xlarge"),
        ({"tensor_parallel_size": 3}, r"3 does not divide the 2 NeuronCores.*\[1, 2\]"),
        (
            {"instance_type": "inf2.24xlarge", "tensor_parallel_size": 5},
            r"12 NeuronCores of inf2.24xlarge; use one of \[1, 2, 3, 4, 6, 12\]",
        ),
        ({"tensor_parallel_size": 2, "neuron_core_start": 1}, r"start at 0..0"),
        ({"tensor_parallel_size": 2, "attention_heads": 9}, r"9 attention heads; use one of \[1\]"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"dtype": "int4"}, "dtype 'int4' is not one of"),
        ({"block_size": 300}, "block_size 300 must divide max_model_len 2048"),
        ({"block_size": 32}, r"is_block_kv_layout"),
        (
            {"override_neuron_config": {"tp_degree": 2}},
            r"tp_degree=2 disagrees with tensor_parallel_size=1",
        ),
    ],
)
def test_bad_engine_settings_name_the_setting_and_the_fix(change, match):
    with pytest.raises(ConfigError, match=match):
        NeuronVllmConfig(model=MODEL, **change).validate()


def test_engine_args_and_environment_follow_the_plugin_documentation():
    cfg = NeuronVllmConfig(
        model=MODEL,
        instance_type="trn1.32xlarge",
        tensor_parallel_size=8,
        neuron_core_start=8,
        block_size=32,
        override_neuron_config={"is_block_kv_layout": True, "batch_size": 4},
    )
    args = cfg.engine_args()
    assert args["tensor_parallel_size"] == 8 and args["block_size"] == 32
    assert args["additional_config"] == {
        "override_neuron_config": {"is_block_kv_layout": True, "batch_size": 4}
    }
    assert "device" not in args  # removed from vLLM's engine arguments in v0.10
    assert cfg.environment()["NEURON_RT_VISIBLE_CORES"] == "8-15"
    assert cfg.environment()["VLLM_PLUGINS"] == "neuron"


def test_neuron_folder_is_the_base_model_with_neuron_engine_args(tmp_path):
    base_dir = tmp_path / "base" / "smollm2_vllm"
    (base_dir / "1").mkdir(parents=True)
    base = base_vllm_config("smollm2_vllm", MODEL)
    base.parameters["TEMPERATURE"].string_value = "0"  # a model setting, not an engine one
    base.parameters["omp_threads_bind"].string_value = "auto"
    (base_dir / "config.pbtxt").write_text(config_to_text(base))
    (base_dir / "1" / "model.py").write_text("# the shared AsyncLLM model\n")
    (tmp_path / "shared.py").write_text("# the shared request reader\n")
    (base_dir / "1" / "protocol.py").symlink_to(tmp_path / "shared.py")
    cfg = NeuronVllmConfig(model=MODEL, tensor_parallel_size=2, neuron_core_start=0)

    made = write_neuron_vllm_model(tmp_path / "out", cfg, base_dir=base_dir)

    written = read_config(made.path / "config.pbtxt")
    params = {k: v.string_value for k, v in written.parameters.items()}
    assert params["tensor_parallel_size"] == "2" and params["NEURON_RT_VISIBLE_CORES"] == "0-1"
    assert params["TEMPERATURE"] == "0"  # kept from the base
    assert "gpu_memory_utilization" not in params  # a GPU engine argument, gone
    assert "omp_threads_bind" not in params  # a CPU backend setting, gone
    assert params["huggingface_model"] == MODEL and "model" not in params  # same weights source
    assert params["EXECUTION_ENV_PATH"] == cfg.execution_env_path
    assert [i.name for i in written.input] == ["text_input"]
    assert written.model_transaction_policy.decoupled
    assert (made.path / "1" / "model.py").read_text() == "# the shared AsyncLLM model\n"
    copied = made.path / "1" / "protocol.py"  # every file model.py imports, links as files
    assert not copied.is_symlink() and copied.read_text() == "# the shared request reader\n"
    assert '-    string_value: "0.5"' in made.diff and made.base_source.endswith("config.pbtxt")
    twin = json.loads((made.vllm_backend_path / "1" / "model.json").read_text())
    assert twin == cfg.engine_args()
    assert read_config(made.vllm_backend_path / "config.pbtxt").backend == "vllm"


def test_the_changes_from_the_cpu_model_are_a_table_with_a_reason_for_each(tmp_path):
    base_dir = tmp_path / "smollm2_vllm"
    base_dir.mkdir()
    base = base_vllm_config("smollm2_vllm", MODEL)
    base.parameters["kv_cache_gib"].string_value = "1"  # the CPU backend's, as the lab's model
    base.parameters["temperature"].string_value = "0"  # a model setting: kept, so not listed
    (base_dir / "config.pbtxt").write_text(config_to_text(base))
    made = write_neuron_vllm_model(
        tmp_path / "out", NeuronVllmConfig(model=MODEL), base_dir=base_dir
    )

    rows = made.changes.set_index("setting")
    assert list(made.changes.columns) == ["setting", "on the CPU", "on inf2", "why"]
    assert rows.loc["kv_cache_gib"].tolist()[:2] == ["1", "(unset)"]
    assert rows.loc["dtype"].tolist()[:2] == ["auto", "bfloat16"]
    assert rows.loc["NEURON_RT_VISIBLE_CORES"].tolist()[:2] == ["(unset)", "0"]
    assert "temperature" not in rows.index and "huggingface_model" not in rows.index
    assert all(rows["why"]), rows[rows["why"] == ""]  # no change goes without a word


def test_without_a_base_folder_labkit_stands_in_and_says_so(tmp_path):
    made = write_neuron_vllm_model(
        tmp_path, NeuronVllmConfig(model=MODEL), base_dir=tmp_path / "none"
    )
    assert "stand-in" in made.base_source
    assert not (made.path / "1" / "model.py").exists()
    assert len(made.checks) == 4


@pytest.mark.integration
def test_setup_script_passes_bash_syntax_check():
    done = subprocess.run(["bash", "-n", str(SETUP_TEMPLATE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="apt-get install shellcheck")
def test_setup_script_is_shellcheck_clean():
    done = subprocess.run(["shellcheck", str(SETUP_TEMPLATE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.integration
def test_setup_dry_run_plans_the_plugin_from_the_neuron_pip_repository(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["bash", str(SETUP_TEMPLATE), "--dry-run", "--venv", str(venv), "--plugin-ref", "0.5.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "git clone --depth 1 --branch 0.5.0 https://github.com/vllm-project/vllm-neuron"
        in done.stdout
    )
    assert (
        f"{venv}/bin/pip install --extra-index-url https://pip.repos.neuron.amazonaws.com -e"
        in done.stdout
    )
    assert not venv.exists()  # a dry run installs nothing


@pytest.mark.integration
def test_setup_refuses_a_host_without_a_neuron_device_naming_the_fix(tmp_path):
    done = subprocess.run(
        ["bash", str(SETUP_TEMPLATE), "--venv", str(tmp_path / "v")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no /dev/neuron0" in done.stdout


# -- notebook 05's inf2 folders name the Neuron artifact, never the CPU stand-in ----------------
def cpu_compiled(tmp_path):
    from labkit.neuron.compiler import CompiledModel

    artifact = tmp_path / "cache" / "0123abcd.pt"
    artifact.parent.mkdir()
    artifact.write_bytes(b"torchscript stand-in")
    return CompiledModel(artifact, "cpu", "0123abcd", False, ((1, 4), (1, 4)), ("int64",) * 2)


def test_inf2_batching_folders_point_at_the_neuron_artifact_in_one_table_beside_the_stand_in(
    tmp_path, caplog
):
    from labkit.neuron import walkthrough
    from labkit.neuron.gen import GenOptions, TensorSpec, generate_model

    compiled = cpu_compiled(tmp_path)
    stand_in = generate_model(
        GenOptions(
            tmp_path / "repo" / "add_sub",
            compiled.path,
            target="cpu",
            enable_dynamic_batching=True,
            max_batch_size=8,
            max_queue_delay_microseconds=100,
            inputs=[TensorSpec(f"INPUT__{i}", "INT64", (4,)) for i in range(2)],
            outputs=[TensorSpec(f"OUTPUT__{i}", "INT64", (4,)) for i in range(2)],
            copy_compiled_model=True,
        )
    )
    table = walkthrough.batching_options(tmp_path / "run", compiled, stand_in.path)

    assert list(table.columns) == [
        "setting",
        walkthrough.SERVED_HERE,
        *walkthrough.BATCHING_OPTIONS,
        "what it sets",
    ]
    assert not [c for c in table.columns if "_" in c or "--" in c]  # titles in words, no flags
    rows = table.set_index("setting")
    assert rows.loc["TARGET"].tolist()[:2] == ["cpu", "inf2"]
    assert rows.loc["COMPILED_MODEL"].tolist()[1:4] == ["1/add_sub.inf2.pt"] * 3
    assert rows.loc["BATCH_REQUESTS_TO_NEURON"].tolist()[1:4] == ["true", "true", "false"]
    assert rows.loc["dynamic batching"].tolist()[:4] == [
        "on, waits up to 100 µs",
        "on, waits up to 100 µs",
        "on, waits up to 100 µs, prefers batches of 2, 4",
        "on, waits up to 100 µs",
    ]  # dynamic batching stays on in every inf2 folder: none drops it without a word
    assert "inputs" not in rows.index and all(rows["what it sets"])  # only what differs
    for title, folder in table.attrs["folders"].items():
        if title == walkthrough.SERVED_HERE:
            continue
        config = read_config(folder / "config.pbtxt")
        assert folder.name == config.name == "add_sub"
        assert config.parameters["COMPILED_MODEL"].string_value == "1/add_sub.inf2.pt"
        assert not list(folder.rglob("*.pt"))  # no CPU file copied
    assert "does not exist yet" not in caplog.text  # expected to be missing: not a warning


def test_settings_read_as_words_and_a_lone_config_shows_them_all(tmp_path):
    from labkit.neuron import walkthrough

    made = walkthrough.tensorflow_model(tmp_path)
    said = walkthrough.settings(made.config)
    assert said["inputs"] == "input_1 FP32 [1, 224, 224, 3]"
    assert said["max batch size"] == "0 (none)" and said["dynamic batching"] == "off"
    assert said["instances"] == "1 (model)" and said["TARGET"] == "inf1"
    table = walkthrough.settings_table({"rn50": made.config}, differences_only=False)
    assert list(table["setting"]) == list(said) and list(table.columns) == [
        "setting", "rn50", "what it sets"
    ]  # fmt: skip
    assert made.pending == "resnet50_neuron_savedmodel/1" and made.warnings == []


def test_a_neuron_compiled_artifact_is_copied_in(tmp_path):
    from dataclasses import replace

    from labkit.neuron.walkthrough import neuron_artifact

    compiled = replace(cpu_compiled(tmp_path), target="inf2")
    assert neuron_artifact(compiled, "add_sub") == (str(compiled.path), True)
    assert neuron_artifact(replace(compiled, target="cpu"), "add_sub") == (
        "1/add_sub.inf2.pt",
        False,
    )
