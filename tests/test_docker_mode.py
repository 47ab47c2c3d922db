"""The docker mode for real: the lab's image on the CPU stand-in for NGC's, in the Docker engine.

Each test runs ``docker run`` as :class:`~labkit.server.TritonServer` prints it and checks what
the engine did: the answers, the container's own command, ports and shared memory, that no
container outlives its server (stop, a dead owner, Ctrl+C, a failed start), and each fault's
sentence. The image comes from ``docker_tier`` (built once per machine; skipped with the reason
where no engine can be used). Notebook 01 runs end to end in docker mode at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from docker_tier import lab_image

from conftest import write_python_model
from labkit import client, headless
from labkit.errors import MissingDependencyError, PortInUseError, ServerError
from labkit.proc import wait_until
from labkit.server import TritonServer, process

pytestmark = [pytest.mark.integration, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_deploy_transformer.ipynb"
#: A container's start here: the image check, then a Python-backend model loads in seconds.
STARTUP_TIMEOUT_S = 180
#: Removing a container: docker stop gives the server its 10 s exit timeout, then --rm.
GONE_WITHIN_S = 40

ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("text_output",
                np.array([s.upper() for s in
                          pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy()],
                         dtype=object))])
                for r in requests]
"""
#: A model whose load fails, with a line to find in the error.
BROKEN = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this model fails on purpose: broken-weights-17")
"""
#: A model that takes long to load: a start to interrupt.
SLOW = """
import time

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(120)

    def execute(self, requests):
        return []
