"""The readiness check the lab's balancer and a pod's probe share (labkit/cluster/ready_check.py),
against a stand-in Triton (a thread answering its HTTP endpoints) and a stand-in ``/proc``; and
the failover experiment's tables, in words. No process is started: the real check against a real
Triton, a real dead stub and a real HAProxy is in test_cluster.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from labkit.cluster import ready_check
from labkit.cluster.failover import FailoverResult, failover_table
from labkit.repository.textgen import instance_count

STUB = "/opt/tritonserver/backends/python/triton_python_backend_stub"


class FakeTriton:
    """Triton's endpoints the check reads: ``ready`` maps each model to its /ready status,
    ``configs`` to its served config, and ``index_loading`` lists models still loading."""

    def __init__(self, ready: dict[str, int], configs: dict[str, dict], live: int = 200) -> None:
        self.ready, self.configs, self.live = ready, configs, live
        self.loading: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: object = "") -> None:
                data = json.dumps(body).encode() if body != "" else b""
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if self.path == "/v2/health/live":
                    return self._send(fake.live)
                if len(parts) == 4 and parts[3] == "ready":
                    return self._send(fake.ready.get(parts[2], 400))
                if len(parts) == 4 and parts[3] == "config":
                    return self._send(200, fake.configs[parts[2]])
                return self._send(404)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rows = [{"name": m, "state": "READY"} for m in fake.ready]
                rows += [{"name": m, "state": "LOADING"} for m in fake.loading]
                return self._send(200, rows)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fake_proc(root: Path, processes: list[tuple[int, int, str, list[str]]]) -> Path:
    """A ``/proc`` of (pid, ppid, state, argv) entries, as the check reads them."""
    for pid, ppid, state, argv in processes:
        folder = root / str(pid)
        folder.mkdir(parents=True)
        (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (folder / "stat").write_text(f"{pid} (triton_python_b) {state} {ppid} 1 1 0")
    (root / "self").mkdir(parents=True)
    return root


def stub(model: str) -> list[str]:
    return [STUB, f"/models/{model}/1/model.py", "triton_python_backend_shm_region_1", "1048576"]


PYTHON = {"backend": "python", "instance_group": [{"count": 2, "kind": "KIND_CPU"}]}


@pytest.fixture
def triton():
    fake = FakeTriton({"echo": 200, "onnx": 200}, {"echo": PYTHON, "onnx": {"backend": "onnx"}})
    yield fake
    fake.close()


def test_stubs_are_counted_per_model_without_zombies_and_by_parent(tmp_path):
    proc = fake_proc(
        tmp_path / "proc",
        [
            (10, 1, "S", ["tritonserver", "--model-repository=/models"]),
            (11, 10, "S", stub("echo")),
            (12, 10, "S", stub("echo")),
            (13, 10, "Z", stub("other")),  # a killed stub its parent has not reaped
            (14, 99, "S", stub("other")),  # another server's
            (15, 10, "S", ["python3", "/models/echo/1/model.py"]),
        ],
    )
    assert ready_check.live_stubs(proc=str(proc)) == {"echo": 2, "other": 1}
    assert ready_check.live_stubs(10, proc=str(proc)) == {"echo": 2}


@pytest.mark.parametrize(
    "config",
    [{}, {"instance_group": [{"count": 3, "kind": "KIND_CPU"}]},
     {"instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}, {"count": 1}]}],
)  # fmt: skip
def test_instances_are_counted_as_the_text_models_rule_counts_them(config):
    assert ready_check.instance_count(config) == instance_count(config)


def test_a_server_with_every_stub_alive_is_ready_and_live(tmp_path, triton):
    proc = fake_proc(tmp_path / "proc", [(11, 10, "S", stub("echo")), (12, 10, "S", stub("echo"))])
    assert ready_check.check(triton.url, proc=str(proc)) == (True, "ready")
    assert ready_check.check(triton.url, ["echo"], server_pid=10, proc=str(proc)) == (True, "ready")
    assert ready_check.check(triton.url, live=True, proc=str(proc)) == (True, "live")


def test_another_model_loading_does_not_make_a_served_model_unready(tmp_path, triton):
    triton.loading = ["echo_one"]  # Triton 2.51's /v2/health/ready answers 400 meanwhile
    proc = fake_proc(tmp_path / "proc", [(11, 10, "S", stub("echo")), (12, 10, "S", stub("echo"))])
    assert ready_check.check(triton.url, ["echo"], proc=str(proc)) == (True, "ready")


def test_a_dead_stub_makes_the_server_unready_and_not_live(tmp_path, triton):
    proc = fake_proc(tmp_path / "proc", [(11, 10, "S", stub("echo")), (12, 10, "Z", stub("echo"))])
    said = (False, "echo: 1 of 2 Python stubs alive")
    assert ready_check.check(triton.url, proc=str(proc)) == said
    assert ready_check.check(triton.url, live=True, proc=str(proc)) == said


def test_a_model_triton_calls_unready_is_named_with_its_answer(tmp_path, triton):
    triton.ready["echo"] = 400  # NGC 26.01 on: the model's own /ready sees a dead stub
    proc = fake_proc(tmp_path / "proc", [])
    assert ready_check.check(triton.url, ["echo"], proc=str(proc)) == (
        False,
        "echo: /v2/models/echo/ready answered 400",
    )


def test_a_server_that_does_not_answer_is_neither(tmp_path, triton):
    triton.close()
    ready, reason = ready_check.check(triton.url, ["echo"], proc=str(tmp_path))
    assert not ready and reason.startswith(f"cannot ask {triton.url}")


def test_the_command_prints_the_reason_and_exits_1_when_not_ready(tmp_path, triton, capsys):
    triton.ready["echo"] = 400
    assert ready_check.main(["--url", triton.url, "--model", "echo"]) == 1
    assert capsys.readouterr().out == "echo: /v2/models/echo/ready answered 400\n"


# -- the failover experiment's tables, in words ------------------------------------------------
def result(kind: str) -> FailoverResult:
    figures = {
        "fault": f"SIGKILL of r0's {'tritonserver' if kind == 'server' else 'Python stub'}",
        "fault_kind": kind, "replica": "r0", "replicas": 2, "rate_per_s": 4.0, "requests": 109,
        "answered": 109, "failed": 0, "failures_by_cause": {}, "sent_after_kill": 96,
        "failed_after_kill": 0, "sent_until_out_of_pool": 1, "answered_by_others_while_out": 81,
        "s_to_leave_pool": 0.3, "s_to_repaired": 20.5, "s_to_rejoin_pool": 20.6,
        "s_to_first_answer_after_rejoin": 21.0, "sent_to_it_while_out": 0,
        "answered_by_it_after_rejoin": 7, "load_average_before": [1.4, 1.0, 0.5],
        "load_average_after": [1.5, 1.0, 0.5], "cpu_count": 2,
    }  # fmt: skip
    changes = pd.DataFrame(
        {"t_s": [-3.0, 0.3, 20.6], "replica": "r0", "status": ["UP", "DOWN", "UP"]}
    )
    return FailoverResult(figures, pd.DataFrame(), changes, pd.DataFrame())


def test_the_failover_tables_read_in_words_with_units():
    table = failover_table(result("server"), result("stub"))
    assert list(table.columns) == ["tritonserver killed", "stub killed"]
    assert not [row for row in table.index if "_" in row]
    assert table.loc["requests failed", "stub killed"] == 0
    assert table.loc["seconds from the kill until it was repaired", "stub killed"] == 20.5
    assert table.loc["host load average over 1 minute, before and after", "stub killed"] == (
        "1.4 and 1.5 on 2 cores"
    )
    pool = result("stub").pool_table()
    assert list(pool.columns) == ["fault", "seconds since the kill", "replica", "HAProxy's view"]
    assert list(pool["HAProxy's view"]) == ["in the pool", "out of the pool (DOWN)", "in the pool"]
