"""Notebook 08's exercise, ``08-ensemble``: wire a two-step ensemble and load it live.

The judging of what Triton reports and answers is tested without a server; the whole check runs
against a real Triton serving MiniLM and its two steps, loading the learner's config live.
"""

from __future__ import annotations

import pytest

from labkit import exercises
from labkit.exercises.check import FAILED, NOT_DONE, PASSED
from labkit.exercises.pipeline import (
    KEY,
    REFERENCE,
    judge_answers,
    judge_served,
    load_refusal,
    refusal_reason,
)
from labkit.repository import prepare_run_repository

STEPS = ["minilm", "minilm_tokenize", "minilm_encode"]


# -- the judging -------------------------------------------------------------------------------
def test_the_refusal_is_read_from_the_servers_log():
    log = (
        'I1206 11:26:42.1 1 model_lifecycle.cc:472] "loading: other:1"\n'
        'E1206 11:26:42.15 31355 model_repository_manager.cc:1460] "Poll failed for model '
        "directory 'my_pipeline': output 'vector' for ensemble 'my_pipeline' is not written\"\n"
    )
    assert load_refusal(log) == "output 'vector' for ensemble 'my_pipeline' is not written"
    assert load_refusal(log, "other") is None
    error = "Triton could not load model 'my_pipeline': failed to poll from model repository"
    assert refusal_reason(error, log) == "output 'vector' for ensemble 'my_pipeline' is not written"
    error = "Triton could not load model 'my_pipeline': load failed: inconsistent data type\n."
    assert (
        refusal_reason(error, log) == "load failed: inconsistent data type"
    )  # not the log's older one


def served(steps, inputs=("text",), outputs=("vector",), platform="ensemble"):
    return {
        "platform": platform,
        "input": [{"name": n} for n in inputs],
        "output": [{"name": n} for n in outputs],
        "ensemble_scheduling": {"step": [{"model_name": s} for s in steps]},
    }


def test_the_ensemble_asked_for_may_go_on_to_its_answers():
    assert judge_served(served(["minilm_tokenize", "minilm_encode"])) is None


def test_a_missing_step_fails():
    outcome = judge_served(served(["minilm_encode"]))
    assert outcome.status == FAILED and "two steps" in outcome.expected


def test_the_interface_names_are_checked():
    outcome = judge_served(served(["minilm_tokenize", "minilm_encode"], inputs=["text_input"]))
    assert outcome.status == FAILED and "VALUES" in outcome.hint


def test_vectors_apart_beyond_the_tolerance_fail():
    assert judge_answers(3e-6).status == PASSED
    assert judge_answers(0.2).status == FAILED


# -- the whole check, on a live server --------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory, start_module_server):
    repo = prepare_run_repository(tmp_path_factory.mktemp("ensemble"), models=STEPS)
    return start_module_server(repo, load_models=STEPS), repo


def run(answer, live, **options):
    server, repo = live
    return exercises.run(KEY, answer, server=server, repository=repo, **options)


#: A step's output mapped to the wrong next input: the tokenizer's mask written into "ids" too.
CROSSED = REFERENCE.replace(
    'output_map { key: "attention_mask" value: "mask" }',
    'output_map { key: "attention_mask" value: "ids" }',
)
#: The encoder step left out: the tokenizer's ids mapped straight to the ensemble's output.
ONE_STEP = REFERENCE.split("  step {")[0] + (
    '  step { model_name: "minilm_tokenize" model_version: -1\n'
    '    input_map { key: "text_input" value: "text" }\n'
    '    output_map { key: "input_ids" value: "vector" } }\n}\n'
)


@pytest.mark.integration
def test_a_crossed_map_is_refused_and_the_check_says_triton_s_reason(live):
    assert CROSSED != REFERENCE
    outcome = run(CROSSED, live)
    assert outcome.status == FAILED, outcome
    assert "Triton refused to load my_pipeline" in outcome.seen
    assert "'ids'" in outcome.seen  # Triton's own reason names the tensor, not "failed to poll"
    assert "key is the step's own tensor name" in outcome.hint


@pytest.mark.integration
def test_a_missing_step_is_refused(live):
    outcome = run(ONE_STEP, live)
    assert outcome.status == FAILED, outcome
    assert "inconsistent data type" in outcome.seen, outcome  # Triton's own words
    assert "Is every step there" in outcome.hint


@pytest.mark.integration
def test_text_that_is_not_a_config_fails_without_a_traceback(live):
    outcome = run('name: "my_pipeline" platform: ensemble {', live)
    assert outcome.status == FAILED and "not a config Triton can read" in outcome.seen


@pytest.mark.integration
def test_untouched_is_not_done_yet(live):
    assert run(..., live).status == NOT_DONE


@pytest.mark.integration
@pytest.mark.slow
def test_the_reference_loads_and_embeds_as_the_single_model_does(live):
    outcome = run(..., live, solutions=True)
    assert outcome.status == PASSED, outcome
    assert "an ensemble of minilm_tokenize then minilm_encode" in outcome.seen


@pytest.mark.integration
def test_keys_renamed_instead_of_values_are_refused_with_the_missing_input(live):
    keys = REFERENCE.replace('key: "text_input" value: "text"', 'key: "text" value: "text"')
    outcome = run(keys, live)
    assert outcome.status == FAILED, outcome
    assert "non-existing input text in model minilm_tokenize" in outcome.seen
