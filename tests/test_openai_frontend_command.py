"""``labkit serve --openai``: the docker mode's command for Triton's OpenAI frontend (the NGC
image's python/openai main.py), built and checked here, never run: this machine has no Docker
engine, and the frontend's ``tritonserver`` Python package is not in the lab's environment.

The models are copies of the shipped configs (``smollm2_vllm``, ``smollm2``), so a change to the
vLLM model's tensors that the frontend depends on fails here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.errors import ConfigError, ServerError
from labkit.repository import Repository, parse_config
from labkit.server import TritonServer
from labkit.server.frontend import FRONTEND_INPUTS, frontend_models
from labkit.settings import DEFAULT_IMAGE, TOKEN_VARIABLES, TRITON_RELEASE

SHIPPED = Path(__file__).resolve().parents[1] / "model_repository"
VLLM_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-vllm-python-py3"
MAIN = "/opt/tritonserver/python/openai/openai_frontend/main.py"
REPO_IN_CONTAINER = "/opt/tritonserver/model_repository"


def copy_config(repo: Path, shipped: str, name: str | None = None) -> Path:
    """The shipped model's config.pbtxt alone (no weights, no code) as model ``name``."""
    folder = repo / (name or shipped)
    folder.mkdir(parents=True)
    text = (SHIPPED / shipped / "config.pbtxt").read_text(encoding="utf-8")
    if name:
        text = text.replace(f'name: "{shipped}"', f'name: "{name}"')
    (folder / "config.pbtxt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """smollm2_vllm and smollm2 as shipped; caches and tokens of this test's own."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "labkit-cache"))
    monkeypatch.delenv("LABKIT_TRITON_IMAGE", raising=False)
    monkeypatch.delenv("LABKIT_SERVER_MODE", raising=False)
    for name in TOKEN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    repository = tmp_path / "repo"
    copy_config(repository, "smollm2_vllm")
    copy_config(repository, "smollm2")
    return repository


def openai_server(repository, **kwargs) -> TritonServer:
    kwargs.setdefault("load_models", ["smollm2_vllm"])
    kwargs.setdefault("gpus", True)  # NGC's vLLM image on a GPU host
    return TritonServer(repository, mode="docker", openai_port=9000, **kwargs)


# -- the command -------------------------------------------------------------------------------
def test_the_docker_command_runs_the_openai_frontend_for_smollm2_vllm(repo, tmp_path):
    server = openai_server(repo)
    assert server.docker_command("c1") == [
        "docker",
        "run",
        "--gpus",
        "all",
        "--rm",
        "-p",  # published on loopback, under the same numbers inside
        "127.0.0.1:8000:8000",
        "-p",
        "127.0.0.1:8001:8001",
        "-p",
        "127.0.0.1:9000:9000",
        "--shm-size=1G",
        "--ulimit",
        "memlock=-1",
        "--ulimit",
        "stack=67108864",
        "--name",
        "c1",
        "-e",
        "HF_HOME=/root/.cache/huggingface",
        "-v",
        f"{repo}:{REPO_IN_CONTAINER}",
        "-v",  # its config without EXECUTION_ENV_PATH, the host's .venv-vllm
        f"{tempfile.gettempdir()}/c1-configs/smollm2_vllm/config.pbtxt:"
        f"{REPO_IN_CONTAINER}/smollm2_vllm/config.pbtxt:ro",
        "-v",
        f"{tmp_path / 'hf'}:/root/.cache/huggingface",
        "-v",
        f"{tmp_path / 'labkit-cache'}:{tmp_path / 'labkit-cache'}:ro",  # the weights link's target
        VLLM_IMAGE,
        "python3",
        MAIN,
        f"--model-repository={REPO_IN_CONTAINER}",
        "--model-control-mode=explicit",
        "--load-model=smollm2_vllm",
        f"--tokenizer={REPO_IN_CONTAINER}/smollm2_vllm/weights",  # huggingface_model: "weights"
        "--backend=vllm",  # the config says backend "python": else TRT-LLM's tensors are sent
        "--host=0.0.0.0",  # the container's own interfaces: the host side is the -p above
        "--openai-port=9000",
        "--enable-kserve-frontends",
        "--kserve-http-port=8000",
        "--kserve-grpc-port=8001",
    ]
    assert server.openai_url == "http://127.0.0.1:9000/v1"
    assert server.metrics_url == "http://127.0.0.1:9000/metrics"  # the frontend serves them


def test_the_frontend_binds_the_host_and_ports_asked_for_and_takes_a_named_image(repo):
    server = TritonServer(
        repo,
        mode="docker",
        host="0.0.0.0",
        http_port=18000,
        grpc_port=18001,
        openai_port=19000,
        image="example/triton:2",
        load_models=["smollm2_vllm"],
    )
    cmd = server.docker_command("c1")
    after = cmd[cmd.index("example/triton:2") + 1 :]
    assert after[:2] == ["python3", MAIN] and "tritonserver" not in after
    assert {"--host=0.0.0.0", "--openai-port=19000"} <= set(after)
    assert {"--kserve-http-port=18000", "--kserve-grpc-port=18001"} <= set(after)
    assert not [a for a in after if a.startswith("--metrics")]  # the frontend opens no such port
    assert server.openai_url == "http://127.0.0.1:19000/v1"  # a wildcard bind, reached on loopback


def test_without_openai_port_the_docker_command_is_still_tritonserver(repo):
    server = TritonServer(repo, mode="docker", load_models=["smollm2_vllm"])
    cmd = server.docker_command("c1")
    assert cmd[cmd.index("tritonserver") - 1] != "python3" and MAIN not in cmd
    assert server.openai_url is None


def test_the_frontends_tensors_are_the_shipped_vllm_models_inputs():
    """What the frontend sends with every request, each declared by smollm2_vllm (Triton refuses
    a request with an input the model does not declare)."""
    config = Repository(SHIPPED).config("smollm2_vllm")
    declared = {tensor.name for tensor in config.input}
    assert set(FRONTEND_INPUTS) <= declared
    assert frontend_models(SHIPPED, ["*"]) == ["smollm2_vllm"]


# -- the local mode cannot run it ----------------------------------------------------------------
def test_the_lab_environment_has_no_tritonserver_python_package():
    """The premise of the local mode's refusal: the frontend's ``import tritonserver`` fails with
    the Triton bundled in nvidia-pytriton. If this fails, the local mode may run the frontend."""
    assert importlib.util.find_spec("tritonserver") is None
    assert importlib.util.find_spec("pytriton") is not None


def test_the_local_mode_refuses_the_frontend_and_says_why_and_what_to_do(repo):
    with pytest.raises(ServerError, match="'tritonserver' Python package") as err:
        TritonServer(repo, mode="local", openai_port=9000, load_models=["smollm2_vllm"])
    message = str(err.value)
    assert "nvidia-pytriton" in message and "docker mode" in message
    assert "labkit serve --mode docker --openai" in message


def test_labkit_serve_openai_in_local_mode_fails_before_building_weights(repo, capsys):
    code = main(
        ["serve", "--model-repository", str(repo), "--openai", "--load-model", "smollm2_vllm"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "labkit: error:" in err and "cannot run in the local mode" in err
    assert not (repo / "smollm2_vllm" / "weights").exists()  # prepare_repository never ran


def test_remote_mode_refuses_the_frontend(repo):
    with pytest.raises(ServerError, match="docker mode only, not the remote mode"):
        TritonServer(repo, url="http://example:8000", openai_port=9000)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("port", [70000, -1, 65536, "9000", True])
def test_an_openai_port_out_of_range_is_refused_naming_it(repo, port):
    with pytest.raises(ServerError, match=f"openai_port={port!r} is not a TCP port"):
        TritonServer(repo, mode="docker", openai_port=port, load_models=["smollm2_vllm"])


@pytest.mark.parametrize("text", ["70000", "-1", "nine"])
def test_labkit_serve_refuses_an_openai_port_out_of_range(repo, text, capsys):
    with pytest.raises(SystemExit, match="^2$") as exit_:  # argparse's usage error
        main(["serve", "--model-repository", str(repo), "--openai", "--openai-port", text])
    assert exit_.value.code == 2
    assert f"argument --openai-port: {text!r} is not a TCP port" in capsys.readouterr().err


def test_labkit_serve_refuses_openai_port_without_openai(repo, capsys):
    assert main(["serve", "--model-repository", str(repo), "--openai-port", "9100"]) == 2
    assert "--openai-port 9100 needs --openai" in capsys.readouterr().err


def test_the_frontend_without_a_model_it_can_drive_names_the_one_that_can(repo):
    with pytest.raises(ConfigError, match="none of smollm2 does") as err:
        openai_server(repo, load_models=["smollm2"])
    assert "--load-model smollm2_vllm" in str(err.value)
    assert "sampling_parameters" in str(err.value)  # what smollm2 lacks


def test_a_repository_without_a_language_model_is_refused(tmp_path):
    repository = tmp_path / "repo"
    copy_config(repository, "smollm2")
    with pytest.raises(ConfigError, match=r"none of smollm2 does; .*repo has none"):
        TritonServer(repository, mode="docker", openai_port=9000)


def test_a_model_the_frontend_cannot_drive_is_not_loaded_beside_one_it_can(repo):
    with pytest.raises(ConfigError, match="would list smollm2 at /v1/models"):
        openai_server(repo, load_models=["smollm2_vllm", "smollm2"])


def test_all_models_means_the_ones_the_frontend_can_drive(repo):
    server = TritonServer(repo, mode="docker", openai_port=9000)  # load_models="*"
    assert server.load_models == ["smollm2_vllm"]
    assert "--load-model=smollm2_vllm" in server.docker_command("c1")
    assert "--load-model=*" not in server.docker_command("c1")


def test_two_language_models_with_different_weights_are_refused(repo):
    twin = copy_config(repo, "smollm2_vllm", "other_vllm")
    text = (twin / "config.pbtxt").read_text(encoding="utf-8")
    (twin / "config.pbtxt").write_text(
        text.replace('string_value: "weights"', 'string_value: "other_weights"'), encoding="utf-8"
    )
    with pytest.raises(ConfigError, match="one tokenizer for every model"):
        openai_server(repo, load_models=["smollm2_vllm", "other_vllm"])


def test_two_language_models_linked_to_the_same_weights_share_the_tokenizer(repo, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    copy_config(repo, "smollm2_vllm", "twin_vllm")
    for name in ("smollm2_vllm", "twin_vllm"):
        (repo / name / "weights").symlink_to(weights)
    server = openai_server(repo, load_models=["smollm2_vllm", "twin_vllm"])
    cmd = server.docker_command("c1")
    assert [a for a in cmd if a.startswith("--load-model")] == [
        "--load-model=smollm2_vllm",
        "--load-model=twin_vllm",
    ]
    assert f"--tokenizer={REPO_IN_CONTAINER}/smollm2_vllm/weights" in cmd


def test_a_hugging_face_id_is_passed_as_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repository = tmp_path / "repo"
    folder = copy_config(repository, "smollm2_vllm")
    text = (folder / "config.pbtxt").read_text(encoding="utf-8")
    text = text.replace('string_value: "weights"', 'string_value: "HuggingFaceTB/SmolLM2-135M"')
    text = text.replace('key: "labkit_weights"', 'key: "unused_weights"')
    (folder / "config.pbtxt").write_text(text, encoding="utf-8")
    cmd = TritonServer(repository, mode="docker", openai_port=9000).docker_command("c1")
    assert "--tokenizer=HuggingFaceTB/SmolLM2-135M" in cmd


def test_the_response_cache_is_refused_with_the_frontend(repo):
    with pytest.raises(ServerError, match="no response-cache option"):
        openai_server(repo, cache_size=1 << 20)


def test_the_shipped_vllm_model_is_served_from_its_own_weights_folder():
    """Read from the shipped folder's config alone (a fresh clone has no weights link yet)."""
    server = TritonServer(SHIPPED, mode="docker", openai_port=0, load_models=["smollm2_vllm"])
    assert server.frontend.models == ("smollm2_vllm",)
    assert server.frontend.tokenizer(REPO_IN_CONTAINER).endswith("/smollm2_vllm/weights")


#: What the frontend's _create_vllm_generate_request (server repo, python/openai/openai_frontend/
#: engine/utils/triton.py) puts in every request, read from its code.
SENT = [
    "text_input",
    "stream",
    "exclude_input_in_output",
    "sampling_parameters",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_logprobs",
]


@pytest.mark.parametrize("tensor", SENT)
def test_a_model_missing_one_tensor_the_frontend_sends_is_refused(tmp_path, tensor):
    repository = tmp_path / "repo"
    copy_config(repository, "smollm2_vllm")
    repo = Repository(repository)
    config = repo.config("smollm2_vllm")
    kept = [t for t in config.input if t.name != tensor]
    del config.input[:]
    config.input.extend(kept)
    repo.write_config("smollm2_vllm", config)
    with pytest.raises(ConfigError, match="none of smollm2_vllm does"):
        TritonServer(repository, mode="docker", openai_port=9000, load_models=["smollm2_vllm"])


def test_a_model_without_the_text_output_the_frontend_reads_is_refused(tmp_path):
    repository = tmp_path / "repo"
    copy_config(repository, "smollm2_vllm")
    repo = Repository(repository)
    config = repo.config("smollm2_vllm")
    kept = [t for t in config.output if t.name != "text_output"]
    del config.output[:]
    config.output.extend(kept)
    repo.write_config("smollm2_vllm", config)
    with pytest.raises(ConfigError, match="the output text_output\\); none of smollm2_vllm"):
        TritonServer(repository, mode="docker", openai_port=9000, load_models=["smollm2_vllm"])


# -- the host's virtualenv stays on the host -----------------------------------------------------
#: A stand-in for docker (no Docker engine here): ``run`` records its arguments and the text of
#: every config.pbtxt it was given to mount, then fails as a container that cannot start would.
FAKE_DOCKER = """#!{python}
import json, os, sys
argv = sys.argv[1:]
if argv[:1] == ["run"]:
    mounts = [argv[i + 1].split(":") for i, arg in enumerate(argv) if arg == "-v"]
    configs = {{inside: open(host).read() for host, inside, *_ in mounts
               if inside.endswith("/config.pbtxt")}}
    record = {{"argv": argv, "configs": configs}}
    open(os.environ["FAKE_DOCKER_RUN"], "w").write(json.dumps(record))
    sys.exit("fake docker: no container engine here")
"""


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A fake docker first on PATH; returns the file its ``run`` records into."""
    program = tmp_path / "bin" / "docker"
    program.parent.mkdir()
    program.write_text(FAKE_DOCKER.format(python=sys.executable))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    record = tmp_path / "run.json"
    monkeypatch.setenv("FAKE_DOCKER_RUN", str(record))
    monkeypatch.setattr("labkit.server.process.require_image", lambda image: None)  # no engine
    monkeypatch.setattr("labkit.server.process.image_imports", lambda image, package: True)
    return record


def start_refused(server: TritonServer, record: Path) -> dict:
    """Start ``server`` against the fake docker; what its ``run`` saw."""
    with pytest.raises(ServerError, match="no container engine here"):
        server.start()
    return json.loads(record.read_text())


@pytest.mark.integration  # starts the fake docker, and the guard that would remove its container
@pytest.mark.parametrize("openai_port", [9000, None], ids=["openai", "tritonserver"])
def test_docker_mode_serves_smollm2_vllm_without_the_hosts_venv_with_a_fake_docker(
    repo, fake_docker, tmp_path, openai_port
):
    """The shipped config points the stub at the checkout's .venv-vllm (a CPU build of vLLM);
    the container neither mounts it nor could run it, so it reads a copy of the config without
    that parameter and runs the image's own vLLM. The repository's own file is not touched."""
    shipped = (repo / "smollm2_vllm" / "config.pbtxt").read_text()
    server = TritonServer(
        repo,
        mode="docker",
        openai_port=openai_port,
        load_models=["smollm2_vllm"],
        image=None if openai_port else "example/triton-vllm:1",
        http_port=0,
        grpc_port=0,
        log_path=tmp_path / "server.log",
        **({} if openai_port else {"metrics_port": 0}),
    )
    name = server.container_name
    seen = start_refused(server, fake_docker)
    served = Repository(repo).config("smollm2_vllm")
    assert "EXECUTION_ENV_PATH" in served.parameters  # the premise: the shipped config has it
    inside = f"{REPO_IN_CONTAINER}/smollm2_vllm/config.pbtxt"
    assert set(seen["configs"]) == {inside}  # smollm2 runs on the image's Python already
    copy = parse_config(seen["configs"][inside])
    assert "EXECUTION_ENV_PATH" not in copy.parameters
    del served.parameters["EXECUTION_ENV_PATH"]
    assert copy == served  # nothing else differs
    assert f"{repo}:{REPO_IN_CONTAINER}" in seen["argv"]  # the rest is the live folder
    assert (repo / "smollm2_vllm" / "config.pbtxt").read_text() == shipped
    assert not (Path(tempfile.gettempdir()) / f"{name}-configs").exists()  # removed by stop


class LoadRecorder:
    """Stands in for the HTTP client of a container that cannot run here (no Docker engine):
    what the container's config copy said when each load was asked."""

    def __init__(self, copy: Path) -> None:
        self.copy, self.loads = copy, []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def load_model(self, name: str, config=None) -> None:
        self.loads.append((name, parse_config(self.copy.read_text())))


def test_a_reload_in_docker_mode_sees_the_edited_config_without_the_hosts_venv_with_a_fake_client(
    repo, monkeypatch
):
    """The container reads the copy through a bind mount of the file itself: a reload must find
    the repository's edit there, in the same file."""
    monkeypatch.setattr("labkit.server.process.image_imports", lambda image, package: True)
    server = TritonServer(repo, mode="docker", load_models=["smollm2_vllm"], image="x/y:1")
    copy = server.container_configs()["smollm2_vllm"]
    try:
        server._write_container_configs()  # what start() writes before docker run
        inode = copy.stat().st_ino
        edited = Repository(repo).config("smollm2_vllm")
        edited.parameters["max_tokens"].string_value = "32"
        Repository(repo).write_config("smollm2_vllm", edited)
        recorder = LoadRecorder(copy)
        monkeypatch.setattr(server, "client", lambda: recorder)
        monkeypatch.setattr(TritonServer, "running", property(lambda self: True))  # a container
        server.load_model("smollm2_vllm")
        ((name, seen),) = recorder.loads
        assert name == "smollm2_vllm" and seen.parameters["max_tokens"].string_value == "32"
        assert "EXECUTION_ENV_PATH" not in seen.parameters
        assert copy.stat().st_ino == inode  # rewritten in place, so the mount still shows it
    finally:
        shutil.rmtree(copy.parents[1], ignore_errors=True)


def test_a_repository_without_lab_environments_mounts_no_config_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repository = tmp_path / "repo"
    copy_config(repository, "smollm2")
    cmd = TritonServer(repository, mode="docker", load_models=["smollm2"]).docker_command("c1")
    assert not [a for a in cmd if a.endswith("config.pbtxt:ro")]


def test_the_labs_image_without_vllm_refuses_smollm2_vllm_naming_the_vllm_image(repo, monkeypatch):
    monkeypatch.setattr("labkit.server.process.image_imports", lambda image, package: False)
    server = TritonServer(repo, mode="docker", load_models=["smollm2_vllm"])
    assert server.image == DEFAULT_IMAGE
    (why,) = server.image_refuses().values()
    assert f"{DEFAULT_IMAGE} has no vllm" in why and VLLM_IMAGE in why
