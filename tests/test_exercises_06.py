"""Notebook 06's exercise, a cap on running requests for a first-token budget: the judging on
planted bursts (fast), and on a real server with the lab's in-flight model (integration): a cap
too small misses the budget, a cap the model refuses and a cap never reloaded fail with their
sentence, and the reference solution passes."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit import exercises, repository
from labkit.errors import ServerError
from labkit.exercises import inflight as exercise
from labkit.exercises.inflight import BUDGET_STEPS, PARAMETER, TOKENS, Burst, judge
from labkit.repository import apply_edits
from labkit.server.live import reload

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_inflight_batching.ipynb"
KEY = "06-first-token-cap"
MODEL = "smollm2_inflight"
CLIENTS = 8

#: 8 clients, one slot each: one alone in the first step, the others in the second.
AT_ONCE = Burst((0.2,) + (0.4,) * 7, (12,) * 8, step_s=0.19)
#: 8 clients, 2 slots: four waves of two, each waiting for 12-token answers (100 ms a step).
WAVES = Burst((0.2, 0.2, 1.4, 1.4, 2.6, 2.6, 3.8, 3.8), (12,) * 8, step_s=0.1)


def test_an_untouched_answer_is_not_done_yet_without_touching_the_server():
    outcome = exercises.run(KEY, ..., server=None, model=MODEL, clients=CLIENTS)
    assert outcome.status == exercises.NOT_DONE and "MY_CAP" in outcome.expected


def test_the_page_states_the_budget_and_the_answers_the_check_uses():
    page = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells)
    assert f"{TOKENS} new tokens" in page and f"**{BUDGET_STEPS} steps**" in page
    assert f"with {BUDGET_STEPS} steps of the ITL" in page and "a cap of 2" in page


def test_one_slot_per_client_meets_the_budget_and_says_what_was_seen():
    outcome = judge(8, 8, [AT_ONCE], CLIENTS)
    assert outcome.passed, outcome
    for said in (
        "max_running_requests 8",
        "0.40 s",
        "2.1 steps",
        "190 ms",
        f"{BUDGET_STEPS} steps",
    ):
        assert said in outcome.seen


def test_too_few_slots_make_the_last_client_wait_for_whole_answers():
    outcome = judge(2, 2, [WAVES, WAVES], CLIENTS)
    assert outcome.status == exercises.FAILED
    assert "38.0 steps" in outcome.seen and "better of 2 rounds" in outcome.seen
    assert "within 6 steps (0.60 s" in outcome.expected
    assert "with 2 slots" in outcome.hint and "12 tokens" in outcome.hint
    assert "with 1 slot," in judge(1, 1, [WAVES], CLIENTS).hint


def test_more_slots_than_clients_meet_the_budget_but_are_not_the_smallest_cap():
    outcome = judge(16, 16, [AT_ONCE], CLIENTS)
    assert outcome.status == exercises.FAILED and "within the budget" in outcome.seen
    assert "smallest cap" in outcome.expected and "16 slots are more than 8" in outcome.hint


def test_enough_slots_on_a_busy_host_say_to_run_again():
    slow = Burst((0.2,) + (1.4,) * 7, (12,) * 8, step_s=0.19)  # 7.4 steps
    outcome = judge(8, 8, [slow, slow], CLIENTS)
    assert outcome.status == exercises.FAILED and "Run this cell again" in outcome.hint


def test_the_best_round_counts():
    assert judge(8, 8, [WAVES, AT_ONCE], CLIENTS).passed


def test_a_burst_within_the_budget_decides_and_one_over_it_is_sent_again(monkeypatch):
    served = {"parameters": {PARAMETER: {"string_value": "8"}}}
    monkeypatch.setattr(exercise, "served_config", lambda server, model: served)
    sent: list[Burst] = []

    def answering(*bursts: Burst) -> None:
        """The bursts the server answers, in turn; ``sent`` keeps those the check sent."""
        sent.clear()
        queue = list(bursts)
        monkeypatch.setattr(exercise, "burst", lambda *args: sent.append(queue.pop(0)) or sent[-1])

    answering(AT_ONCE, AT_ONCE)
    assert exercises.run(KEY, 8, server=None, model=MODEL, clients=CLIENTS).passed
    assert sent == [AT_ONCE]
    answering(WAVES, AT_ONCE)
    assert exercises.run(KEY, 8, server=None, model=MODEL, clients=CLIENTS).passed
    assert sent == [WAVES, AT_ONCE]
    served["parameters"].clear()
    unset = exercises.run(KEY, 8, server=None, model=MODEL, clients=CLIENTS)
    assert unset.status == exercises.FAILED and "not set" in unset.seen


@pytest.mark.parametrize("bad", [0, -3, "8", 2.5, True])
def test_a_cap_the_model_refuses_fails_without_asking_the_server(bad):
    outcome = exercises.run(KEY, bad, server=None, model=MODEL, clients=CLIENTS)
    assert outcome.status == exercises.FAILED and "1 or more" in outcome.expected, outcome


def test_a_check_that_cannot_reach_the_server_fails_with_a_sentence(monkeypatch):
    def unreachable(server, model):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(exercise, "served_config", unreachable)
    outcome = exercises.run(KEY, 8, server=None, model=MODEL, clients=CLIENTS)
    assert outcome.status == exercises.FAILED and "connection refused" in outcome.seen


@pytest.mark.integration
@pytest.mark.slow
def test_the_solution_passes_and_too_few_slots_or_a_refused_cap_fail_on_a_real_server(
    tmp_path, start_server
):
    repo = repository.prepare_run_repository(tmp_path)  # the lab's copy, as a notebook's run
    repo.edit(MODEL, parameters={PARAMETER: "2"})  # as the notebook's exercise starts
    server = start_server(repo.path, load_models=[MODEL])
    context = dict(server=server, repo=repo, model=MODEL, clients=CLIENTS)

    too_few = exercises.run(KEY, 2, **context)
    assert too_few.status == exercises.FAILED and "with 2 slots" in too_few.hint, too_few

    # the model refuses a cap of 0: the reload raises its reason and keeps the cap of 2
    with pytest.raises(ServerError, match=PARAMETER):
        reload(server, MODEL, apply_edits(repo.config(MODEL), parameters={PARAMETER: "0"}))
    refused = exercises.run(KEY, 0, **context)
    assert refused.status == exercises.FAILED and "1 or more" in refused.expected
    stale = exercises.run(KEY, CLIENTS, **context)  # the answer, never reloaded
    assert stale.status == exercises.FAILED and f"{PARAMETER} 2;" in stale.seen, stale

    solved = exercises.run(KEY, ..., solutions=True, **context)
    assert solved.passed and f"{PARAMETER} {CLIENTS} on the server" in solved.seen, solved
