"""A server start that stopped moving is told from a slow one (labkit.server.stall) and started
once more (TritonServer.start): the hang CI met in notebook 04 (stop 45)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_server import _aborting

from conftest import write_python_model
from labkit.errors import ServerTimeoutError, StalledStartError
from labkit.server import TritonServer
from labkit.server.stall import StallWatch, models_still_loading

# The end of CI's log: three models loading, two loaded, smollm2_config_2 never
CI_LOG = """\
I1205 10:49:16.986724 6778 model_lifecycle.cc:472] "loading: smollm2_config_2:1"
I1205 10:49:16.986795 6778 model_lifecycle.cc:472] "loading: smollm2:1"
I1205 10:49:16.986829 6778 model_lifecycle.cc:472] "loading: smollm2_config_0:1"
I1205 10:49:55.811587 6778 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: smollm2_config_2_0_0 (CPU device 0)"
I1205 10:51:04.809041 6778 model_lifecycle.cc:839] "successfully loaded 'smollm2'"
I1205 10:51:04.830685 6778 model_lifecycle.cc:839] "successfully loaded 'smollm2_config_0'"
"""


def test_the_models_a_log_shows_loading_and_never_loaded_or_failed_are_named():
    assert models_still_loading(CI_LOG) == ["smollm2_config_2"]
    failed = (
        CI_LOG + "E1205 6778 model_lifecycle.cc:641] \"failed to load 'smollm2_config_2': x\"\n"
    )
    assert models_still_loading(failed) == []
    assert models_still_loading("") == []


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.integration
def test_an_idle_process_with_a_still_log_is_stalled_and_a_busy_one_or_a_growing_log_is_not(
    tmp_path,
):
    log = tmp_path / "server.log"
    log.write_text("start\n")
    idle = _child("import time; time.sleep(60)")
    busy = _child("while True: pass")
    try:
        time.sleep(1.0)  # both started: the interpreter's own start is work too
        watches = {
            name: StallWatch(p.pid, log, stall_s=1.5, idle_cpu_s=0.5)
            for name, p in (("idle", idle), ("busy", busy))
        }
        assert not any(w.stalled() for w in watches.values())  # too early for either
        time.sleep(2.0)
        assert watches["idle"].stalled()
        assert not watches["busy"].stalled()  # it spent about 2 s of CPU
        growing = StallWatch(idle.pid, log, stall_s=1.5, idle_cpu_s=0.5)
        time.sleep(2.0)
        log.write_text("start\na line\n")
        assert not growing.stalled()  # the log grew: a sign of work
    finally:
        for p in (idle, busy):
            p.kill()
            p.wait()


@pytest.mark.integration
def test_a_watch_counts_a_process_that_came_or_went_as_work(tmp_path):
    clock = [0.0]
    watch = StallWatch(10**7, None, stall_s=10, clock=lambda: clock[0])  # no such process
    clock[0] = 11.0
    assert watch.stalled()  # nothing there, nothing moved: stalled
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"]) as child:
        try:
            other = StallWatch(child.pid, None, stall_s=10, clock=lambda: clock[0])
            child.kill()
            child.wait()
            clock[0] = 30.0
            assert not other.stalled()  # the process went: the tree changed
        finally:
            child.kill()


STALL = StalledStartError("tritonserver stopped moving while starting: ...")


def test_a_start_that_stalls_is_started_once_more(tmp_path, monkeypatch):
    calls = _aborting(monkeypatch, [STALL])
    server = TritonServer(tmp_path)
    assert server.start() is server and len(calls) == 2


def test_a_second_stall_is_raised_as_a_timeout_naming_it(tmp_path, monkeypatch):
    calls = _aborting(monkeypatch, [STALL, STALL])
    with pytest.raises(ServerTimeoutError, match="stopped moving"):
        TritonServer(tmp_path).start()
    assert len(calls) == 2


# initialize hangs without work (no CPU, no log line) the first time, as the server in CI did
HANGS_ONCE = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        marker = os.path.join(args["model_repository"], "started-once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(3600)

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([b"ok"], np.object_))])
            for _ in requests
        ]
"""


@pytest.mark.integration
def test_a_real_server_whose_model_hangs_loading_is_started_again_and_serves(
    tmp_path, start_server, caplog
):
    from labkit import client

    repo = tmp_path / "repo"
    write_python_model(repo, "hangs_once", HANGS_ONCE)
    with caplog.at_level("WARNING", logger="labkit"):
        server = start_server(repo, stall_s=8)
    warned = [r.getMessage() for r in caplog.records if "stopped moving" in r.getMessage()]
    assert len(warned) == 1 and "'hangs_once' still loading" in warned[0], warned
    assert "starting it again" in warned[0]
    assert client.generate(server.http_url, "hangs_once", "hi").text == "ok"
