"""Notebook 07's exercise, ``07-ready-check``: a readiness check that sees a dead Python stub.

The judging from what the learner's function said is tested without a server; the whole check
runs against a real Triton serving tiny Falcon, whose stub it kills and whose model it reloads.
"""

from __future__ import annotations

import urllib.request

import pytest

from labkit import exercises, repository
from labkit.exercises.check import FAILED, NOT_DONE, PASSED
from labkit.exercises.replicas import KEY, Said, judge, my_ready_reference
from labkit.server import stubs

MODEL = "tf"


# -- the judging, from what the function said -------------------------------------------------
def test_a_function_that_returns_nothing_is_not_done_yet():
    assert judge(Said(None), MODEL).status == NOT_DONE


def test_a_check_that_fails_a_healthy_replica_fails():
    outcome = judge(Said(False), MODEL)
    assert outcome.status == FAILED and "said False for a healthy replica" in outcome.seen


def test_a_check_that_misses_the_dead_stub_fails_with_the_ready_endpoint_and_a_hint():
    outcome = judge(Said(True, True, True, 200), MODEL)
    assert outcome.status == FAILED and "/ready answered 200" in outcome.seen
    assert "small request" in outcome.hint and "triton_python_backend_stub" in outcome.hint


def test_a_check_that_never_lets_a_repaired_replica_back_fails():
    outcome = judge(Said(True, False, False, 200), MODEL)
    assert outcome.status == FAILED and "reloaded" in outcome.seen


def test_true_false_true_passes():
    assert judge(Said(True, False, True, 200, 3.0), MODEL).status == PASSED


def test_an_answer_that_is_not_a_bool_fails():
    assert judge(Said("ready"), MODEL).status == FAILED


# -- the whole check, on a live server --------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repo = tmp_path_factory.mktemp("ready-check") / "repo"
    repo.mkdir()
    repository.add_model(repo, "tiny-falcon", name=MODEL, max_tokens=4)
    repository.prepare_repository(repo)
    return start_module_server(repo)


def ready_only(http_url: str, model: str) -> bool:
    """The typical wrong answer: Triton's own per-model ready endpoint, nothing else."""
    try:
        with urllib.request.urlopen(f"{http_url}/v2/models/{model}/ready", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def untouched(http_url: str, model: str) -> bool:
    """The cell as shipped."""
    ...


def run(answer, server, **options):
    return exercises.run(KEY, answer, server=server, model=MODEL, **options)


@pytest.mark.integration
@pytest.mark.slow
def test_the_reference_passes_and_leaves_the_model_answering(server):
    outcome = run(..., server, solutions=True)
    assert outcome.status == PASSED, outcome
    assert "True once it was reloaded" in outcome.seen
    assert len(stubs(server)[MODEL]) == 1  # a new stub, after the reload
    assert my_ready_reference(f"http://{server.http_url}", MODEL)


@pytest.mark.integration
@pytest.mark.slow
def test_a_check_of_the_ready_endpoint_alone_says_true_with_the_stub_dead_and_fails(server):
    outcome = run(ready_only, server)
    assert outcome.status == FAILED, outcome
    assert "said True with tf's Python stub killed" in outcome.seen
    assert "/ready answered 200" in outcome.seen
    assert len(stubs(server)[MODEL]) == 1  # repaired although the answer failed


@pytest.mark.integration
def test_always_false_fails_before_any_stub_is_killed(server):
    before = stubs(server)[MODEL]
    outcome = run(lambda http_url, model: False, server)
    assert outcome.status == FAILED and "healthy replica" in outcome.seen
    assert stubs(server)[MODEL] == before


@pytest.mark.integration
def test_the_function_as_shipped_is_not_done_yet(server):
    assert run(untouched, server).status == NOT_DONE
    assert run(..., server).status == NOT_DONE
