"""Notebook 02's exercise, ``02-load-live``: a model added to the run's repository and loaded live.

The judging runs without a server on what the check would read; a real Triton with explicit model
control, serving ``tiny-falcon`` from a run's repository, then takes a copy left unloaded, a name
the repository lacks, and the reference solution (a copy named ``tiny-falcon-2``, loaded).
"""

from __future__ import annotations

import pytest

from labkit import exercises, lab
from labkit.exercises import models
from labkit.exercises.models import SOURCE, Seen

EARLIER = [SOURCE, "minilm"]
READY = {SOURCE: "READY", "minilm": "READY"}
FOLDERS = [SOURCE, "minilm", "smollm2"]


def test_an_untouched_answer_is_not_done_yet_without_a_server():
    outcome = exercises.run("02-load-live", ..., server=None)
    assert outcome.status == exercises.NOT_DONE and "NEW_MODEL" in str(outcome)


def test_a_copy_not_loaded_fails_and_says_load_it():
    wrong = models.judge_index("my-falcon", Seen([*FOLDERS, "my-falcon"], READY, EARLIER))
    assert wrong.status == exercises.FAILED
    assert "copied, not loaded" in wrong.seen and "lab.reload(server" in wrong.hint


def test_a_name_the_repository_lacks_fails_and_lists_what_it_holds():
    wrong = models.judge_index("tiny_falcon_2", Seen(FOLDERS, READY, EARLIER))
    assert wrong.status == exercises.FAILED
    assert "no model folder named 'tiny_falcon_2'" in wrong.seen and "minilm" in wrong.seen


def test_a_model_already_served_or_an_earlier_one_unloaded_fails():
    already = models.judge_index(SOURCE, Seen(FOLDERS, READY, EARLIER))
    assert already.status == exercises.FAILED and "already served" in already.seen
    states = {**READY, "minilm": "UNAVAILABLE", "copy": "READY"}
    gone = models.judge_index("copy", Seen([*FOLDERS, "copy"], states, EARLIER))
    assert gone.status == exercises.FAILED and "minilm no longer is" in gone.seen


def test_the_prediction_is_shown_beside_the_memory_held():
    close = models.judge_memory("copy", 0.5, 0.55, "Where is ...")
    assert close.passed and "+10%" in close.seen and "close" in close.seen
    below = models.judge_memory("copy", 0.5, 0.01, "Where is ...")
    assert below.passed and "-98%" in below.seen and "its own Python" in below.seen
    above = models.judge_memory("copy", 0.5, 1.5, "Where is ...")
    assert "far above" in above.seen
    assert "no prediction" in models.judge_memory("copy", 0.5, ..., "x").seen


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_module_server):
    """A server with explicit model control serving tiny-falcon and minilm from a run's
    repository."""
    run = tmp_path_factory.mktemp("run")
    repo = lab.prepare_run_repository(run, models=EARLIER)
    return start_module_server(repo, load_models=EARLIER), repo


@pytest.mark.integration
def test_a_copy_left_unloaded_and_a_missing_name_fail_on_a_live_server(served):
    server, repo = served
    if "left-unloaded" not in repo.models():
        repo.add_twin(SOURCE, "left-unloaded", repo.config(SOURCE))
    context = {"server": server, "repository": repo, "models": EARLIER}
    unloaded = exercises.run("02-load-live", "left-unloaded", **context)
    assert unloaded.status == exercises.FAILED and "UNAVAILABLE" in unloaded.seen
    missing = exercises.run("02-load-live", "no-such-model", **context)
    assert missing.status == exercises.FAILED and "no model folder" in missing.seen


@pytest.mark.integration
@pytest.mark.slow
def test_the_reference_solution_loads_a_copy_beside_the_served_models(served):
    server, repo = served
    context = {"server": server, "repository": repo, "models": EARLIER}
    right = exercises.run("02-load-live", ..., solutions=True, predicted_gib=0.5, **context)
    assert right.passed, right
    states = {row["name"]: row.get("state") for row in server.model_index()}
    assert all(states[m] == "READY" for m in [*EARLIER, models.SOLUTION_NAME]), states
    assert "GiB" in right.seen and "0.5" in right.seen
