"""Which tests crash a Triton process: the kernel log's segfaults, read around every test.

A Python-backend stub (``triton_python_backend_stub``, logged by the kernel as ``triton_python_b``)
or a ``tritonserver`` that segfaults on its way out fails no test by itself: its server is
stopping, and nobody reads its exit. The kernel logs every such crash. This plugin keeps
``/dev/kmsg`` open (where it is readable: root, or ``kernel.dmesg_restrict=0``), reads what the
kernel logged before and after each test, and keeps each crash with the test it happened in. At
the end of the run the terminal summary lists them, and ``runs/test-crashes/`` keeps them as JSON
lines.

Every xdist worker reads the same kernel log (and so would another run on the host), so each
worker also samples, twice a second, the processes it started (its descendants: servers, their
stubs, notebook kernels and what they start): a crash of one of them is its own, named with the
test running on it. Each crash is judged (:func:`verdict`) by the kind of crash, from where in
libc it happened:

- ``freed after unmap``: Python freed an object that owns some of the stub's shared
  memory after the stub had unmapped it (a response sender kept by a reference cycle until the
  interpreter's last garbage collection). The model code's to avoid: the test it happened in
  fails, at its teardown.
- ``server gone`` (Triton 2.51's own, upstream triton-inference-server/server#7875): the stub's
  server ended before it; the stub's health thread exits the process while its main thread still
  waits on the shared memory that this exit unmapped. :data:`KNOWN` lists where the suite does
  that on purpose, with the reason; elsewhere it is reported, and fails only under
  ``LABKIT_CRASH_CHECK=strict`` (its other triggers are not all found, see docs/known-issues.md).
- any other crash is reported, and fails under ``LABKIT_CRASH_CHECK=strict``.

``LABKIT_CRASH_CHECK=report`` fails no test: every crash is only listed at the end of the run.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import pytest

KMSG = "/dev/kmsg"
#: A crash of one of Triton's processes, as the kernel logs it. ``triton_python_b`` is the stub's
#: name cut to the kernel's 15 characters.
CRASH = re.compile(
    r"(?P<process>triton_python_b|tritonserver)\[(?P<pid>\d+)\]: "
    r"(?P<kind>segfault at|general protection|trap )"
)
#: Where each worker keeps what it saw (one JSON line a crash), under the project's run folder.
CRASH_DIR = Path("runs") / "test-crashes"
#: ``LABKIT_CRASH_CHECK``: ``strict`` fails a test for every crash of its own not in KNOWN,
#: ``report`` for none; unset, for the kinds :func:`verdict` fails.
MODE_VARIABLE = "LABKIT_CRASH_CHECK"
#: How often a worker notes the processes it started (a stub lives seconds at least).
SAMPLE_INTERVAL_S = 0.5

#: The kinds of crash, by where in libc (this host's libc 2.36) the stub faulted.
FREED_AFTER_UNMAP = "freed after unmap"
SERVER_GONE = "server gone"
KINDS = {
    # pthread_mutex_lock on a mutex in unmapped shared memory, from a destructor run by
    # Py_FinalizeEx's garbage collection (a core dump showed ~ResponseSender -> PbCancel)
    FREED_AFTER_UNMAP: re.compile(
        r"triton_python_b\[\d+\]: segfault at \w+ .* libc\.so\.6\[8c370,"
    ),
    # sem_wait in Stub::PopMessage on the message queue that the stub's own exit(1) unmapped
    # (core dump: its health thread in exit() after "Non-graceful termination detected")
    SERVER_GONE: re.compile(r"triton_python_b\[\d+\]: segfault at \w+ .* libc\.so\.6\[90bb4,"),
}


@dataclass(frozen=True)
class Known:
    """A crash the suite causes on purpose, in Triton's own code: allowed, with its reason."""

    tests: str  # a glob of the node ids it happens in
    kind: str
    reason: str


