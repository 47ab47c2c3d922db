"""Notebook 01's exercise, ``01-token-bound``: a bound on max_tokens from the config, reloaded live.

The judging runs without a server on what the check would read; a real Triton serving
``smollm2_first`` from a copy of the lab's folder then takes an edit left unloaded and the
reference solution (the edit and the reload).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from labkit import exercises, repository
from labkit.exercises import deploy
from labkit.exercises.deploy import LIMIT_KEY, STATED_LIMIT, Outcome, Served
from labkit.server import served_config

ROOT = Path(__file__).resolve().parent.parent
STATED = str(STATED_LIMIT)


def test_an_untouched_answer_is_not_done_yet_without_a_server():
    outcome = exercises.run("01-token-bound", ..., server=None)
    assert outcome.status == exercises.NOT_DONE
    assert LIMIT_KEY in str(outcome) and STATED in str(outcome)


def test_an_edit_written_but_not_loaded_fails_and_says_reload():
    wrong = deploy.judge_config(24, Served("smollm2_first", "512", "16", STATED))
    assert wrong.status == exercises.FAILED
    assert "512" in wrong.seen and "not loaded" in wrong.seen
    assert "lab.reload(server, 'smollm2_first')" in wrong.hint


def test_a_limit_other_than_the_page_s_fails_with_the_stated_one():
    wrong = deploy.judge_config(32, Served("smollm2_first", "32", "16", "32"))
    assert wrong.status == exercises.FAILED
    assert "32" in wrong.seen and STATED in wrong.expected


def test_editing_the_default_instead_of_the_bound_is_named():
    wrong = deploy.judge_config(24, Served("smollm2_first", "512", STATED, "512"))
    assert wrong.status == exercises.FAILED and "default answer length" in wrong.hint


def test_an_answer_that_is_not_the_enforced_limit_or_not_a_number_fails():
    served = Served("smollm2_first", STATED, "16", STATED)
    assert deploy.judge_config(STATED, served) is None  # "24" is 24
    assert "MY_LIMIT is 20" in deploy.judge_config(20, served).seen
    assert "a whole number" in deploy.judge_config("twenty-four", served).expected


def test_the_requests_decide_answered_at_the_limit_and_400_past_it():
    at = Outcome(24, 200, "I am going to ...", 1.2)
    refused = Outcome(25, 400, f"max_tokens 25 is over this model's {LIMIT_KEY} of 24")
    assert deploy.judge_requests(at, refused).passed
    answered_past = deploy.judge_requests(at, Outcome(25, 200, "I am going to ..."))
    assert answered_past.status == exercises.FAILED and "was answered" in answered_past.seen
    refused_at = deploy.judge_requests(Outcome(24, 400, "over the limit"), refused)
    assert refused_at.status == exercises.FAILED and "refused (400)" in refused_at.seen


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_module_server):
    """A server serving smollm2_first from a copy of the lab's folder (limit 512)."""
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(
        ROOT / "model_repository" / deploy.MODEL,
        repo / deploy.MODEL,
        symlinks=True,
        ignore=shutil.ignore_patterns("weights", "__pycache__"),
    )
    repository.prepare_repository(repo)
    return start_module_server(repo, load_models=[deploy.MODEL]), repository.Repository(repo)


def _served_limit(server) -> str:
    return served_config(server, deploy.MODEL)["parameters"][LIMIT_KEY]["string_value"]


@pytest.mark.integration
def test_an_edit_left_unloaded_fails_with_what_triton_still_reports(served):
    server, repo = served
    before = _served_limit(server)
    written = STATED if before != STATED else "30"
    repo.edit(deploy.MODEL, parameters={LIMIT_KEY: written})
    outcome = exercises.run("01-token-bound", int(written), server=server, repository=repo)
    assert outcome.status == exercises.FAILED
    assert f"{LIMIT_KEY} {before}" in outcome.seen and "not loaded" in outcome.seen
    assert "reload" in outcome.hint


@pytest.mark.integration
@pytest.mark.slow
def test_the_reference_solution_edits_reloads_and_passes(served):
    server, repo = served
    right = exercises.run("01-token-bound", ..., solutions=True, server=server, repository=repo)
    assert right.passed, right
    assert _served_limit(server) == STATED
    assert f"max_tokens {STATED_LIMIT + 1}" in right.seen and "HTTP 400" in right.seen
