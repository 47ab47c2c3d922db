"""Which tests crash a Triton process: the kernel log's segfaults, read around every test.

A Python-backend stub (``triton_python_backend_stub``, logged by the kernel as ``triton_python_b``)
or a ``tritonserver`` that segfaults on its way out fails no test: its server is stopping, and
nobody reads its exit. The kernel logs every such crash. This plugin keeps ``/dev/kmsg`` open
(where it is readable: root, or ``kernel.dmesg_restrict=0``), reads what the kernel logged before
and after each test, and keeps each crash with the test it happened in. At the end of the run the
terminal summary lists them, and ``runs/test-crashes/`` keeps them as JSON lines.

Under pytest-xdist every worker reads the same kernel log, so a crash is listed once for each test
that was running when it happened (one per worker): the other worker's test is named beside it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Crash:
    test: str  # the test's node id, or "(between tests)"
    worker: str
    process: str
    pid: int
    line: str


def parse(records: list[str]) -> list[tuple[str, int, str]]:
    """``(process, pid, message)`` of every crash among ``/dev/kmsg`` records
    (``"6,1234,5678901,-;message"``; a record without a ``;`` is read whole)."""
    found = []
    for record in records:
        message = record.split(";", 1)[1] if ";" in record.split("\n", 1)[0] else record
        message = message.split("\n", 1)[0].strip()
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


class CrashWatch:
    """The plugin: the kernel log read around each test, each crash kept with its test."""

    def __init__(self, config: pytest.Config, log: KernelLog):
        self.log = log
        self.worker = getattr(config, "workerinput", {}).get("workerid", "main")
        self.folder = Path(config.rootpath) / CRASH_DIR
        self.crashes: list[Crash] = []

    def _keep(self, test: str) -> None:
        for process, pid, line in parse(self.log.new()):
            crash = Crash(test, self.worker, process, pid, line)
            self.crashes.append(crash)
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"{self.worker}.jsonl", "a", encoding="utf-8") as out:
                out.write(json.dumps(asdict(crash)) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._keep("(between tests)")
        yield
        self._keep(item.nodeid)

    def pytest_sessionfinish(self, session):
        self._keep("(between tests)")
        self.log.close()


def summary(folder: Path) -> list[str]:
    """The terminal summary's lines: each test that crashed a Triton process, with the count."""
    pids: dict[tuple[str, str], set[int]] = {}
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text(encoding="utf-8").splitlines():
            crash = json.loads(line)
            # every worker reads the same kernel log: one crash, one pid, counted once per test
            pids.setdefault((crash["test"], crash["process"]), set()).add(crash["pid"])
    return [f"{len(p)} x {process} in {test}" for (test, process), p in sorted(pids.items())]


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
    if not hasattr(config, "workerinput"):  # the controller (or a serial run) starts afresh
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
