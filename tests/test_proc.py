"""labkit.proc's polling helper and its search for the processes a run folder left."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from labkit import proc


def test_wait_until_returns_the_first_true_answer_and_stops_asking():
    answers = iter([0, None, "ready", "never asked"])
    asked = []

    def predicate():
        asked.append(1)
        return next(answers)

    assert proc.wait_until(predicate, 5, 0.001) == "ready"
    assert len(asked) == 3


class FakeTime:
    """Stands in for the time module in labkit.proc: its clock moves only by the pauses asked."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(proc, "time", fake)
    return fake


def test_wait_until_gives_the_last_false_answer_once_the_bound_has_passed(clock):
    answers: list[list] = []

    def predicate():
        answers.append([])  # a new false answer each time
        return answers[-1]

    assert proc.wait_until(predicate, 0.2, 0.02) is answers[-1]
    # asked every 0.02 s up to the bound and once past it, never after
    assert 0.2 < clock.now <= 0.2 + 0.02 + 1e-9 and len(answers) == len(clock.pauses) + 1


def test_wait_until_asks_once_even_with_no_time_and_raises_the_predicates_error():
    assert proc.wait_until(lambda: True, 0) is True

    def broken():
        raise ValueError("the predicate's own error")

    with pytest.raises(ValueError, match="own error"):
        proc.wait_until(broken, 1)


def test_wait_until_lengthens_its_pause_by_half_up_to_the_bound_given(clock):
    proc.wait_until(lambda: None, 1.0, 0.01, max_interval_s=0.1)
    growing = [0.01, 0.015, 0.0225, 0.03375, 0.050625, 0.0759375, 0.1]
    assert clock.pauses[: len(growing)] == pytest.approx(growing)
    assert set(clock.pauses[len(growing) :]) == {0.1}  # 10 ms at first, then 100 ms each
    assert 1.0 < clock.now <= 1.1 + 1e-9


def test_wait_until_keeps_its_pause_without_a_bound(clock):
    proc.wait_until(lambda: None, 0.5, 0.1)
    assert clock.pauses == pytest.approx([0.1] * len(clock.pauses)) and len(clock.pauses) >= 5


def _sleeper(*args: str) -> subprocess.Popen:
    code = "import time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code, *args])


@pytest.mark.integration  # starts processes
def test_processes_using_a_folder_match_an_argument_in_it_not_a_name_that_only_begins_alike(
    tmp_path,
):
    run = tmp_path / "run"
    inside = _sleeper(str(run / "output_models" / "m" / "1" / "model.py"))
    option = _sleeper(f"--model-repository={run}")
    sibling = _sleeper(f"{run}-old/model.py", f"--model-repository={run}2")
    mentions = _sleeper(f"echo {run}")  # the path inside a longer argument: not a path argument
    started = [inside, option, sibling, mentions]
    try:
        # psutil reads a child's command line once exec has replaced fork's copy of ours
        wait = [p.pid for p in started]
        proc.wait_until(
            lambda: all(psutil.Process(pid).cmdline()[:1] == [sys.executable] for pid in wait), 30
        )
        found = {p.pid for p in proc.processes_using(run)}
        assert found == {inside.pid, option.pid}
        assert proc.processes_using(tmp_path / "nothing-here") == []
    finally:
        for p in started:
            p.kill()
            p.wait()


@pytest.mark.integration  # starts a process
def test_the_process_tree_of_this_process_holds_a_child_and_sums_a_measure_over_all():
    child = _sleeper()
    try:
        tree = proc.process_tree(psutil.Process().pid)
        assert tree[0].pid == psutil.Process().pid and child.pid in {p.pid for p in tree}
        assert proc.tree_total(psutil.Process().pid, lambda p: 1) == len(tree)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(psutil.NoSuchProcess, match=f"pid={child.pid}"):
        proc.process_tree(child.pid)
