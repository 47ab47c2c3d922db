"""Faults, each provoked for real: a stub killed under load (a model's, and a pipeline step's), a
model reloaded under load, SIGTERM
while a model loads, a notebook kernel killed while its server runs, a run folder on a read-only or
full disk.

What Triton 2.51 does when a Python stub dies (observed, and pinned by the first test): it does
not restart the stub. The model stays READY in the repository index and on
``/v2/models/<m>/ready``, and every request to it is refused at once with
``Stub process '<m>_0' is not healthy.`` until the model is reloaded. :func:`labkit.server.
unhealthy` finds such models and :func:`labkit.server.recover` reloads them.

A port taken between choosing it and binding it is tested in tests/test_server.py
(``test_port_taken_between_choosing_and_binding_names_the_port_with_a_fake_port_check``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import group_alive, wait_for, write_notebook, write_python_model
from labkit import pipeline, repository
from labkit.cli import main
from labkit.errors import ServerError
from labkit.load import Load
from labkit.repository import Repository
from labkit.server import index, recover, reload, served_config, stubs, unhealthy

ROOT = Path(__file__).resolve().parent.parent


def stub_regions(pid: int) -> list[str]:
    """The shared-memory files named on the command lines of a server's stubs."""
    names = []
    for child in psutil.Process(pid).children():
        names += [f"/dev/shm/{a}" for a in child.cmdline() if a.startswith("triton_python_backend")]
    return names


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    """``tf`` (its stub gets killed) and ``tfr`` (reloaded under load): tiny Falcon, no batching."""
    repo = tmp_path_factory.mktemp("faults") / "repo"
    repo.mkdir()
    repository.add_model(repo, "tiny-falcon", name="tf", max_tokens=4)
    repository.add_model(repo, "tiny-falcon", name="tfr", max_tokens=4)
    repository.prepare_repository(repo)
    return start_module_server(repo)


@pytest.mark.integration
def test_a_model_reloaded_under_load_fails_no_request(server, record_property):
    before = stubs(server)["tfr"]
    config = Repository(server.model_repository).config("tfr")
    config.parameters["max_tokens"].string_value = "3"
    with Load(server.http_url, "tfr", max_tokens=2) as load:
        wait_for(lambda: load.successes() >= 4, 60, "4 answers before the reload")
        started = time.monotonic()
        reload(server, "tfr", config)
        reloaded = time.monotonic()
        wait_for(lambda: load.successes(reloaded) >= 4, 60, "answers after the reload")
    assert load.failures() == []
    assert served_config(server, "tfr")["parameters"]["max_tokens"]["string_value"] == "3"
    assert stubs(server)["tfr"] != before  # a new instance really replaced the old one
    record_property("requests_during_reload", load.successes(started) - load.successes(reloaded))
    record_property("reload_seconds", round(reloaded - started, 1))


@pytest.mark.integration
def test_a_stub_killed_under_load_is_named_and_recover_brings_the_model_back(
    server, record_property
):
    (victim,) = stubs(server)["tf"]
    load = Load(server.http_url, "tf", max_tokens=2)
    neighbour = Load(server.http_url, "tfr", max_tokens=2, concurrency=1)
    with load, neighbour:
        wait_for(lambda: load.successes() >= 4, 60, "4 answers before the kill")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(load.failures(killed)) >= 4, 30, "refusals after the kill")
        # Triton's view: still READY, so only the stub processes tell what happened.
        assert index(server).set_index("name").loc["tf", "state"] == "READY"
        assert unhealthy(server) == {"tf": "0 of 1 Python stub processes alive"}
        recovering = time.monotonic()
        assert recover(server) == ["tf"]
        recovered = time.monotonic()
        wait_for(lambda: load.successes(recovered) >= 4, 60, "answers after recover()")
    failures = load.failures(killed)
    assert {o.error for o in failures} == {"Stub process 'tf_0' is not healthy."}
    assert {o.status for o in failures} == {400}
    assert load.failures(recovered) == []  # sent after recover() returned: all answered
    assert neighbour.failures() == [] and neighbour.successes(killed) > 0
    assert unhealthy(server) == {} and stubs(server)["tf"] != [victim]
    record_property("requests_refused_while_the_stub_was_dead", len(failures))
    record_property("recover_seconds", round(recovered - recovering, 1))


