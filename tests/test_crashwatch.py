"""The crash watch reads Triton's crashes out of kernel log records, and names the test."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import crashwatch
import psutil
import pytest

from conftest import wait_for
from labkit import repository, streaming


def test_a_stub_and_a_server_segfault_are_found_and_other_records_are_not():
    records = [
        "6,101,5000,-;triton_python_b[8384]: segfault at 7f75895000c8 ip 00007f758a8aa370 sp "
        "00007ffd error 4 in libc.so.6[8c370,7f758a846000+156000] likely on CPU 1\n SUBSYSTEM=x",
        "4,102,5001,-;tritonserver[77]: segfault at 0 ip 0 sp 0 error 6 in libstdc++.so.6",
        "6,103,5002,-;python3[99]: segfault at 0 ip 0 error 4 in libc.so.6",
        "6,104,5003,-;EXT4-fs (vda): mounted filesystem",
    ]
    found = crashwatch.parse(records)
    assert [(process, pid) for process, pid, _ in found] == [
        ("triton_python_b", 8384),
        ("tritonserver", 77),
    ]
    assert found[0][2].startswith("triton_python_b[8384]: segfault at 7f75895000c8")


def test_the_summary_counts_each_tests_crashes_across_workers(tmp_path):
    rows = [
        {"test": "tests/a.py::t", "worker": "gw0", "process": "triton_python_b", "pid": 1},
        {"test": "tests/a.py::t", "worker": "gw0", "process": "triton_python_b", "pid": 2},
        {"test": "tests/b.py::u", "worker": "gw1", "process": "tritonserver", "pid": 3},
        {"test": "tests/b.py::u", "worker": "gw0", "process": "tritonserver", "pid": 3},
        {"test": "tests/c.py::v", "worker": "gw1", "process": "triton_python_b", "pid": 4}
        | {"outcome": "known", "why": "Triton's own"},
        {"test": "tests/d.py::w", "worker": "gw0", "process": "triton_python_b", "pid": 4}
        | {"own": False},
    ]
    for row in rows:
        with open(tmp_path / f"{row['worker']}.jsonl", "a") as out:
            out.write(json.dumps(row | {"line": "x"}) + "\n")
    assert crashwatch.summary(tmp_path) == [
        "2 x triton_python_b in tests/a.py::t [report]",
        "1 x tritonserver in tests/b.py::u [report]",
        "1 x triton_python_b in tests/c.py::v [known]",
        "    known: Triton's own",
        "1 x triton_python_b in tests/d.py::w [another worker's or the host's]",
    ]
    assert crashwatch.summary(tmp_path / "none") == []


# -- the verdict: what fails, what is known, what is only reported -----------------------------
FREED = (
    "triton_python_b[12627]: segfault at 7f1c1b2200c8 ip 00007f1c1b6aa370 sp 00007ffc896a2c68 "
    "error 4 in libc.so.6[8c370,7f1c1b644000+156000] likely on CPU 1 (core 1, socket 0)"
)
GONE = (
    "triton_python_b[9139]: segfault at 7ff6f5220220 ip 00007ff6f56aebb4 sp 00007ffed6dc36d0 "
    "error 6 in libc.so.6[90bb4,7ff6f5644000+156000] likely on CPU 1 (core 1, socket 0)"
)
OTHER = "tritonserver[77]: segfault at 0 ip 0 sp 0 error 6 in libstdc++.so.6[a0000,7f00+1000]"
KILLED_SERVER_TEST = (
    "tests/test_cluster.py::test_a_killed_tritonserver_costs_no_request_and_is_replaced"
)


def test_a_sender_freed_after_the_stubs_memory_fails_wherever_it_happens():
    assert crashwatch.kind_of(FREED) == crashwatch.FREED_AFTER_UNMAP
    for test in ("tests/test_streaming.py::t", KILLED_SERVER_TEST):
        outcome, why = crashwatch.verdict(test, FREED)
        assert outcome == "fail" and "reference cycle" in why and "gc.collect()" in why


def test_a_stub_whose_server_died_is_known_only_where_a_test_kills_the_server():
    assert crashwatch.kind_of(GONE) == crashwatch.SERVER_GONE
    outcome, why = crashwatch.verdict(KILLED_SERVER_TEST, GONE)
    assert outcome == "known" and "SIGKILLs a replica's tritonserver" in why and "#7875" in why
    outcome, _ = crashwatch.verdict(
        "notebooks/04_model_analyzer.ipynb::04_model_analyzer.ipynb", GONE
    )
    assert outcome == "known"
    # elsewhere: reported by default, failed under LABKIT_CRASH_CHECK=strict
    assert crashwatch.verdict("tests/test_streaming.py::t", GONE)[0] == "report"
    outcome, why = crashwatch.verdict("tests/test_streaming.py::t", GONE, strict=True)
    assert outcome == "fail" and "not listed in crashwatch.KNOWN" in why
    assert crashwatch.verdict("tests/test_doctor.py::t", OTHER) == (
        "report",
        "a crash of an unknown kind, not listed in crashwatch.KNOWN",
    )
    assert crashwatch.verdict("tests/test_doctor.py::t", OTHER, strict=True)[0] == "fail"


def test_every_known_case_names_a_crash_kind_and_a_reason():
    for known in crashwatch.KNOWN:
        assert known.kind in crashwatch.KINDS and len(known.reason) > 40, known
        assert known.kind != crashwatch.FREED_AFTER_UNMAP  # ours to fix, never allowed


# -- the watch itself, on a kernel log written by the test -------------------------------------
def watch_on(tmp_path, own_pids: set[int], mode: str = ""):
    """A CrashWatch reading ``kmsg`` (a file the test appends kernel records to), whose worker
    started the processes ``own_pids``."""
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,1,-;before the watch: not read\n")
    own = crashwatch.Descendants()  # not started: it holds only what the test adds
    own.seen |= own_pids
    config = SimpleNamespace(rootpath=tmp_path)
    watch = crashwatch.CrashWatch(config, crashwatch.KernelLog(str(kmsg)), own)
    watch.mode = mode  # LABKIT_CRASH_CHECK's value
    return watch, kmsg


def teardown_of(watch, nodeid: str, outcome: str = "passed"):
    """What the watch makes of ``nodeid``'s teardown report."""
    report = pytest.TestReport(nodeid, ("x.py", 0, nodeid), {}, outcome, None, "teardown")
    hook = watch.pytest_runtest_makereport(SimpleNamespace(nodeid=nodeid), None)
    next(hook)
    with pytest.raises(StopIteration, match=re.escape(repr(nodeid))) as done:  # its report
        hook.send(report)
    return done.value.value