"""


@pytest.fixture(scope="module")
def image() -> str:
    return lab_image()


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("docker-mode") / "repo"
    write_python_model(repo, "echo", ECHO)
    write_python_model(repo, "broken", BROKEN)
    write_python_model(repo, "slow", SLOW)
    return repo


def container_listed(name: str) -> bool:
    """Whether the engine lists container ``name`` (running, stopped or being removed)."""
    done = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"name=^/{name}$"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return bool(done.stdout.strip())


def assert_gone(name: str, within_s: float = GONE_WITHIN_S) -> float:
    """Wait until container ``name`` is not listed; the seconds it took."""
    began = time.monotonic()
    if not wait_until(lambda: not container_listed(name), within_s, 0.25):
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60, check=False)
        pytest.fail(f"container {name} was still there {within_s:g} s later (removed now)")
    return time.monotonic() - began


def new_server(repository: Path, image: str, tmp_path: Path, **options) -> TritonServer:
    options = {
        "load_models": ["echo"],
        "http_port": 0,
        "grpc_port": 0,
        "metrics_port": 0,
        **options,
    }
    return TritonServer(
        repository,
        mode="docker",
        image=image,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        log_path=tmp_path / "server.log",
        **options,
    )


@pytest.fixture(scope="module")
def served(repository, image, tmp_path_factory):
    """One container for the tests that only ask it things."""
    server = new_server(repository, image, tmp_path_factory.mktemp("served"))
    began = time.monotonic()
    server.start()
    server.start_to_ready_s = time.monotonic() - began
    try:
        yield server
    finally:
        name = server.container_name
        server.stop()
        assert_gone(name)


def inspect(name: str) -> dict:
    done = subprocess.run(
        ["docker", "inspect", name], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)[0]


# -- what runs ------------------------------------------------------------------------------
def test_the_container_answers_infer_and_generate_on_loopback_ports(served):
    print(f"container start to ready: {served.start_to_ready_s:.1f} s")
    assert client.infer(served.http_url, "echo", ["hello docker"]) == ["HELLO DOCKER"]
    assert client.generate(served.http_url, "echo", "hello again").text == "HELLO AGAIN"
    over_grpc = client.infer(served.grpc_url, "echo", ["grpc too"], protocol="grpc")
    assert over_grpc == ["GRPC TOO"]
    assert served.client_host == "127.0.0.1"


def test_the_container_runs_exactly_the_printed_command(served):
    cmd = served.command
    assert cmd == served.docker_command()  # what notebook 01 prints
    seen = inspect(served.container_name)
    after = cmd[cmd.index(served.image) + 1 :]
    assert seen["Config"]["Cmd"] == after and seen["Config"]["Image"] == served.image
    bindings = seen["HostConfig"]["PortBindings"]
    for port in served.ports.values():
        assert bindings[f"{port}/tcp"] == [{"HostIp": "127.0.0.1", "HostPort": str(port)}]
    assert seen["HostConfig"]["NetworkMode"] != "host"
    assert "--gpus" not in cmd  # no GPU here: --gpus all would fail on this engine
    assert seen["HostConfig"]["AutoRemove"] is True


def test_the_stub_finds_its_libraries_and_shared_memory_is_a_gibibyte(served):
    """The Python-backend stub runs (the echo model answered); its shared memory is the
    ``--shm-size=1G`` of the command, not Docker's 64 MiB default."""
    check = "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)"
    done = subprocess.run(
        ["docker", "exec", served.container_name, "python3", "-c", check],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert int(done.stdout) == 1 << 30
    assert (
        "triton_python_backend_stub"
        in subprocess.run(
            ["docker", "top", served.container_name], capture_output=True, text=True, timeout=60
        ).stdout
    )


# -- nothing is left running ------------------------------------------------------------------
def test_stop_removes_the_container_and_a_second_stop_is_harmless(repository, image, tmp_path):
    server = new_server(repository, image, tmp_path)
    server.start()
    name = server.container_name
    assert container_listed(name)
    began = time.monotonic()
    server.stop()
    print(f"stop: {time.monotonic() - began:.1f} s")
    assert not container_listed(name)
    server.stop()


OWNER = """
import sys, time
from labkit.server import TritonServer
server = TritonServer(sys.argv[1], mode="docker", image=sys.argv[2], http_port=0, grpc_port=0,
                      metrics_port=0, load_models=[sys.argv[3]], startup_timeout_s=180,
                      log_path=sys.argv[4])
print(server.container_name, flush=True)
server.start()
print(server.pid, flush=True)  # the docker run client
time.sleep(600)
"""


def start_owner(repository: Path, image: str, tmp_path: Path, model: str) -> subprocess.Popen:
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(OWNER))
    return subprocess.Popen(
        [sys.executable, str(script), str(repository), image, model, str(tmp_path / "log")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip


def end_owner(owner: subprocess.Popen) -> None:
    owner.kill()
    owner.wait()
    owner.stdout.close()


def read_line(owner: subprocess.Popen, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """The owner's next line (bounded: a reader thread)."""
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(owner.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found or not found[0]:
        owner.kill()
        pytest.fail(f"the owner said nothing within {timeout_s:g} s (status {owner.poll()})")
    return found[0].strip()


@pytest.mark.slow
@pytest.mark.parametrize("client_too", [False, True], ids=["owner", "owner-and-docker-client"])
def test_a_killed_owner_leaves_no_container(repository, image, tmp_path, client_too):
    """SIGKILL of the process that started it (a dead kernel): ``docker run`` gets SIGTERM and
    passes it on; with the client killed too, only the guard removes the container."""
    owner = start_owner(repository, image, tmp_path, "echo")
    try:
        name = read_line(owner)
        docker_client = int(read_line(owner))
        assert container_listed(name)
        owner.kill()
        if client_too:
            os.kill(docker_client, signal.SIGKILL)
        owner.wait(timeout=30)
        print(f"gone {assert_gone(name):.1f} s after the kill")
    finally:
        end_owner(owner)


@pytest.mark.slow
def test_ctrl_c_while_starting_removes_the_container(repository, image, tmp_path):
    owner = start_owner(repository, image, tmp_path, "slow")
    try:
        name = read_line(owner)
        assert wait_until(lambda: container_listed(name), 120, 0.25), "no container started"
        owner.send_signal(signal.SIGINT)  # KeyboardInterrupt in the start's wait
        assert owner.wait(timeout=GONE_WITHIN_S) != 0
        assert not container_listed(name)
    finally:
        end_owner(owner)


# -- faults -----------------------------------------------------------------------------------
def test_a_model_that_fails_to_load_is_named_with_its_log_and_leaves_no_container(
    repository, image, tmp_path
):
    server = new_server(repository, image, tmp_path, load_models=["broken"])
    name = server.container_name
    with pytest.raises(ServerError, match="exited with status") as error:
        server.start()
    assert "broken-weights-17" in str(error.value)
    assert "Traceback" not in str(error.value).split("server log")[0]
    assert not container_listed(name)


def test_a_taken_port_is_named_and_no_container_starts(repository, image, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = new_server(repository, image, tmp_path, http_port=port)
        name = server.container_name
        with pytest.raises(PortInUseError, match=f"http port {port} .*http_port=0"):
            server.start()
        assert not container_listed(name)


def test_a_picked_port_taken_before_docker_publishes_it_is_picked_again(
    repository, image, tmp_path, monkeypatch
):
    """Port 0 picks a free port; another process may take it before docker publishes it. The
    engine's 'address already in use' is read as the local mode reads Triton's, and the start
    picks again."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = []
        real = process.free_ports

        def first_pick_taken(count, host, avoid=()):
            ports = real(count, host, avoid=set(avoid) | {taken})
            picks.append(ports)
            return [taken, *ports[1:]] if len(picks) == 1 else ports

        monkeypatch.setattr(process, "free_ports", first_pick_taken)
        server = new_server(repository, image, tmp_path)
        try:
            server.start()
            assert len(picks) == 2 and taken not in server.ports.values()
            assert client.infer(server.http_url, "echo", ["again"]) == ["AGAIN"]
            assert "address already in use" in server.log_path.read_text()
        finally:
            server.stop()


def test_no_engine_is_one_sentence_with_its_fix(repository, image, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    server = new_server(repository, image, tmp_path)
    with pytest.raises(MissingDependencyError, match="no Docker engine answers.*start it"):
        server.start()


def test_a_missing_image_names_the_build(repository, tmp_path):
    server = new_server(repository, "triton_transformer_server:no-such-tag", tmp_path)
    with pytest.raises(MissingDependencyError, match="not on this host.*labkit image build"):
        server.start()
    assert server.log_path.exists() is False


def test_a_model_of_the_vllm_environment_is_refused_in_an_image_without_vllm(image, tmp_path):
    """smollm2_vllm's stub runs in this checkout's .venv-vllm: the lab's image has no vLLM (the
    image itself is asked), so it is refused before any container starts, naming the image that
    has it."""
    repo = tmp_path / "repo"
    (repo / "smollm2_vllm").mkdir(parents=True)
    shipped = ROOT / "model_repository" / "smollm2_vllm" / "config.pbtxt"
    (repo / "smollm2_vllm" / "config.pbtxt").write_text(shipped.read_text())
    server = new_server(repo, image, tmp_path, load_models=["smollm2_vllm"])
    name = server.container_name
    with pytest.raises(MissingDependencyError, match="has no vllm.*Triton's vLLM image") as error:
        server.start()
    assert "vllm-python-py3" in str(error.value)
    assert not container_listed(name)


# -- notebook 01 in docker mode ---------------------------------------------------------------
class ContainerWatch:
    """Records what the engine runs while a notebook runs: each labkit container's inspection."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> ContainerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            listed = subprocess.run(
                ["docker", "ps", "-q", "--filter", "name=labkit-"],
                capture_output=True, text=True, timeout=60, check=False,
            ).stdout.split()  # fmt: skip
            for container in listed:
                if container not in self.seen:
                    found = subprocess.run(
                        ["docker", "inspect", container],
                        capture_output=True, text=True, timeout=60, check=False,
                    )  # fmt: skip
                    if found.returncode == 0:
                        self.seen[container] = json.loads(found.stdout)[0]


@pytest.mark.slow
@pytest.mark.notebook
def test_notebook_01_runs_end_to_end_in_docker_mode(image, tmp_path):
    began = time.monotonic()
    with ContainerWatch() as watch:
        report = headless.run_notebooks(
            [NOTEBOOK],
            tmp_path / "out",
            {"SERVER_MODE": "docker", "IMAGE": image},
            cell_timeout_s=600,
            progress_bar=False,
        )
    print(f"notebook 01 in docker mode: {time.monotonic() - began:.0f} s")
    assert report.ok, report.table()
    (result,) = report.results
    answer = result.figures["answer"]
    assert answer.startswith("I am going") and len(answer.split()) > 6, answer

    import nbformat

    executed = nbformat.read(result.output, as_version=4)
    printed = [
        line.strip()
        for cell in executed.cells
        for out in cell.get("outputs", [])
        for line in out.get("text", "").splitlines()
        if line.strip().startswith("docker run ")
    ]
    assert len(printed) == 1, printed
    words = printed[0].split()
    name, shown_image = words[words.index("--name") + 1], words.index(image)
    ran = [c for c in watch.seen.values() if c["Name"] == f"/{name}"]
    assert ran, (
        f"no container {name} ran; the engine ran {[c['Name'] for c in watch.seen.values()]}"
    )
    assert ran[0]["Config"]["Image"] == image
    assert ran[0]["Config"]["Cmd"] == words[shown_image + 1 :]  # the printed command is what ran
    assert not container_listed(name)  # stop() removed it


# -- labkit serve --mode docker -------------------------------------------------------------
@pytest.mark.slow
def test_labkit_serve_in_docker_mode_leaves_out_what_the_image_cannot_run_and_stops_on_sigint(
    repository, image, tmp_path
):
    repo = tmp_path / "repo"
    write_python_model(repo, "echo", ECHO)
    (repo / "smollm2_vllm").mkdir()
    shipped = ROOT / "model_repository" / "smollm2_vllm" / "config.pbtxt"
    (repo / "smollm2_vllm" / "config.pbtxt").write_text(shipped.read_text())
    command = [
        sys.executable, "-m", "labkit.cli", "serve", "--mode", "docker", "--image", image,
        "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
        "--metrics-port", "0", "--log-file", str(tmp_path / "server.log"),
    ]  # fmt: skip
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        said = []
        while not said or not said[-1].startswith("server log:"):
            said.append(read_line(serve))
        shown = "\n".join(said)
        if (ROOT / ".venv-vllm" / "bin" / "python").is_file():  # else left out for its absence
            assert "not loading smollm2_vllm" in shown and "has no vllm" in shown
        url = shown.split("HTTP: http://", 1)[1].split()[0]
        assert client.infer(url, "echo", ["served"]) == ["SERVED"]
        (name,) = subprocess.run(
            ["docker", "ps", "--format", "{{.Names}}", "--filter",
             f"publish={url.rpartition(':')[2]}"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()  # fmt: skip
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=GONE_WITHIN_S) == 0
        assert "Triton stopped." in serve.stdout.read()
        assert not container_listed(name)
    finally:
        end_owner(serve)
