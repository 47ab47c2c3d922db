"""Telling a server start that stopped moving from one that is slow.

In a fresh clone's ``make test`` (CI, stop 45) a tritonserver loading notebook 04's three models
on one busy core never became ready: both instances of ``smollm2_config_2`` logged their
``initialize`` done, and then the server wrote no line and its ``successfully loaded`` never came,
until the 300 s bound ran out. A start that is merely slow looks different: a stub importing
torch or reading weights spends CPU, and Triton logs each step. So a start counts as stalled
when, for :data:`STALL_S`, its log did not grow, no process of its tree came or went, and the
whole tree (the server and every stub) spent under :data:`IDLE_CPU_S` of CPU.
:meth:`labkit.server.TritonServer.start` then starts it once more and says why.
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


@dataclass(frozen=True)
class Sample:
    """What a start shows of its work at one moment."""

    log_bytes: int
    pids: frozenset[int]
    cpu_s: float


def sample(pid: int, log_path: Path | None) -> Sample:
    """The log's size, the process tree under ``pid`` and the CPU seconds it has spent."""
    try:
        log_bytes = log_path.stat().st_size if log_path else 0
    except OSError:
        log_bytes = 0
    pids, cpu = set(), 0.0
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        tree = []
    for process in tree:
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended meanwhile: counted as a change of the tree
            continue
        pids.add(process.pid)
        cpu += times.user + times.system
    return Sample(log_bytes, frozenset(pids), cpu)


class StallWatch:
    """Call :meth:`stalled` on each poll of a start; it says whether the start stopped moving."""

    def __init__(
        self,
        pid: int,
        log_path: Path | None,
        *,
        stall_s: float = STALL_S,
        idle_cpu_s: float = IDLE_CPU_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid, self.log_path = pid, log_path
        self.stall_s, self.idle_cpu_s, self.clock = stall_s, idle_cpu_s, clock
        self._since = clock()
        self._mark = sample(pid, log_path)

    def stalled(self) -> bool:
        now, current = self.clock(), sample(self.pid, self.log_path)
        moved = (
            current.log_bytes != self._mark.log_bytes
            or current.pids != self._mark.pids
            or abs(current.cpu_s - self._mark.cpu_s) > self.idle_cpu_s
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
