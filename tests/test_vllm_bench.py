"""The vLLM rows of `labkit bench inflight`: the served model's engine settings become vLLM's own
OpenAI server's command line unchanged, a missing environment is refused before anything runs,
and the ratios against the standalone reference and the in-flight model are computed. The study
itself, vLLM in Triton beside vLLM's own server, pinned, runs end to end in notebook 06."""

from __future__ import annotations

import json

import pytest

from labkit import hardware
from labkit.errors import ConfigError, MissingDependencyError
from labkit.llm_serving import figures, schedulers, standalone
from labkit.repository import Repository
from labkit.settings import project_root

MODEL_DIR = project_root() / "model_repository" / "smollm2_vllm"


def test_the_served_models_settings_become_the_servers_flags_and_environment(monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/c/vllm")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    settings = standalone.load_settings(MODEL_DIR)
    params = {"dtype": "bfloat16", "max_num_seqs": "8", "kv_cache_gib": "2",
              "omp_threads_bind": "0", "VLLM_PLUGINS": "neuron", "max_model_len": "4096"}  # fmt: skip
    command, env = standalone.engine_command(settings, params, "/w", 8123, "/venv/bin/python")
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(command)
    assert "--port 8123" in flags and f"--served-model-name {standalone.SERVED_NAME}" in flags
    assert "--model /w" in flags and "--dtype bfloat16" in flags and "--max-num-seqs 8" in flags
    assert "--max-num-batched-tokens 2048" in flags and "--enforce-eager" not in flags
    assert "--max-model-len 4096" in flags
    assert "--disable-log-stats" not in flags  # False: the flag is left out
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0",
                   "VLLM_USE_AOT_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": "/c/vllm/torchinductor",
                   "VLLM_PLUGINS": "neuron"}  # fmt: skip
    eager = standalone.engine_command(settings, {**params, "enforce_eager": "true"}, "/w", 1, "p")
    assert "--enforce-eager" in eager[0] and "VLLM_USE_AOT_COMPILE" not in eager[1]
    with pytest.raises(ConfigError, match="'dtype' must be one of"):
        standalone.engine_command(settings, {"dtype": "int3"}, "/w", 1, "p")
    with pytest.raises(ConfigError, match="no 1/vllm_settings.py"):
        standalone.load_settings(project_root() / "model_repository" / "smollm2")


def test_the_servers_python_is_the_one_the_models_environment_names(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(ConfigError, match="names no EXECUTION_ENV_PATH"):
        standalone._environment_python({}, model_dir)
    with pytest.raises(MissingDependencyError, match="make install"):
        standalone._environment_python({"EXECUTION_ENV_PATH": str(tmp_path / "none")}, model_dir)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    named = {"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/../venv"}
    assert standalone._environment_python(named, model_dir).endswith("m/../venv/bin/python")


def test_the_vllm_scheduler_refuses_a_missing_environment_up_front(tmp_path):
    repo = Repository(project_root() / "model_repository").copy_to(tmp_path / "repo")
    config = repo.config("smollm2_vllm")
    config.parameters["EXECUTION_ENV_PATH"].string_value = str(tmp_path / "no-venv")
    repo.write_config("smollm2_vllm", config)
    with pytest.raises(MissingDependencyError, match="make install"):
        schedulers.check_vllm_environment(repo, "smollm2_vllm")
    with pytest.raises(ConfigError, match="does not hold"):
        schedulers.check_vllm_environment(repo, "no_such_model")


def row(scheduler, tokens_per_s, ttft_p99=100.0, streaming=True):
    return {"scheduler": scheduler, "workload": "mixed", "streaming": streaming,
            "concurrency": 8, "output_tokens_per_s": tokens_per_s, "ttft_p99_ms": ttft_p99,
            "failed": 0}  # fmt: skip


def test_the_vllm_ratios_and_their_targets():
    rows = [row("inflight", 55.3), row("dynamic", 30.0), row("vllm", 88.0),
            row("vllm-standalone", 92.4)]  # fmt: skip
    measured = figures.ratios(rows, {"mixed": {"output_tokens_per_s": 60.0}})
    assert measured["vllm_served_vs_standalone_c8_mixed"] == round(88.0 / 92.4, 3)
    assert measured["vllm_vs_inflight_output_tokens_per_s_c8_mixed"] == round(88.0 / 55.3, 3)
    assert measured["vllm_served_vs_standalone_c8_mixed_nonstreaming"] is None
    said = figures.targets(measured)
    assert said["vllm_served_vs_standalone_c8_mixed"] == {
        "target": ">= 0.9", "measured": 0.952, "met": True}  # fmt: skip
    assert said["vllm_vs_inflight_output_tokens_per_s_c8_mixed"]["met"] is True
    slow = figures.targets(figures.ratios([row("inflight", 55.3), row("vllm", 60.0)], {}))
    assert slow["vllm_vs_inflight_output_tokens_per_s_c8_mixed"]["met"] is False
    assert slow["vllm_served_vs_standalone_c8_mixed"]["met"] is None  # not measured


def test_the_bench_command_takes_the_vllm_options():
    from labkit.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "inflight", "--scheduler", "inflight,vllm", "--no-pin", "--no-standalone"]
    )
    assert args.scheduler == ("inflight", "vllm")
    assert (args.no_pin, args.no_standalone) == (True, True)
    assert "vllm" in schedulers.SCHEDULERS
    default = build_parser().parse_args(["bench", "inflight"])
    assert (default.no_pin, default.no_standalone) == (False, False)


