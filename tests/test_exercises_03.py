"""Notebook 03's exercise, a queue delay within a latency budget: the judging on planted numbers
(fast), and the reference solution and a delay too long on a real server (integration)."""

from __future__ import annotations

import pytest

from labkit import exercises, repository
from labkit.exercises import batching as exercise
from labkit.exercises.batching import PacedRound, judge_config, judge_round
from labkit.profiling.arrivals import Served
from labkit.repository import Repository, apply_edits
from labkit.server.live import reload, warm_up

KEY = "03-queue-delay"
EVERY_S = 1.0  # a gap of 1 s: budget = 500 ms + 3 gaps = 3500 ms
BUDGET_MS = exercise.latency_budget_ms(500.0, EVERY_S)


def served(delay_us: int | None, max_batch_size: int = 8) -> dict:
    """``/v2/models/<m>/config`` as Triton gives it (uint64 as a string); None: no batching."""
    config = {"name": "m_delay", "max_batch_size": max_batch_size}
    if delay_us is not None:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": str(delay_us)}
    return config


def test_the_budget_is_one_compute_plus_three_gaps():
    assert BUDGET_MS == 3500.0
    assert exercise.latency_budget_ms(280.0, 0.6) == pytest.approx(2080.0)


def test_an_untouched_answer_is_not_done_yet_without_touching_the_server():
    outcome = exercises.run(KEY, ..., server=None, model="m_delay", every_s=1.0)
    assert outcome.status == exercises.NOT_DONE and "MY_DELAY_US" in outcome.expected


def test_the_config_must_batch_and_serve_the_learners_delay():
    assert judge_config(1_500_000, served(1_500_000)) is None
    off = judge_config(1_500_000, served(None))
    assert off.status == exercises.FAILED and "no dynamic_batching" in off.seen
    assert "keep it on" in off.hint
    assert judge_config(1_500_000, served(1_500_000, max_batch_size=0)).status == exercises.FAILED
    stale = judge_config(1_500_000, served(2_500_000))
    assert stale.status == exercises.FAILED and "serves max_queue_delay_microseconds 2500000" in (
        stale.seen
    )
    assert "reloads" in stale.hint
    for bad in ("1s", 1.5, -1, True):
        assert judge_config(bad, served(0)).status == exercises.FAILED


def test_pairs_within_the_budget_pass_and_say_what_was_seen():
    # 1.5 gaps: three pairs, the slowest waits 1.5 s and a batch of 2's run
    seen = PacedRound(1_500_000, 6, 2200.0, executions=3)
    outcome = judge_round(seen, budget_ms=BUDGET_MS, every_s=EVERY_S)
    assert outcome.passed, outcome
    for said in ("1500000", "1.5 arrival gaps", "2200 ms", "3500 ms", "requests per execution: 2 "):
        assert said in outcome.seen


def test_a_delay_too_long_breaks_the_budget_and_the_hint_says_by_how_much():
    # 5 gaps: one batch of 6, the first request waits 5 s and the batch's run
    seen = PacedRound(5_000_000, 6, 5800.0, executions=1)
    outcome = judge_round(seen, budget_ms=BUDGET_MS, every_s=EVERY_S)
    assert outcome.status == exercises.FAILED
    assert "5800 ms against a budget of 3500 ms" in outcome.seen
    assert "shorten the delay to under 2700000 µs" in outcome.hint  # 3500 - a run of 800 ms


def test_a_delay_shorter_than_a_gap_makes_no_batch():
    seen = PacedRound(300_000, 6, 860.0, executions=6)
    outcome = judge_round(seen, budget_ms=BUDGET_MS, every_s=EVERY_S)
    assert outcome.status == exercises.FAILED and "requests per execution: 1 " in outcome.seen
    assert "at least one arrival gap (1000000 µs)" in outcome.hint
    # a delay that covers a gap and still makes no batch: the pace broke, not the answer
    broken = PacedRound(1_500_000, 6, 2000.0, executions=6)
    assert "run the check again" in judge_round(broken, budget_ms=BUDGET_MS, every_s=1.0).hint


def test_a_check_that_cannot_reach_the_server_fails_with_a_sentence(monkeypatch):
    def unreachable(server, model):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(exercise, "served_config", unreachable)
    outcome = exercises.run(
        KEY, 1_500_000, server=None, model="m", every_s=1.0, compute_ms=500.0, prompt="Hi"
    )
    assert outcome.status == exercises.FAILED and "connection refused" in outcome.seen


@pytest.mark.integration
@pytest.mark.slow
def test_the_solution_passes_and_a_long_delay_or_batching_off_fails_on_a_real_server(
    tmp_path, start_server
):
    repository.add_model(
        tmp_path, "tiny-falcon", name="tf", max_tokens=4, max_batch_size=8, dynamic_batching=True
    )
    repository.prepare_repository(tmp_path)
    server = start_server(tmp_path)
    repo = Repository(tmp_path)
    warm_up(server, "tf")
    before = Served.read(server, "tf")
    for _ in range(3):  # one request alone, three times: its compute
        exercise.paced_round(server, "tf", every_s=0.2, requests=1, prompt="Hello")
    alone = Served.read(server, "tf") - before
    # a gap far above tiny-falcon's compute, so that the loaded host's jitter cannot break the pace
    context = dict(
        server=server,
        repo=repo,
        model="tf",
        every_s=0.3,
        compute_ms=alone.compute_ms / alone.executions,
        prompt="Hello",
    )

    solved = exercises.run(KEY, ..., solutions=True, **context)
    assert solved.passed and "450000" in solved.seen  # 1.5 gaps of 300 ms, read from the server

    too_long = 1_500_000  # 5 gaps: one batch of 6, the first request waits 1.5 s
    reload(server, "tf", apply_edits(repo.config("tf"), max_queue_delay_microseconds=too_long))
    outcome = exercises.run(KEY, too_long, **context)
    assert outcome.status == exercises.FAILED and "shorten the delay" in outcome.hint, outcome

    reload(server, "tf", apply_edits(repo.config("tf"), dynamic_batching=False))
    off = exercises.run(KEY, too_long, **context)
    assert off.status == exercises.FAILED and "no dynamic_batching" in off.seen, off
