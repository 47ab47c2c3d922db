"""labkit.server: locate, start, readiness, errors and clean stop, against a real tritonserver."""

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
import urllib.request

import psutil
import pytest

from conftest import group_alive, wait_for, write_python_model
from labkit.errors import MissingDependencyError, PortInUseError, ServerError
from labkit.server import TritonServer, locate_tritonserver, start_server

ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            out = np.array([t[::-1] for t in text.reshape(-1)], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)]))
        return responses
"""


def write_model(repo, name, model_py=ECHO_MODEL):
    write_python_model(repo, name, model_py)


@pytest.fixture
def echo_repo(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "echo")
    return repo


def generate(server, model, text):
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate",
        data=json.dumps({"text_input": text}).encode(),
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["text_output"]


def test_explicit_path_that_is_not_executable_names_the_path(tmp_path):
    with pytest.raises(MissingDependencyError, match="nope/tritonserver"):
        locate_tritonserver(tmp_path / "nope" / "tritonserver")


def test_environment_variable_takes_precedence_over_path(tmp_path, monkeypatch):
    # Two real servers: the bundled binary, reached through two links of different names.
    monkeypatch.delenv("LABKIT_TRITONSERVER", raising=False)
    real = locate_tritonserver().path
    (tmp_path / "on-path").mkdir()
    (tmp_path / "chosen").mkdir()
    on_path, chosen = tmp_path / "on-path" / "tritonserver", tmp_path / "chosen" / "tritonserver"
    on_path.symlink_to(real)
    chosen.symlink_to(real)
    monkeypatch.setenv("PATH", f"{on_path.parent}{os.pathsep}{os.environ['PATH']}")
    assert (locate_tritonserver().path, locate_tritonserver().source) == (on_path, "PATH")
    monkeypatch.setenv("LABKIT_TRITONSERVER", str(chosen))
    found = locate_tritonserver()
    assert (found.path, found.source) == (chosen, "LABKIT_TRITONSERVER")


def test_bundled_server_gets_stub_and_libpython(monkeypatch):
    monkeypatch.delenv("LABKIT_TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    found = locate_tritonserver()
    assert found.source == "nvidia-pytriton"
    assert (found.backend_directory / "python" / "triton_python_backend_stub").is_file()
    assert found.env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == __import__(
        "sysconfig"
    ).get_config_var("LIBDIR")
    assert found.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_docker_command_is_the_tutorials_and_holds_no_secret(echo_repo, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue123")
    monkeypatch.setenv("PRIVATE_REPO_TOKEN", "hf_othersecret456")
    server = TritonServer(echo_repo, mode="docker", image="example/triton:1", gpus=True)
    cmd = server.docker_command("c1")
    line = " ".join(cmd)
    assert "supersecret" not in line and "othersecret" not in line
    assert cmd[cmd.index("HF_TOKEN") - 1] == "-e"
    assert cmd[cmd.index("PRIVATE_REPO_TOKEN") - 1] == "-e"
    for flag in [
        "--gpus all",
        "-p 127.0.0.1:8000:8000",
        "--shm-size=1G",
        "--ulimit memlock=-1",
        "--ulimit stack=67108864",
        f"-v {echo_repo}:/opt/tritonserver/model_repository",
    ]:
        assert flag in line
    after_image = cmd[cmd.index("example/triton:1") + 1 :]
    assert after_image[0] == "tritonserver"
    assert "--model-repository=/opt/tritonserver/model_repository" in after_image
    assert "--model-control-mode=explicit" in after_image
    assert "--http-address=0.0.0.0" in after_image  # the container's side of -p 127.0.0.1
    assert "supersecret" not in repr(server)


def test_missing_repository_is_named(tmp_path):
    with pytest.raises(ServerError, match="does-not-exist"):
        TritonServer(tmp_path / "does-not-exist")


def test_busy_port_error_names_the_port(echo_repo, start_server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = start_server.new(echo_repo, http_port=port)
        with pytest.raises(PortInUseError, match=f"http port {port} .* in use.*http_port=0"):
            server.start()
        assert server.pid is None


@pytest.mark.integration
def test_port_taken_between_choosing_and_binding_names_the_port_with_a_fake_port_check(
    echo_repo, monkeypatch, start_server
):
    # Fake: the window between labkit's check and Triton's bind is too short to hit on purpose,
    # so the check is made to pass; the real server then meets the taken port and exits.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr("labkit.server.process.check_port_free", lambda *a, **k: None)
        server = start_server.new(echo_repo, http_port=port)
        with pytest.raises(PortInUseError, match=f"http port {port} was taken"):
            server.start()
        assert not server.running


@pytest.mark.integration
def test_a_picked_free_port_taken_before_triton_binds_it_is_picked_again_with_a_fake_pick(
    echo_repo, monkeypatch, start_server
):
    # Fake: another process binding the port labkit picked, before Triton binds it, is a race too
    # short to hit on purpose; the pick hands out a taken port first to make it certain.
    from labkit.server import process

    real_pick = process.free_ports
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        handed = iter([taken])

        def pick(count, *args, **kwargs):  # the first start's HTTP port is the taken one
            first = next(handed, None)
            if first is None:
                return real_pick(count, *args, **kwargs)
            return [first, *real_pick(count - 1, *args, **kwargs)]

        monkeypatch.setattr(process, "free_ports", pick)
        server = start_server(echo_repo)
        assert server.ports["http"] != taken
        assert generate(server, "echo", "abc") == "cba"
        assert f":{taken}" in server.log_path.read_text()  # the first start met the taken port


@pytest.mark.integration
def test_serves_on_loopback_and_stop_leaves_no_process(echo_repo, start_server):
    server = start_server(echo_repo)
    assert generate(server, "echo", "abc") == "cba"
    connections = psutil.Process(server.pid).net_connections()
    listening = {c.laddr.ip.removeprefix("::ffff:") for c in connections if c.status == "LISTEN"}
    assert listening == {"127.0.0.1"}  # HTTP, gRPC (IPv4-mapped) and metrics: loopback only
    pgid = server.pid
    assert any(p.name().startswith("triton_python") for p in group_alive(pgid))
    server.stop()
    assert not server.running and server.pid is None
    # stop() kills the group's stubs with SIGKILL; they end a moment later, not at once
    wait_for(lambda: group_alive(pgid) == [], 10, "the end of every process of the server")
    server.stop()  # a second stop is harmless


@pytest.mark.integration
def test_remote_mode_attaches_without_owning(echo_repo, start_server):
    owner = start_server(echo_repo)
    with TritonServer(url=f"http://{owner.http_url}") as remote:
        assert remote.mode == "remote" and remote.http_url == owner.http_url
        assert generate(remote, "echo", "xy") == "yx"
    assert owner.running and generate(owner, "echo", "ok") == "ko"


@pytest.mark.integration
def test_model_that_fails_to_load_is_reported_with_the_log_tail(tmp_path, start_server):
    repo = tmp_path / "repo"
    write_model(repo, "broken", model_py="raise RuntimeError('weights are missing: run prepare')\n")
    with pytest.raises(ServerError, match="weights are missing: run prepare"):
        start_server(repo)


@pytest.mark.integration
def test_a_refused_load_leaves_no_connection_open_that_would_hold_up_stop(echo_repo, start_server):
    """Triton's shutdown waits its whole exit timeout for open HTTP connections. A refused
    load's exception kept labkit's client, and so its connection, alive: stop() took 10.2 s."""
    write_model(echo_repo, "broken", model_py="raise RuntimeError('weights are missing')\n")
    server = start_server(echo_repo, load_models=["echo"])
    with pytest.raises(ServerError, match="weights are missing") as refused:
        server.load_model("broken")
    port = server.ports["http"]
    open_to_server = [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    ]
    assert refused.value is not None and open_to_server == []


@pytest.mark.integration
def test_stop_after_a_failed_reload_does_not_wait_for_the_version_that_never_loaded(
    echo_repo, start_server, caplog
):
    """Triton 2.51 counts a version whose reload failed as a live model that never unloads, and
    its shutdown waited its whole 10 s exit timeout for it. stop() ends the wait once the log
    shows every version the server held unloaded, and still stops everything."""
    server = start_server(echo_repo, load_models=["echo"])
    (echo_repo / "echo" / "1" / "model.py").write_text(
        "raise RuntimeError('new weights corrupt')\n"
    )
    with pytest.raises(ServerError, match="new weights corrupt"):
        server.load_model("echo")
    assert server.model_index()[0]["state"] == "READY"  # the old version still serves
    pgid = server.pid
    with caplog.at_level("DEBUG", logger="labkit.server.process"):
        server.stop()
    assert "never loaded" in caplog.text  # ended early, not after the 10 s exit timeout
    assert "successfully unloaded 'echo' version 1" in server.log_path.read_text()
    assert group_alive(pgid) == []


@pytest.mark.integration
def test_stop_of_a_server_without_a_failed_load_lets_triton_exit_by_itself(
    echo_repo, start_server, caplog
):
    server = start_server(echo_repo, load_models=["echo"])
    with caplog.at_level("DEBUG", logger="labkit.server.process"):
        server.stop()
    assert "waits only for versions" not in caplog.text
    assert "Found 0 live models" in server.log_path.read_text()


@pytest.mark.integration
def test_killed_parent_leaves_no_server(echo_repo, tmp_path):
    script = textwrap.dedent(f"""
        import time
        from labkit.server import TritonServer
        s = TritonServer({str(echo_repo)!r}, http_port=0, grpc_port=0, metrics_port=0,
                         log_path={str(tmp_path / "orphan.log")!r}).start()
        print(s.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert group_alive(pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    try:
        wait_for(lambda: group_alive(pid) == [], 30, "the end of the dead parent's server")
    finally:
        for proc in group_alive(pid):  # clean up before failing, so a failure leaves nothing
            proc.kill()


@pytest.mark.integration
def test_a_server_started_from_a_thread_that_ends_keeps_serving(echo_repo, start_server):
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: a server started from a worker
    thread got SIGTERM the moment that thread returned (a cluster's supervisor starting a
    replacement, a notebook's thread pool). Only the process's own death may end it."""
    server = start_server.new(echo_repo)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join(timeout=120)
    assert not starter.is_alive() and server.running
    # Triton logs a SIGTERM at once and then drains for a moment: look for that line, and ask.
    time.sleep(1)
    assert "Signal (15) received" not in server.log_path.read_text()
    assert generate(server, "echo", "still here") == "ereh llits"


@pytest.mark.integration
def test_start_returns_only_when_grpc_and_metrics_answer_too(echo_repo, start_server):
    """Triton opens HTTP about 40 ms before its metrics port: a metrics read right after start()
    got `Connection refused` once. Started and read at once, many times, it never may."""
    import tritonclient.grpc as grpcclient

    for _attempt in range(6):
        with start_server.new(echo_repo) as server:
            with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
                body = response.read().decode()
            assert response.status == 200 and "nv_inference_count" in body, body[:300]
            with grpcclient.InferenceServerClient(server.grpc_url) as client:
                assert client.is_model_ready("echo")


def test_docker_command_always_mounts_a_hugging_face_cache(echo_repo, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    line = " ".join(TritonServer(echo_repo, mode="docker").docker_command())
    default = tmp_path / "xdg" / "huggingface"
    assert f"-v {default}:/root/.cache/huggingface" in line and default.is_dir()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    line = " ".join(TritonServer(echo_repo, mode="docker").docker_command())
    assert f"-v {tmp_path / 'hf'}:/root/.cache/huggingface" in line


def test_http_ok_is_true_only_for_a_200():
    """The readiness probe shared by the server and the replica pool: a 503, a missing path and a
    closed port are all "not ready", never an exception."""
    import http.server

    from labkit.proc import free_port, http_ok

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response({"/ready": 200, "/busy": 503}.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert [http_ok(f"{base}/ready"), http_ok(f"{base}/busy"), http_ok(f"{base}/gone")] == [
            True,
            False,
            False,
        ]
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert http_ok(f"http://127.0.0.1:{free_port()}/ready") is False


@pytest.mark.integration
def test_spawn_raises_a_missing_program_in_the_asking_thread_and_goes_on_launching(tmp_path):
    from labkit.proc import spawn

    with pytest.raises(FileNotFoundError, match="No such file or directory: .*no-such-program"):
        spawn([tmp_path / "no-such-program"])
    child = spawn(
        [sys.executable, "-c", "import os; print(os.getpgid(0) == os.getpid(), os.getsid(0))"],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = child.communicate(timeout=30)
    # a process group of its own (stop() ends the whole group), in this process's session: Linux
    # shares a busy CPU between sessions first, and replicas must not get a share each
    assert out.split() == ["True", str(os.getsid(0))]


@pytest.mark.integration
def test_spawn_and_run_pin_a_child_and_what_it_starts_to_the_cores_asked(tmp_path):
    from labkit import proc
    from labkit.hardware import pinned, usable_cores

    last = usable_cores()[-1]
    grandchild = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), "
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
        " capture_output=True, text=True).stdout.strip())"
    )
    child = proc.spawn([sys.executable, "-c", grandchild], cores=[last], stdout=subprocess.PIPE,
                       text=True)  # fmt: skip
    out, _ = child.communicate(timeout=60)
    assert out.split() == [f"[{last}]", f"[{last}]"]
    ran = proc.run([sys.executable, "-c", grandchild], timeout_s=60, cores=[last])
    assert ran.stdout.split() == [f"[{last}]", f"[{last}]"]
    before = usable_cores()
    with pinned((last,)):
        assert usable_cores() == (last,)
    assert usable_cores() == before


FAILING_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("broken on purpose"))
                for _ in requests]
"""


@pytest.mark.integration
def test_a_model_that_fails_its_warm_up_leaves_no_server_behind(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "broken", FAILING_MODEL)
    with pytest.raises(ServerError, match="broken on purpose"):
        start_server(tmp_path, repo, ["broken"])
    assert servers_of(repo) == []


def servers_of(repo: os.PathLike) -> list[psutil.Process]:
    """Live tritonservers that serve ``repo`` (not another test's, which may run beside this one)."""
    return [
        p
        for p in psutil.process_iter(["name", "cmdline", "status"])
        if p.info["name"] == "tritonserver"
        and p.info["status"] != psutil.STATUS_ZOMBIE
        and any(str(repo) in arg for arg in p.info["cmdline"] or [])
    ]


def test_free_ports_are_apart_from_each_other_and_from_the_ports_to_avoid_with_a_fake_pick(
    monkeypatch,
):
    """A fresh clone's suite failed a module's server with 'the HTTP, gRPC and metrics ports must
    differ': two picks in a row got the same free port. Picks held bound cannot repeat; one that
    lands on a port asked for is skipped, which a fake first pick makes certain."""
    from labkit import proc

    many = proc.free_ports(40)
    assert len(set(many)) == 40
    avoided = proc.free_port()
    real_bound = proc._bound
    handed = iter([avoided])
    monkeypatch.setattr(proc, "_bound", lambda host: real_bound(host, next(handed, 0)))
    picked = proc.free_ports(3, avoid={avoided})
    assert next(handed, None) is None  # the fake's pick was made, and skipped
    assert avoided not in picked
    assert len(set(picked)) == 3


def test_a_server_keeps_the_ports_asked_for_and_picks_the_rest_apart_from_them(tmp_path):
    from labkit.proc import free_port

    asked = free_port()
    server = TritonServer(tmp_path, http_port=asked, grpc_port=0, metrics_port=0)
    server._choose_ports()
    assert server.ports["http"] == asked
    assert len(set(server.ports.values())) == 3
    twice = TritonServer(tmp_path, http_port=asked, grpc_port=0, metrics_port=asked)
    with pytest.raises(ServerError, match="ports must differ"):
        twice._choose_ports()


def _aborting(monkeypatch, failures: list[Exception]) -> list[int]:
    """TritonServer._start_once raising ``failures`` in turn, then starting; returns the calls."""
    calls: list[int] = []

    def once(self):
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return self

    monkeypatch.setattr(TritonServer, "_start_once", once)
    return calls


ABORT = ServerError(
    "tritonserver exited with status -6 before it was ready.\nterminate called after throwing an "
    "instance of 'boost::interprocess::lock_exception'"
)


def test_a_server_that_aborts_starting_a_stub_is_started_once_more(tmp_path, monkeypatch):
    calls = _aborting(monkeypatch, [ABORT])
    server = TritonServer(tmp_path)
    assert server.start() is server and len(calls) == 2


@pytest.mark.parametrize(
    "failures",
    [[ABORT, ABORT], [ServerError("tritonserver exited with status 1 before it was ready.")]],
    ids=["a second abort", "another failure"],
)
def test_a_second_abort_or_another_failure_is_raised(tmp_path, monkeypatch, failures):
    calls = _aborting(monkeypatch, failures)
    with pytest.raises(ServerError, match="before it was ready"):
        TritonServer(tmp_path).start()
    assert len(calls) == len(failures)


def test_an_abort_on_the_last_attempt_after_port_races_is_raised_as_the_servers_error(
    tmp_path, monkeypatch
):
    # two picked ports taken before Triton bound them, then the abort: no attempt is left, and
    # the user sees the abort (with its log), not an internal error
    calls = _aborting(monkeypatch, [PortInUseError("taken"), PortInUseError("taken"), ABORT])
    picked = TritonServer(tmp_path, http_port=0, grpc_port=0, metrics_port=0)
    with pytest.raises(ServerError, match="lock_exception"):
        picked.start()
    assert len(calls) == 3