def test_a_study_pins_its_servers_and_aiperf_apart_when_the_host_has_two_cores(monkeypatch):

    assert hardware.split_cores((0, 1)) == ((0,), (1,))
    assert hardware.split_cores((0, 1, 2, 3)) == ((0, 1, 2), (3,))
    with pytest.raises(ConfigError, match="needs two cores; this process has 1"):
        hardware.split_cores((0,))
    assert [hardware.format_cores(c) for c in ((0,), (0, 1, 2, 5), (3, 1))] == ["0", "0-2,5", "1,3"]
    monkeypatch.setattr(hardware, "usable_cores", lambda: (0, 1))
    assert schedulers.StudySettings().check().cores() == ((0,), (1,))  # by default, when it can
    assert schedulers.StudySettings(pin=False).check().cores() == (None, None)
    monkeypatch.setattr(hardware, "usable_cores", lambda: (0,))
    assert schedulers.StudySettings().check().cores() == (None, None)
    with pytest.raises(ConfigError, match="measure unpinned"):
        schedulers.StudySettings(pin=True).check()


def test_the_gpu_configs_carry_the_served_models_engine_settings(tmp_path):
    from labkit import llm_serving

    repo = Repository(project_root() / "model_repository")
    gpu = llm_serving.write_gpu_configs(
        repo, "smollm2_vllm", tmp_path, hub_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        max_num_seqs="32",
    )  # fmt: skip
    assert '-    string_value: "float32"' in gpu.diff and '+    string_value: "auto"' in gpu.diff
    assert (gpu.model_dir / "config.pbtxt").is_file()
    twin = json.loads((gpu.backend_dir / "1" / "model.json").read_text())
    assert twin == gpu.engine_args
    assert twin["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and twin["max_num_seqs"] == 32
    assert (twin["dtype"], twin["enforce_eager"]) == ("auto", False)
    assert 'backend: "vllm"' in (gpu.backend_dir / "config.pbtxt").read_text()
    assert gpu.docker_command[-2:] == ["tritonserver", "--model-repository=/models"]
    assert any(part.endswith("-vllm-python-py3") for part in gpu.docker_command)
    with pytest.raises(ConfigError, match="'dtype' must be one of"):
        llm_serving.write_gpu_configs(repo, "smollm2_vllm", tmp_path, dtype="int3")
    with pytest.raises(ConfigError, match="holds no model 'nope'"):
        llm_serving.write_gpu_configs(repo, "nope", tmp_path)
