"""The exercises' frame: the three outcomes and their words, the reference solution's duty to pass,
and every notebook 01-08 carrying a checked exercise that the suite runs with its solution."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit import exercises
from labkit.errors import ConfigError
from labkit.exercises import Check, Exercise, SolutionFailed

ROOT = Path(__file__).resolve().parents[1]


def _exercise(check, solution=lambda **_: 3) -> Exercise:
    return Exercise("99-test", "A planted exercise", "set ANSWER to 3", check, solution)


def _equals_three(answer, **_):
    if answer == 3:
        return exercises.passed("A planted exercise", f"ANSWER is {answer}")
    return exercises.failed("A planted exercise", f"ANSWER is {answer}", "3", "count again")


def test_an_untouched_answer_is_not_done_yet_and_never_reaches_the_check():
    def boom(answer, **_):
        raise AssertionError("the check ran on an untouched answer")

    for answer in (..., None):
        outcome = _exercise(boom).run(answer)
        assert outcome.status == exercises.NOT_DONE and not outcome.passed
        assert "set ANSWER to 3" in str(outcome)


def test_a_right_and_a_wrong_answer():
    assert _exercise(_equals_three).run(3).passed
    wrong = _exercise(_equals_three).run(4)
    assert wrong.status == exercises.FAILED
    assert wrong.lines() == [
        "✘ A planted exercise: failed.",
        "Seen: ANSWER is 4",
        "Expected: 3",
        "Hint: count again",
    ]


def test_a_check_that_raises_fails_with_the_error_named_not_a_traceback():
    def breaks(answer, **_):
        raise KeyError("text_output")

    outcome = _exercise(breaks).run(1)
    assert outcome.status == exercises.FAILED
    assert "KeyError" in outcome.seen and "text_output" in outcome.seen
    assert "Traceback" not in str(outcome)


def test_solutions_replace_the_answer_and_a_failing_solution_stops_the_notebook():
    assert _exercise(_equals_three).run(..., solutions=True).passed
    with pytest.raises(SolutionFailed, match="99-test"):
        _exercise(_equals_three, solution=lambda **_: 5).run(3, solutions=True)


def test_a_passed_check_shows_what_was_seen_only_and_escapes_html():
    shown = Check("<ex>", exercises.PASSED, "a <b>", "hidden", "hidden")._repr_html_()
    assert "&lt;ex&gt;" in shown and "a &lt;b&gt;" in shown and "hidden" not in shown
    with pytest.raises(ValueError, match="status"):
        Check("x", "maybe", "y")


def test_an_unknown_key_names_the_lab_exercises():
    with pytest.raises(ConfigError, match="no exercise"):
        exercises.run("00-nothing")


def _exercise_keys(notebook: Path) -> list[str]:
    nb = nbformat.read(notebook, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return re.findall(r"exercises\.run\(\s*\"([0-9]{2}-[a-z0-9-]+)\"", code)


@pytest.mark.parametrize(
    "notebook", sorted((ROOT / "notebooks").glob("0[1-8]_*.ipynb")), ids=lambda p: p.name[:2]
)
def test_every_notebook_checks_an_exercise_of_its_own_with_its_solution_switch(notebook):
    keys = _exercise_keys(notebook)
    assert keys, f"{notebook.name} runs no exercise check"
    assert all(key.startswith(notebook.name[:2]) and key in exercises.EXERCISES for key in keys), (
        keys
    )
    nb = nbformat.read(notebook, as_version=4)
    checks = [c.source for c in nb.cells if "exercises.run(" in c.source]
    assert all("solutions=SOLUTIONS" in source for source in checks), checks


def test_the_answer_key_covers_every_exercise():
    key_page = (ROOT / "docs" / "exercises.md").read_text()
    missing = [key for key in exercises.EXERCISES if f"`{key}`" not in key_page]
    assert not missing, f"docs/exercises.md lacks {missing}"
