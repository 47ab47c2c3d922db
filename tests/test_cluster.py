"""Replicas behind a real HAProxy: every client through it, failover under load, and nothing left.

One module-wide cluster of two Triton replicas serves a tiny Python echo model (20 ms a request),
so two replicas fit on two cores and start in seconds. The failover tests kill a replica's
``tritonserver`` and, separately, its Python stub, under a steady load through the balancer, and
assert the outcomes: the failed count (target 0), the replica leaving the pool, its replacement
joining and answering again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import wait_for, write_python_model
from labkit import client, profiling
from labkit.cluster import REPLICA_HEADER, Checks, Cluster, failover, locate_haproxy, render_config
from labkit.cluster.balancer import Target
from labkit.cluster.pool import SERVERS_ON_HOST
from labkit.errors import MissingDependencyError, ServerError
from labkit.proc import wait_until
from labkit.server import stubs

try:
    HAPROXY = str(locate_haproxy())
except MissingDependencyError:  # not on PATH nor in /usr/sbin: any other error is a failure
    HAPROXY = None

pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (make install installs Debian's haproxy)"
)

ECHO = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            time.sleep(0.02)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
"""


def echo_repository(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    write_python_model(repo, "echo", ECHO)
    return repo


def ours(marker: str) -> list[psutil.Process]:
    """Live haproxy, tritonserver or stub processes whose command line names ``marker``."""
    found = []
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            line = " ".join(process.info["cmdline"] or [])
            if process.info["status"] == psutil.STATUS_ZOMBIE or marker not in line:
                continue
            if any(
                n in (process.info["name"] or "")
                for n in ("haproxy", "tritonserver", "triton_python")
            ):
                found.append(process)
        except psutil.Error:
            continue
    return found


def post_infer(url: str, text: str = "hi") -> tuple[int, str, str]:
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    request = urllib.request.Request(
        f"http://{url}/v2/models/echo/infer", data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers.get(REPLICA_HEADER, ""), ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get(REPLICA_HEADER, ""), exc.read().decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    repo = echo_repository(root)
    cluster = Cluster(repo, 2, load_models=["echo"], run_dir=root / "run", startup_timeout_s=240)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        cluster.stop()  # twice is harmless
        assert ours(str(root)) == [], "the cluster left processes behind"


# -- the configuration -------------------------------------------------------------------------
@pytest.mark.integration  # runs haproxy -c
def test_haproxy_accepts_the_generated_configuration(tmp_path):
    targets = [Target("r0", 18000, 18001, 18100), Target("r1", 18010, 18011, 18110)]
    text = render_config(
        targets, http_port=18080, grpc_port=18081, stats_port=18082, socket_path=tmp_path / "s"
    )
    (tmp_path / "haproxy.cfg").write_text(text)
    result = subprocess.run(
        [HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "option httpchk GET /ready" in text
    assert "retry-on conn-failure empty-response junk-response 500 502 503 504" in text
    assert "server r1 127.0.0.1:18011 proto h2 track triton_http/r1" in text


# -- one address for every client --------------------------------------------------------------
@pytest.mark.integration  # the first test of the cluster: it reads the pool just started
def test_a_started_cluster_shows_every_replica_checked_up_not_initializing(cluster):
    pool = cluster.pool().set_index("replica")
    assert list(pool["lb_status"]) == ["UP", "UP"], pool[["lb_status", "lb_check"]]
    assert "Initializing" not in set(pool["lb_check"]), pool[["lb_status", "lb_check"]]


@pytest.mark.integration
def test_every_labkit_client_works_through_the_balancer(cluster):
    assert client.infer(cluster.http_url, "echo", "hello") == ["hello"]
    assert client.generate(cluster.http_url, "echo", "hi there").text == "hi there"
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(cluster.grpc_url) as grpc:
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"over grpc"], dtype=np.object_))
        assert grpc.infer("echo", [tensor]).as_numpy("text_output").tolist() == [b"over grpc"]


@pytest.mark.integration
def test_requests_are_spread_over_both_replicas(cluster):
    served = {post_infer(cluster.http_url)[1] for _ in range(12)}
    assert served == {"r0", "r1"}


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_through_the_balancer(cluster, protocol, tmp_path):
    frame = profiling.perf_analyzer(
        cluster,
        "echo",
        concurrency=2,
        protocol=protocol,
        string_data="hi",
        shapes={"text_input": [1]},
        measurement_mode="count_windows",
        measurement_request_count=20,
        stability_percentage=1000,
        max_trials=2,
        run_dir=tmp_path,
        progress=False,
    )
    assert float(frame.iloc[0]["throughput"]) > 0
    in_flight = cluster.pool()
    assert (in_flight["requests"] > 0).all()


@pytest.mark.integration
def test_a_burst_is_counted_request_for_request_in_the_spread(cluster):
    spread = cluster.spread("echo", "hi", requests=6)
    assert spread["requests sent to it"].sum() == 6, spread
    assert set(spread["replica"]) == {"r0", "r1"}
    table = cluster.pool_table()  # the notebook's view: words, no snake_case
    assert not [c for c in table.columns if "_" in c] and len(table) == 2


# -- the replicas share the host's cores -------------------------------------------------------
@pytest.mark.integration
def test_each_replicas_models_are_told_how_many_servers_share_the_cores(cluster):
    pids = [pid for r in cluster.replicas for found in stubs(r.server).values() for pid in found]
    assert len(pids) == 2  # one echo instance in each replica
    assert {psutil.Process(pid).environ().get(SERVERS_ON_HOST) for pid in pids} == {"2"}


def test_a_replica_gets_the_cluster_size_unless_the_user_sets_it(tmp_path):
    repo = echo_repository(tmp_path)
    run = tmp_path / "run"  # without one, each Cluster makes a labkit-cluster-* folder in /tmp
    assert Cluster(repo, 3, run_dir=run)._new_server(0).extra_env[SERVERS_ON_HOST] == "3"
    mine = Cluster(repo, 3, run_dir=run, server_options={"env": {SERVERS_ON_HOST: "1", "X": "y"}})
    assert mine._new_server(0).extra_env == {SERVERS_ON_HOST: "1", "X": "y"}


def test_the_cluster_sets_the_variable_the_model_code_reads():
    from labkit.repository.textgen import _settings  # the model folder's engine_settings.py

    assert _settings.SERVERS_VARIABLE == SERVERS_ON_HOST


# -- failover, measured ------------------------------------------------------------------------
@pytest.mark.integration
def test_a_killed_tritonserver_costs_no_request_and_is_replaced(cluster):
    first = cluster.replica(0).server.pid
    result = failover(cluster, "echo", fault="server", replica=0, warmup_s=1.5, settle_s=1.5)
    f = result.figures
    print(result.table().to_string())
    assert f["failed"] == 0, f["failures_by_cause"]
    # Counted in requests: the load went on through the kill, every request sent after it was
    # answered (HAProxy retried those the dead replica got until its health check took it out),
    # the other replica answered all of them while it was out, and it answered again after.
    assert f["sent_after_kill"] > 0 and f["failed_after_kill"] == 0
    assert f["answered_by_others_while_out"] > 0 and f["sent_to_it_while_out"] == 0
    assert f["answered_by_it_after_rejoin"] > 0
    # The order of events, as the cluster recorded them (no seconds compared).
    story = result.story("r0")
    assert story[0].startswith("killed tritonserver"), story
    assert story.index("out of the pool") < story.index("replacement ready"), story
    assert story.index("replacement ready") < story.index("in the pool"), story
    frame = result.requests
    assert set(frame[frame["sent_s"] < 0]["replica"]) == {"r0", "r1"}
    assert cluster.replica(0).server.pid != first and cluster.replica(0).generation >= 1
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE


@pytest.mark.integration
def test_a_killed_stub_costs_no_request_and_the_replica_rejoins_after_recover(cluster):
    result = failover(cluster, "echo", fault="stub", replica=1, warmup_s=1.5, settle_s=1.5)
    f = result.figures
    print(result.table().to_string())
    assert f["failed"] == 0, f["failures_by_cause"]
    assert f["sent_after_kill"] > 0 and f["failed_after_kill"] == 0
    # The lesson of the figure: answered by both before the kill, by r0 alone while r1 was out
    # (HAProxy sent r1 nothing while it was out, by its own count), by r1 again after.
    assert f["answered_by_others_while_out"] > 0 and f["sent_to_it_while_out"] == 0
    assert f["answered_by_it_after_rejoin"] > 0
    story = result.story("r1")  # the order of events, as the cluster recorded them
    assert story[0].startswith("killed stub"), story
    assert story.index("out of the pool") < story.index("recovered") < story.index("in the pool")
    frame = result.requests
    assert set(frame[frame["done_s"] < 0]["replica"]) == {"r0", "r1"}
    # What each probe said with the stub dead, on Triton 2.51: both of Triton's own endpoints
    # 200 while a request is refused; only the check (run as a pod runs it) saw it.
    dead = result.probes["with its stub dead"]
    assert dead["Triton's /v2/health/ready"] == dead["Triton's /v2/models/echo/ready"] == "200"
    assert "is not healthy" in dead["an inference request sent to it directly"]
    check = "ready_check.py, as a pod's readiness probe runs it"
    assert dead[check] == "exit 1: echo: 0 of 1 Python stubs alive"
    assert result.probes.loc[check, "before the kill"] == "exit 0: ready"


@pytest.mark.integration
def test_a_replica_with_a_dead_stub_leaves_the_pool_and_rejoins_after_recover(cluster):
    cluster.wait_ready(60)
    replica = cluster.replica(0)
    cluster.kill(0, "stub")
    wait_for(lambda: "r0" not in cluster.in_pool(), 10, "r0 leaving the pool")
    row = cluster.pool().set_index("replica").loc["r0"]
    assert row["lb_status"].startswith("DOWN")
    assert "echo: 0 of 1" in row["readiness"]  # the model, its stubs alive of expected
    # Triton itself still says ready, and refuses the model: the trap the readiness endpoint sees.
    with urllib.request.urlopen(f"http://{replica.server.http_url}/v2/health/ready") as response:
        assert response.status == 200
    status, _, error = post_infer(replica.server.http_url)
    assert status == 500 and "is not healthy" in error
    assert {post_infer(cluster.http_url)[:2] for _ in range(6)} == {(200, "r1")}
    assert cluster.recover(0) == ["echo"]
    wait_for(lambda: "r0" in cluster.in_pool(), 30, "r0 rejoining the pool")
    wait_for(lambda: post_infer(cluster.http_url)[1] == "r0", 10, "r0 answering again")


#: A model whose initialize waits until its folder holds a file "release" (at most 120 s): a
#: load that lasts as long as the test holds it.
HELD = "import os\nimport time\n" + ECHO.replace(
    "    def execute(",
    """    def initialize(self, args):
        release = os.path.join(args["model_repository"], "release")
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)

    def execute(""",
)


def triton_readiness(server) -> int:
    """The status of Triton's own /v2/health/ready; 0 when it does not answer within 5 s. Before,
    an unbounded request could wait out the whole held load on a loaded host (the load's 120 s
    ended first, in a fresh clone's suite), and the test read that as a load ended early."""
    try:
        url = f"http://{server.http_url}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, TimeoutError):
        return 0


@pytest.mark.integration
def test_loading_another_model_on_a_replica_keeps_it_in_the_pool(cluster):
    """Triton's /v2/health/ready answers 400 while any model loads: the check asks only for the
    models the cluster serves, so notebook 07's twins, loaded on r0, do not take it out. The
    load is held until HAProxy has checked r0 more often than it takes to mark it down.

    Whether r0 stays in the pool is asserted every time. Triton's 400 is the trap that makes the
    test able to fail with Triton's readiness as the probe; in one fresh clone's loaded suite it
    answered 200 for the whole of a held load (seen once, not reproduced alone or with its file),
    so the trap is asserted while it lasts, when it shows."""
    cluster.wait_ready(60)
    replica = cluster.replica(0)
    server = replica.server
    folder = Path(cluster.model_repository) / "held_twin"
    write_python_model(Path(cluster.model_repository), "held_twin", HELD)
    failed_checks = int(cluster.balancer.servers()["r0"]["chkfail"])
    loading = threading.Thread(target=server.load_model, args=("held_twin",))
    loading.start()
    try:
        trapped = wait_until(lambda: triton_readiness(server) == 400, 30, 0.05)
        assert loading.is_alive(), "the held load ended before its release"
        seen = replica.readiness.checks
        enough = seen + cluster.checks.fall + 1  # more than it takes to mark r0 down
        wait_for(lambda: replica.readiness.checks >= enough, 30, "HAProxy checking r0 again")
        if trapped:  # still loading: each of those checks met the trap
            assert triton_readiness(server) == 400
        view = cluster.balancer.servers()
        assert [view[r]["status"] for r in ("r0", "r1")] == ["UP", "UP"], view
        assert int(view["r0"]["chkfail"]) == failed_checks, view["r0"]  # no check failed
        wait_for(
            lambda: post_infer(cluster.http_url)[:2] == (200, "r0"), 10, "r0 answering meanwhile"
        )
    finally:
        (folder / "release").touch()
        loading.join(120)
        server.unload_model("held_twin")
        shutil.rmtree(folder, ignore_errors=True)
    assert not loading.is_alive()


# -- nothing is left ---------------------------------------------------------------------------
@pytest.mark.integration
def test_a_cluster_that_cannot_start_stops_everything_it_started(tmp_path):
    repo = echo_repository(tmp_path)
    cluster = Cluster(repo, 2, load_models=["echo", "missing"], run_dir=tmp_path / "run")
    with pytest.raises(ServerError, match=r"(?s)exited with status.*failed to load all models"):
        cluster.start()
    assert ours(str(tmp_path)) == []
    cluster.stop()


@pytest.mark.integration
def test_a_program_that_exits_without_stopping_its_cluster_leaves_nothing(tmp_path):
    repo = echo_repository(tmp_path)
    script = textwrap.dedent(
        f"""
        from labkit.cluster import Cluster
        cluster = Cluster({str(repo)!r}, 1, load_models=["echo"], run_dir={str(tmp_path / "run")!r})
        cluster.start()
        print(cluster.http_url, flush=True)
        """
    )  # no stop(): the interpreter's exit must stop HAProxy and the replica
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert ":" in result.stdout
    wait_for(lambda: ours(str(tmp_path)) == [], 20, "every process of the child's cluster ending")


@pytest.mark.integration
def test_a_killed_program_leaves_no_balancer_or_replica(tmp_path):
    repo = echo_repository(tmp_path)
    script = textwrap.dedent(
        f"""
        import time
        from labkit.cluster import Cluster
        Cluster({str(repo)!r}, 1, load_models=["echo"], run_dir={str(tmp_path / "run")!r}).start()
        print("ready", flush=True)
        time.sleep(300)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            assert len(ours(str(tmp_path))) >= 2  # haproxy and tritonserver
            os.kill(child.pid, signal.SIGKILL)  # no atexit: the parent-death signal must do it
            child.wait(timeout=30)
            wait_for(lambda: ours(str(tmp_path)) == [], 30, "the orphans ending")
        finally:
            if child.poll() is None:
                child.kill()


def test_checks_render_the_retry_policy():
    text = render_config(
        [Target("r0", 1, 2, 3)],
        http_port=4,
        grpc_port=5,
        stats_port=6,
        socket_path="/tmp/s",
        checks=Checks(interval_s=0.5, retries=1, retry_on=("conn-failure",)),
    )
    assert "retries 1" in text and "retry-on conn-failure\n" in text
    assert "inter 500ms" in text