def test_a_crash_of_the_tests_own_stub_fails_its_teardown_naming_the_crash(tmp_path):
    watch, kmsg = watch_on(tmp_path, {12627})
    with open(kmsg, "a") as log:
        log.write(f"6,2,2,-;{FREED}\n")
    report = teardown_of(watch, "tests/test_streaming.py::test_x")
    assert report.failed and "a Triton process of this test crashed" in report.longrepr
    assert "triton_python_b[12627]" in report.longrepr and "reference cycle" in report.longrepr
    kept = json.loads((tmp_path / crashwatch.CRASH_DIR / "main.jsonl").read_text())
    assert kept["test"] == "tests/test_streaming.py::test_x" and kept["outcome"] == "fail"
    # read once: the next test's teardown does not see it again
    assert teardown_of(watch, "tests/test_streaming.py::test_y").passed


def test_under_report_mode_a_crash_fails_no_test_and_is_still_kept(tmp_path):
    watch, kmsg = watch_on(tmp_path, {12627}, mode="report")
    with open(kmsg, "a") as log:
        log.write(f"6,2,2,-;{FREED}\n")
    assert teardown_of(watch, "tests/test_streaming.py::test_x").passed
    assert [(c.pid, c.own, c.outcome) for c in watch.crashes] == [(12627, True, "report")]


def test_a_crash_of_another_workers_stub_or_a_known_one_passes(tmp_path):
    watch, kmsg = watch_on(tmp_path, {9139})
    with open(kmsg, "a") as log:
        log.write(f"6,2,2,-;{FREED}\n")  # pid 12627: not one of this worker's
        log.write(f"6,3,3,-;{GONE}\n")  # pid 9139: this worker's, in the killed-server test
    report = teardown_of(watch, KILLED_SERVER_TEST)
    assert report.passed
    assert [(c.pid, c.own, c.outcome) for c in watch.crashes] == [
        (12627, False, "report"),
        (9139, True, "known"),
    ]


def test_a_failed_test_keeps_its_own_failure_and_shows_the_crash_beside_it(tmp_path):
    watch, kmsg = watch_on(tmp_path, {9139}, mode="strict")
    with open(kmsg, "a") as log:
        log.write(f"6,2,2,-;{GONE}\n")
    report = teardown_of(watch, "tests/test_doctor.py::t", outcome="failed")
    assert report.failed and report.longrepr is None
    assert [name for name, _ in report.sections] == ["crash watch"]


@pytest.mark.integration
def test_the_watch_notes_the_processes_its_worker_started_and_keeps_them_once_gone():
    import subprocess
    import sys

    own = crashwatch.Descendants()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        own.sample()
        assert child.pid in own and os.getpid() not in own  # itself is not its own descendant
    finally:
        child.kill()
        child.wait()
    own.sample()
    assert child.pid in own  # a crashed process is gone: it is known by having been seen alive


# -- a real Triton: a decoupled model that streamed, then unloaded ------------------------------
@pytest.mark.integration
def test_a_decoupled_model_that_streamed_unloads_without_crashing_its_stub(start_server, tmp_path):
    """The reproduction of ``scripts/stub_crash_repro.py``: with a response sender kept in a
    reference cycle past ``finalize``, tiny Falcon's decoupled stub segfaulted at every unload after
    a stream (3 rounds of 3, 2026-12-04, 2 cores)."""
    try:
        kernel = crashwatch.KernelLog()
    except OSError:
        pytest.skip("the kernel log is not readable here (root, or kernel.dmesg_restrict=0)")
    repo = tmp_path / "repository"
    repository.add_model(repo, "tiny-falcon", name="tf_stream", max_tokens=12, decoupled=True)
    repository.prepare_repository(repo)
    server = start_server(repo, load_models=["tf_stream"])
    stubs = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
    assert stubs, "no stub under the server"
    for prompt in ("Hi", "Once upon a time"):
        assert "".join(streaming.stream(server.grpc_url, "tf_stream", prompt, "grpc"))
    server.unload_model("tf_stream")
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in stubs), 30, "the stub's exit")
    crashes = [line for _, pid, line in crashwatch.parse(kernel.new()) if pid in stubs]
    kernel.close()
    assert crashes == []
