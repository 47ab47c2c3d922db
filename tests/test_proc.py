"""labkit.proc's polling helper and its search for the processes a run folder left."""

from __future__ import annotations

import subprocess
import sys
import time

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


def test_wait_until_gives_the_last_false_answer_once_the_bound_has_passed():
    started = time.monotonic()
    assert proc.wait_until(lambda: [], 0.2, 0.02) == []
    assert 0.2 <= time.monotonic() - started < 5


def test_wait_until_asks_once_even_with_no_time_and_raises_the_predicates_error():
    assert proc.wait_until(lambda: True, 0) is True

    def broken():
        raise ValueError("the predicate's own error")

    with pytest.raises(ValueError, match="own error"):
        proc.wait_until(broken, 1)


def test_wait_until_lengthens_its_pause_up_to_the_bound_given():
    moments: list[float] = []
    proc.wait_until(lambda: moments.append(time.monotonic()), 1.0, 0.01, max_interval_s=0.1)
    pauses = [b - a for a, b in zip(moments, moments[1:], strict=False)]
    assert pauses[0] < 0.08 and max(pauses) >= 0.09  # 10 ms at first, then up to 100 ms


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
    with pytest.raises(psutil.NoSuchProcess):
        proc.process_tree(child.pid)