#: Every crash allowed through, and why. Nothing else is allowed by :func:`verdict`.
KNOWN = [
    Known(
        "tests/test_cluster.py::test_a_killed_tritonserver_*",
        SERVER_GONE,
        "the failover test SIGKILLs a replica's tritonserver; Triton 2.51's orphaned stubs may "
        "segfault in their own exit path (upstream triton-inference-server/server#7875)",
    ),
    Known(
        "notebooks/04_model_analyzer.ipynb::*",
        SERVER_GONE,
        "Model Analyzer SIGKILLs its tritonserver 5 s after SIGTERM (server_local.py, "
        "SERVER_OUTPUT_TIMEOUT_SECS) while its stubs still finalize; they then segfault in "
        "Triton 2.51's own exit path (upstream triton-inference-server/server#7875)",
    ),
]


def kind_of(line: str) -> str | None:
    """The kind of crash a kernel line tells (:data:`KINDS`), or None when it is another one."""
    return next((kind for kind, pattern in KINDS.items() if pattern.search(line)), None)


def verdict(test: str, line: str, strict: bool = False) -> tuple[str, str]:
    """``(outcome, why)`` for a crash of a test's own process: ``"known"`` (listed in
    :data:`KNOWN`, why is its reason), ``"fail"`` or ``"report"``."""
    kind = kind_of(line)
    for known in KNOWN:
        if kind == known.kind and fnmatch.fnmatchcase(test, known.tests):
            return "known", known.reason
    if kind == FREED_AFTER_UNMAP:
        return "fail", (
            "a Python object owning some of the stub's shared memory (a response sender, a "
            "request) was freed after the stub unmapped it: model code kept it in a reference "
            "cycle until the interpreter's last garbage collection (docs/known-issues.md); free it in "
            "finalize (gc.collect()) or break the cycle"
        )
    what = f"a {kind!r} crash" if kind else "a crash of an unknown kind"
    return ("fail" if strict else "report"), f"{what}, not listed in crashwatch.KNOWN"


@dataclass(frozen=True)
class Crash:
    test: str  # the test's node id, or "(between tests)"
    worker: str
    process: str
    pid: int
    line: str
    own: bool = True  # one of this worker's processes (False: another worker's, or the host's)
    outcome: str = "report"  # verdict()'s, for a crash of this worker's own processes
    why: str = ""


def parse(records: list[str]) -> list[tuple[str, int, str]]:
    """``(process, pid, message)`` of every crash among ``/dev/kmsg`` records
    (``"6,1234,5678901,-;message"``, then indented ``KEY=value`` lines; a line without a ``;``
    is read whole). A chunk may hold several records, one a line."""
    found = []
    for record in records:
        for line in record.splitlines():
            if not line or line[0].isspace():  # a record's KEY=value lines
                continue
            message = (line.split(";", 1)[1] if ";" in line else line).strip()
            match = CRASH.search(message)
            if match:
                found.append((match["process"], int(match["pid"]), message))
    return found


class KernelLog:
    """``/dev/kmsg`` opened at its end: :meth:`new` returns the records logged since the last call."""

    def __init__(self, path: str = KMSG):
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)

    def new(self) -> list[str]:
        records = []
        while True:
            try:
                chunk = os.read(self.fd, 8192)
            except BlockingIOError:
                return records
            except BrokenPipeError:  # records were overwritten before we read them: go on
                continue
            if not chunk:
                return records
            records.append(chunk.decode("utf-8", errors="replace"))

    def close(self) -> None:
        os.close(self.fd)