@pytest.mark.integration
def test_the_encoder_steps_stub_killed_under_load_fails_the_pipeline_by_name_until_recover(
    tmp_path, start_server, record_property
):
    """The ensemble's encoder step loses its stub while clients keep sending: every request is
    answered at once with an error that names the step, and recover() restarts the step alone."""
    repo = tmp_path / "repo"
    for name in (pipeline.TOKENIZER, pipeline.ENCODER, pipeline.PIPELINE):
        shutil.copytree(ROOT / "model_repository" / name, repo / name)  # links followed
    server = start_server(repo, load_models=[pipeline.PIPELINE])  # loads its steps with it
    (victim,) = stubs(server)[pipeline.ENCODER]
    tokenizer = stubs(server)[pipeline.TOKENIZER]
    load = Load(server.http_url, pipeline.PIPELINE, endpoint="infer", prompt="A sentence.")
    with load:
        wait_for(lambda: load.successes() >= 4, 60, "4 embeddings before the kill")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(load.failures(killed)) >= 4, 30, "refusals after the kill")
        assert unhealthy(server) == {pipeline.ENCODER: "0 of 1 Python stub processes alive"}
        recovering = time.monotonic()
        assert recover(server) == [pipeline.ENCODER]
        recovered = time.monotonic()
        wait_for(lambda: load.successes(recovered) >= 4, 60, "embeddings after recover()")
    failures = load.failures(killed)
    # the step by name (its instance group, then the instance); 500 where the model alone says 400
    step = f"Stub process '{pipeline.ENCODER}_0_0' is not healthy."
    assert {o.error for o in failures} == {f"in ensemble '{pipeline.PIPELINE}', {step}"}
    assert {o.status for o in failures} == {500}
    # Never left waiting: a request the dead stub had taken fails when the Python backend gives
    # up on the stub (its stub timeout, 30 s; 39 s seen on this loaded host), the rest within
    # its health checks of a second each (1.0 s and 6.3 s in a fresh clone's make test: how
    # many checks a request waits depends on the host's load, so only the bound is asserted)
    waits = sorted(o.latency_s for o in failures)
    assert waits[-1] < 60, waits
    assert load.failures(recovered) == []
    assert unhealthy(server) == {} and stubs(server)[pipeline.ENCODER] != [victim]
    assert stubs(server)[pipeline.TOKENIZER] == tokenizer  # the other step kept its stub
    pgid = server.pid
    server.stop()
    assert not group_alive(pgid)  # nothing left running: the server, both steps' stubs
    record_property("pipeline_requests_refused_while_the_step_was_dead", len(failures))
    record_property("pipeline_errors", sorted({o.cause for o in failures}))
    record_property("recover_seconds", round(recovered - recovering, 1))
    record_property("longest_refusal_seconds", round(waits[-1], 1))
    record_property("median_refusal_seconds", round(waits[len(waits) // 2], 1))


IDLE_MODEL = "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"


@pytest.mark.integration
def test_stop_removes_the_shared_memory_a_killed_stub_left_behind(tmp_path, start_server):
    repo = tmp_path / "repo"
    write_python_model(repo, "idle", IDLE_MODEL)
    server = start_server(repo)
    (victim,) = stubs(server)["idle"]
    region = [f"/dev/shm/{a}" for a in psutil.Process(victim).cmdline() if "shm_region" in a]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: unhealthy(server), 30, "Triton's stub count to show the killed stub")
    assert region and all(os.path.exists(r) for r in region)  # left behind by the dead stub
    server.stop()
    assert not any(os.path.exists(r) for r in region)


# an engine's segment (vLLM's message queues are psm_ files): made, named, never unlinked
SEGMENT_MODEL = """
import os
from multiprocessing import resource_tracker, shared_memory

class TritonPythonModel:
    def initialize(self, args):
        self.segment = shared_memory.SharedMemory(create=True, size=1 << 20)
        resource_tracker.unregister(self.segment._name, "shared_memory")  # as if killed
        with open(os.path.join(args["model_repository"], "segment"), "w") as f:
            f.write(self.segment.name)

    def execute(self, requests):
        return []
"""


@pytest.mark.integration
def test_stop_removes_the_shared_memory_an_engine_under_a_stub_left_behind(tmp_path, start_server):
    repo = tmp_path / "repo"
    write_python_model(repo, "engine", SEGMENT_MODEL)
    server = start_server(repo)
    segment = Path("/dev/shm") / (repo / "engine" / "segment").read_text()
    assert segment.name.startswith("psm_") and segment.exists()
    server.stop()
    assert not segment.exists()


SLOW_MODEL = """
import time

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(300)

    def execute(self, requests):
        return []
"""


@pytest.mark.integration
def test_sigterm_while_a_model_loads_ends_the_server_and_leaves_nothing(tmp_path, start_server):
    repo = tmp_path / "repo"
    write_python_model(repo, "slow", SLOW_MODEL)
    server = start_server.new(repo)
    failure: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            failure.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    try:
        wait_for(lambda: server.pid and stub_regions(server.pid), 60, "the slow model's stub")
        pgid, regions = server.pid, stub_regions(server.pid)
        os.kill(pgid, signal.SIGTERM)  # what `kill <pid>` does: the server alone, mid-load
        starter.join(timeout=60)
        assert not starter.is_alive()
    finally:
        server.stop()
        starter.join()
    assert len(failure) == 1 and isinstance(failure[0], ServerError)
    assert "exited with status" in str(failure[0]) and "before it was ready" in str(failure[0])
    wait_for(lambda: not group_alive(pgid), 15, "the end of the server's process group")
    assert not any(os.path.exists(r) for r in regions)


KERNEL_CODE = """
from labkit.server import TritonServer
server = TritonServer({repo!r}, http_port=0, grpc_port=0, metrics_port=0,
                      log_path={log!r}, startup_timeout_s=120).start()
print("SERVER", server.pid, "KERNEL", __import__("os").getpid())
"""


@pytest.mark.integration
def test_a_killed_notebook_kernel_leaves_no_server(tmp_path):
    from jupyter_client.manager import start_new_kernel

    repo = tmp_path / "repo"
    write_python_model(repo, "idle", IDLE_MODEL)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    manager, kernel = start_new_kernel(kernel_name="python3", env=env)
    server_pid = None
    try:
        code = KERNEL_CODE.format(repo=str(repo), log=str(tmp_path / "tritonserver.log"))
        printed = []
        reply = kernel.execute_interactive(
            code,
            timeout=180,
            output_hook=lambda m: printed.append(m["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        words = "".join(printed).split()
        server_pid, kernel_pid = int(words[1]), int(words[3])
        assert group_alive(server_pid)
        os.kill(kernel_pid, signal.SIGKILL)
        wait_for(lambda: not group_alive(server_pid), 45, "the end of the kernel's server")
    finally:
        kernel.stop_channels()
        manager.shutdown_kernel(now=True)
        for proc in group_alive(server_pid) if server_pid else []:
            proc.kill()  # clean up before failing, so a failure leaves nothing running


@pytest.fixture
def mounted(tmp_path):
    """``mounted(options)``: a fresh tmpfs mounted with ``options``; unmounted afterwards."""
    points = []

    def mount(options: str) -> Path:
        point = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        points.append(point)
        return point

    yield mount
    for point in points:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


@pytest.mark.integration
def test_a_read_only_run_folder_is_a_clear_error_before_any_notebook_runs(
    tmp_path, mounted, capsys
):
    read_only = mounted("ro,size=1m")
    code = main(["run", "00", "--out", str(read_only / "run")])
    error = capsys.readouterr().err
    assert code == 2
    assert f"run folder {str(read_only / 'run')!r} cannot be written" in error
    assert "Read-only file system" in error and "pass --out a folder you can write" in error
    assert "Traceback" not in error


@pytest.mark.integration
def test_a_full_disk_fails_the_run_with_a_clear_error(tmp_path, mounted, capsys):
    full = mounted("size=256k")
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(folder / "big.ipynb", "print('x' * 400_000)")  # its output does not fit
    code = main(
        ["run", str(folder / "big.ipynb"), "--out", str(full / "run"), "--cell-timeout", "60"]
    )
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code != 0
    assert "No space left on device" in text and str(full / "run") in text
    assert "Traceback" not in captured.err
