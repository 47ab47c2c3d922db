"""The vLLM rows of `labkit bench inflight`: the served model's engine settings become vLLM's own
OpenAI server's command line unchanged, a missing environment is refused before anything runs,
and the ratios against the standalone reference and the in-flight model are computed."""

from __future__ import annotations

import pytest

from labkit.errors import ConfigError, MissingDependencyError
from labkit.llm_serving import figures, schedulers, standalone
from labkit.repository import Repository
from labkit.settings import project_root

MODEL_DIR = project_root() / "model_repository" / "smollm2_vllm"


def test_the_served_models_settings_become_the_servers_flags_and_environment():
    settings = standalone.load_settings(MODEL_DIR)
    params = {"dtype": "bfloat16", "max_num_seqs": "8", "kv_cache_gib": "2",
              "omp_threads_bind": "0", "VLLM_PLUGINS": "neuron", "max_model_len": "4096"}  # fmt: skip
    command, env = standalone.engine_command(settings, params, "/w", 8123, "/venv/bin/python")
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(command)
    assert "--port 8123" in flags and f"--served-model-name {standalone.SERVED_NAME}" in flags
    assert "--model /w --dtype bfloat16 --max-num-seqs 8" in flags
    assert "--max-num-batched-tokens 2048 --enforce-eager" in flags
    assert "--max-model-len 4096" in flags
    assert "--disable-log-stats" not in flags  # False: the flag is left out
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0",
                   "VLLM_PLUGINS": "neuron"}  # fmt: skip
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
        ["bench", "inflight", "--scheduler", "inflight,vllm", "--standalone-cores", "0",
         "--no-standalone"]
    )  # fmt: skip
    assert args.scheduler == ("inflight", "vllm")
    assert (args.standalone_cores, args.no_standalone) == ("0", True)
    assert "vllm" in schedulers.SCHEDULERS
