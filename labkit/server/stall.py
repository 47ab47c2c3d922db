"""Telling a server start that stopped moving from one that is slow.

In a fresh clone's ``make test`` (CI) a tritonserver loading notebook 04's three models
on one busy core never became ready: both instances of ``smollm2_config_2`` logged their
``initialize`` done, and then the server wrote no line and its ``successfully loaded`` never came,
until the 300 s bound ran out. A start that is merely slow looks different: a stub importing
torch or reading weights spends CPU, and Triton logs each step. So a start counts as stalled
when, for :data:`STALL_S`, its log did not grow, no process of its tree came or went, the whole
tree (the server and every stub) spent under :data:`IDLE_CPU_S` of CPU, and it read and wrote
under :data:`IDLE_IO_BYTES` through files. :meth:`labkit.server.TritonServer.start` then starts it
once more and says why.

A model that downloads its weights in ``initialize`` (a hub id not yet in the cache) may spend
well under a CPU-second and log no line for minutes, but it writes what it receives into the
hub's cache: its file I/O grows. A download faster than :data:`IDLE_IO_BYTES` per
:data:`STALL_S` (about 35 KB/s) is work however long it takes; one slower than that, or one that
stopped receiving, counts as stalled, and the start is tried once more (the hub's client resumes
the partial file), then fails naming the models still loading.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

#: How long a start may show no sign of work before it counts as stalled. The slowest step seen
#: without a log line: four stubs reading SmolLM2's weights on one shared core, 69 s.
STALL_S = 120.0
#: CPU the whole tree may spend in that time and still count as idle. A ready server beside
#: idle stubs spends a few tenths of a second a minute; a stub that loads spends seconds.
IDLE_CPU_S = 1.0
#: Bytes the whole tree may read and write through files in that time and still count as idle
#: (bytes it receives from a socket do not count; a download writes them to the cache). An idle
#: server with one stub read and wrote 160 KB a minute here (its metrics read /proc).
IDLE_IO_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Sample:
    """What a start shows of its work at one moment."""

    log_bytes: int
    pids: frozenset[int]
    cpu_s: float
    io_bytes: int  # read and written through files (a download writing the hub's cache)


def sample(pid: int, log_path: Path | None) -> Sample:
    """The log's size, the process tree under ``pid``, the CPU seconds it has spent and the
    bytes it has read and written through files."""
    try:
        log_bytes = log_path.stat().st_size if log_path else 0
    except OSError:
        log_bytes = 0
    pids, cpu, io = set(), 0.0, 0
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        tree = []
    for process in tree:
        try:
            times = process.cpu_times()
            counters = process.io_counters()
        except psutil.Error:  # ended meanwhile: counted as a change of the tree
            continue
        pids.add(process.pid)
        cpu += times.user + times.system
        io += counters.read_chars + counters.write_chars
    return Sample(log_bytes, frozenset(pids), cpu, io)


class StallWatch:
    """Call :meth:`stalled` on each poll of a start; it says whether the start stopped moving."""

    def __init__(
        self,
        pid: int,
        log_path: Path | None,
        *,
        stall_s: float = STALL_S,
        idle_cpu_s: float = IDLE_CPU_S,
        idle_io_bytes: int = IDLE_IO_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid, self.log_path = pid, log_path
        self.stall_s, self.idle_cpu_s, self.clock = stall_s, idle_cpu_s, clock
        self.idle_io_bytes = idle_io_bytes
        self._since = clock()
        self._mark = sample(pid, log_path)

    def stalled(self) -> bool:
        now, current = self.clock(), sample(self.pid, self.log_path)
        moved = (
            current.log_bytes != self._mark.log_bytes
            or current.pids != self._mark.pids
            or abs(current.cpu_s - self._mark.cpu_s) > self.idle_cpu_s
            or abs(current.io_bytes - self._mark.io_bytes) > self.idle_io_bytes
        )
        if moved:
            self._since, self._mark = now, current
            return False
        return now - self._since >= self.stall_s

    def idle_for_s(self) -> float:
        return self.clock() - self._since


_LOADING = re.compile(r'"loading: ([^:"]+):\d+"')
_LOADED = re.compile(r"\"successfully loaded '([^']+)'\"")
_FAILED = re.compile(r"\"failed to load '([^']+)'")


def models_still_loading(log_text: str) -> list[str]:
    """The models a Triton log shows loading that it never shows loaded or failed, in order."""
    ended = set(_LOADED.findall(log_text)) | set(_FAILED.findall(log_text))
    seen: list[str] = []
    for name in _LOADING.findall(log_text):
        if name not in ended and name not in seen:
            seen.append(name)
    return seen