class Descendants:
    """The pids of every process this one started, directly or not, noted every ``interval_s``
    by a daemon thread (and at each :meth:`sample`): a crashed process is gone, so it is known
    by having been seen alive."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S):
        self.seen: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="crashwatch", daemon=True
        )

    def start(self) -> Descendants:
        self._thread.start()
        return self

    def sample(self) -> None:
        try:
            pids = {p.pid for p in psutil.Process().children(recursive=True)}
        except psutil.Error:  # a process ended while it was read: the next sample has the rest
            return
        with self._lock:
            self.seen |= pids

    def __contains__(self, pid: int) -> bool:
        with self._lock:
            return pid in self.seen

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


class CrashWatch:
    """The plugin: the kernel log read around each test, each crash kept with its test; a crash
    of this worker's own processes that :func:`verdict` fails fails its test's teardown."""

    def __init__(self, config: pytest.Config, log: KernelLog, own: Descendants | None = None):
        self.log = log
        self.own = own if own is not None else Descendants().start()
        self.mode = os.environ.get(MODE_VARIABLE, "").strip().lower()
        self.worker = getattr(config, "workerinput", {}).get("workerid", "main")
        self.folder = Path(config.rootpath) / CRASH_DIR
        self.crashes: list[Crash] = []

    def _keep(self, test: str) -> list[Crash]:
        """Read the kernel log's new crashes, keep them with ``test``; return them."""
        found = []
        records = self.log.new()
        if records:
            self.own.sample()  # a process seen now was alive before the crash was read
        for process, pid, line in parse(records):
            own = pid in self.own
            outcome, why = verdict(test, line, self.mode == "strict") if own else ("report", "")
            if outcome == "fail" and self.mode == "report":
                outcome = "report"
            crash = Crash(test, self.worker, process, pid, line, own, outcome, why)
            found.append(crash)
            self.crashes.append(crash)
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"{self.worker}.jsonl", "a", encoding="utf-8") as out:
                out.write(json.dumps(asdict(crash)) + "\n")
        return found

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        self._keep("(between tests)")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if report.when != "teardown":
            return report
        failing = [c for c in self._keep(item.nodeid) if c.own and c.outcome == "fail"]
        if failing:
            text = "\n".join(f"{c.line}\n  {c.why}" for c in failing)
            message = f"a Triton process of this test crashed (kernel log):\n{text}"
            if report.passed:
                report.outcome, report.longrepr = "failed", message
            else:  # failed for its own reason: that stays, and this is shown too
                report.sections.append(("crash watch", message))
        return report

    def pytest_sessionfinish(self, session):
        self._keep("(between tests)")
        self.own.stop()
        self.log.close()


def summary(folder: Path) -> list[str]:
    """The terminal summary's lines: each test that crashed a Triton process, with the count;
    a test's own crashes are marked with their outcome (a known one with its reason)."""
    rows: dict[tuple[str, str, str], set[int]] = {}
    reasons: dict[tuple[str, str, str], str] = {}
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text(encoding="utf-8").splitlines():
            crash = json.loads(line)
            own = crash.get("own", True)
            mark = crash.get("outcome", "report") if own else "another worker's or the host's"
            key = (crash["test"], crash["process"], mark)
            # every worker reads the same kernel log: one crash, one pid, counted once per test
            rows.setdefault(key, set()).add(crash["pid"])
            if mark == "known":
                reasons[key] = crash.get("why", "")
    lines = []
    for key, pids in sorted(rows.items()):
        test, process, mark = key
        lines.append(f"{len(pids)} x {process} in {test} [{mark}]")
        if key in reasons:
            lines.append(f"    known: {reasons[key]}")
    return lines


def configure(config: pytest.Config) -> None:
    """Register the watch where the kernel log can be read; clear the last run's crashes once."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        for old in (Path(config.rootpath) / CRASH_DIR).glob("*.jsonl"):
            old.unlink()  # the xdist controller runs no test: it clears the last run, no more
        return
    try:
        log = KernelLog()
    except OSError:
        return  # not readable here: nothing to watch
    if not hasattr(config, "workerinput"):  # a serial run starts afresh
        for old in (Path(config.rootpath) / CRASH_DIR).glob("*.jsonl"):
            old.unlink()
    config.pluginmanager.register(CrashWatch(config, log), "crash-watch")


def terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    lines = summary(Path(config.rootpath) / CRASH_DIR)
    if lines:
        terminalreporter.section("Triton processes that crashed (kernel log)")
        for line in lines:
            terminalreporter.write_line(line)
