"""A server start that stopped moving is told from a slow one (labkit.server.stall) and started
once more (TritonServer.start): the hang CI met in notebook 04 (2026-12-05, 2 cores).

The watch's verdicts are checked on a fake process tree and a fake clock, so that they hold on a
loaded host: each reading is what the test says it is. One test reads a real process tree."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest
from test_server import _aborting

from conftest import write_python_model
from labkit.errors import ServerTimeoutError, StalledStartError
from labkit.server import TritonServer, stall
from labkit.server.stall import IDLE_CPU_S, IDLE_IO_BYTES, STALL_S, StallWatch, models_still_loading

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


# -- the watch on a fake tree: a server (pid 100) and its stub (pid 101) ------------------------
class FakeTree:
    """Stands in for psutil.Process in labkit.server.stall: each process's CPU seconds and the
    bytes it read and wrote are what the test sets; a pid not in ``processes`` has ended."""

    def __init__(self) -> None:
        self.processes = {100: {"cpu": 0.0, "io": 0}, 101: {"cpu": 0.0, "io": 0}}
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def process(self, pid: int):
        if pid not in self.processes:
            raise psutil.NoSuchProcess(pid)
        tree, state = self, self.processes[pid]

        class Process:
            def __init__(self) -> None:
                self.pid = pid

            def children(self, recursive: bool = False):
                return [tree.process(p) for p in tree.processes if p != 100] if pid == 100 else []

            def cpu_times(self):
                return SimpleNamespace(user=state["cpu"], system=0.0)

            def io_counters(self):
                return SimpleNamespace(read_chars=0, write_chars=state["io"])

        return Process()

    def run(self, watch: StallWatch, seconds: float, *, cpu_s: float = 0.0, io_bytes: int = 0):
        """Poll ``watch`` every 5 s for ``seconds`` while each stub spends ``cpu_s`` and writes
        ``io_bytes`` each second; the moment of the first stall, else None."""
        for _ in range(int(seconds / 5)):
            self.now += 5
            for stub in [state for pid, state in self.processes.items() if pid != 100]:
                stub["cpu"] += 5 * cpu_s
                stub["io"] += 5 * io_bytes
            if watch.stalled():
                return self.now
        return None


@pytest.fixture
def tree(monkeypatch) -> FakeTree:
    fake = FakeTree()
    # stall's own name for psutil, not psutil's attribute: the real psutil.Process stays for
    # every other thread in this worker (tests/crashwatch.py samples this process's children)
    fake_psutil = SimpleNamespace(Process=fake.process, Error=psutil.Error)
    monkeypatch.setattr(stall, "psutil", fake_psutil)
    return fake


def test_a_tree_with_no_cpu_no_io_and_a_still_log_is_stalled_after_stall_s(tree, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("start\n")
    watch = StallWatch(100, log, clock=tree.clock)
    # a little CPU (a ready server's own, a stub's idle threads): still idle
    assert tree.run(watch, 600, cpu_s=0.5 * IDLE_CPU_S / STALL_S) == STALL_S


def test_cpu_spent_or_a_line_logged_is_work(tree, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("start\n")
    busy = StallWatch(100, log, clock=tree.clock)
    assert tree.run(busy, 600, cpu_s=2 * IDLE_CPU_S / STALL_S) is None  # a stub importing torch
    logged = StallWatch(100, log, clock=tree.clock)
    assert tree.run(logged, STALL_S - 5) is None
    log.write_text("start\na line\n")
    assert not logged.stalled()  # the log grew: idle time starts again
    grew = tree.now
    assert tree.run(logged, 2 * STALL_S) == grew + STALL_S


def test_a_model_that_downloads_for_minutes_without_a_line_or_cpu_is_not_stalled(tree):
    """A stub downloading its weights in initialize: under 1 CPU-second in 120 s and no log
    line, for 10 minutes, at 50 KB/s into the hub's cache. Before, it was taken for a stall at
    120 s and its server started again, the download with it."""
    watch = StallWatch(100, None, clock=tree.clock)
    assert tree.run(watch, 600, cpu_s=0.005, io_bytes=50_000) is None
    # a download that stopped receiving is a stall, at most STALL_S after its last bytes
    stopped = tree.now
    assert stopped < tree.run(watch, 600, cpu_s=0.005) <= stopped + STALL_S
    # slower than IDLE_IO_BYTES a stall_s: as good as stopped
    slow = StallWatch(100, None, clock=tree.clock)
    started = tree.now
    assert tree.run(slow, 600, io_bytes=IDLE_IO_BYTES // int(2 * STALL_S)) == started + STALL_S


def test_a_process_that_came_or_went_is_work(tree):
    watch = StallWatch(100, None, clock=tree.clock)
    assert tree.run(watch, STALL_S - 5) is None
    del tree.processes[101]  # the stub ended (a crash, or a model's load that failed)
    assert not watch.stalled()
    tree.processes[102] = {"cpu": 0.0, "io": 0}  # a new stub
    assert tree.run(watch, 5) is None
    gone = StallWatch(10**7, None, clock=tree.clock)  # no such process: nothing moves
    started = tree.now
    assert tree.run(gone, 2 * STALL_S) == started + STALL_S


# -- a real tree -------------------------------------------------------------------------------
#: A child that starts a grandchild, spends 0.3 CPU-seconds, writes 2 MB, says so, and waits.
WORKS_THEN_WAITS = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
while time.process_time() < 0.3:
    pass
with open(sys.argv[1], "wb") as out:
    out.write(b"x" * 2_000_000)
print(grandchild.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.integration  # starts processes
def test_a_sample_of_a_real_tree_holds_its_processes_cpu_and_bytes_written(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", WORKS_THEN_WAITS, str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        grandchild = int(child.stdout.readline())  # the child says when its work is done
        seen = stall.sample(child.pid, None)
        assert {child.pid, grandchild} <= seen.pids
        assert seen.cpu_s >= 0.3 and seen.io_bytes >= 2_000_000, seen
    finally:
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        child.wait()
        child.stdout.close()


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
