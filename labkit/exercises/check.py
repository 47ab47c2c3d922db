"""What a check says, and how an exercise is run against the live server.

An exercise is a task a Triton user really does (bound a model's answers, load a model live, pick
a queue delay), done in a cell the learner edits, and a check that reads what the learner built
from the live server: the config Triton reports, the answers it gives, a measurement. The check
says one of three things, never with a traceback:

- **passed**: what was seen;
- **failed**: what was seen, what was expected, and a hint toward the fix;
- **not done yet**: the learner's cell is as shipped (its answer is still ``...``).

With ``solutions=True`` (``labkit run --solutions``, and the test suite) the exercise's reference
solution is applied in place of the learner's answer, and a check that does not pass then stops
the notebook: the lab's own answer must work.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.errors import ConfigError, LabkitError

PASSED = "passed"
FAILED = "failed"
NOT_DONE = "not done yet"

#: How each outcome is shown: a mark and a colour a learner can tell apart at a glance.
_LOOK = {PASSED: ("✔", "#1b7f3b"), FAILED: ("✘", "#b3261e"), NOT_DONE: ("…", "#6b6b6b")}


class SolutionFailed(LabkitError, AssertionError):
    """The exercise's reference solution did not pass its own check (a defect of the lab)."""


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` (passed, failed, not done yet) and its words."""

    exercise: str
    status: str
    seen: str
    expected: str = ""
    hint: str = ""

    def __post_init__(self) -> None:
        if self.status not in _LOOK:
            raise ValueError(f"status must be one of {sorted(_LOOK)}, got {self.status!r}")

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def lines(self) -> list[str]:
        mark = _LOOK[self.status][0]
        said = [f"{mark} {self.exercise}: {self.status}.", f"Seen: {self.seen}"]
        if self.status != PASSED and self.expected:
            said.append(f"Expected: {self.expected}")
        if self.status != PASSED and self.hint:
            said.append(f"Hint: {self.hint}")
        return said

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:  # a notebook's text output
        return str(self)

    def _repr_html_(self) -> str:
        colour = _LOOK[self.status][1]
        head, *rest = self.lines()
        body = "".join(f"<div>{html.escape(line)}</div>" for line in rest)
        return (
            f'<div style="border-left:4px solid {colour};padding:4px 10px">'
            f'<b style="color:{colour}">{html.escape(head)}</b>{body}</div>'
        )


def passed(exercise: str, seen: str) -> Check:
    return Check(exercise, PASSED, seen)


def failed(exercise: str, seen: str, expected: str, hint: str) -> Check:
    return Check(exercise, FAILED, seen, expected, hint)


def not_done(exercise: str, what: str) -> Check:
    """The learner's cell is as shipped: ``what`` says what to fill in."""
    return Check(exercise, NOT_DONE, "the exercise's cell is as shipped.", what, "")


def untouched(answer: Any) -> bool:
    """Whether a learner's answer is the shipped placeholder: ``...`` (or None)."""
    return answer is ... or answer is None


@dataclass(frozen=True)
class Exercise:
    """One exercise: its title, its check and its reference solution.

    ``check(answer, **context)`` judges the learner's answer against the live server and returns a
    :class:`Check`; ``solution(**context)`` builds (and, where the task is an action on the
    server, performs) the reference answer from the same context. ``todo`` says what to fill in.
    """

    key: str
    title: str
    todo: str
    check: Callable[..., Check]
    solution: Callable[..., Any]

    def run(self, answer: Any = ..., *, solutions: bool = False, **context: Any) -> Check:
        """The check's outcome for ``answer`` (the reference solution's with ``solutions``)."""
        if solutions:
            answer = self.solution(**context)
        if untouched(answer):
            return not_done(self.title, self.todo)
        try:
            outcome = self.check(answer, **context)
        except Exception as exc:  # noqa: BLE001 (a learner's answer may break anything; say what)
            outcome = failed(
                self.title,
                f"the check could not finish: {type(exc).__name__}: {exc}",
                "an answer the check can use",
                "read the error above; fix the cell you edited and run it and this check again.",
            )
        if solutions and not outcome.passed:
            raise SolutionFailed(f"the reference solution of {self.key!r} did not pass:\n{outcome}")
        return outcome


#: Every exercise of the lab, by key ("01-token-bound": notebook 01's). Each notebook's module of
#: :mod:`labkit.exercises` adds its own when imported.
EXERCISES: dict[str, Exercise] = {}


def register(*exercises: Exercise) -> None:
    for exercise in exercises:
        if exercise.key in EXERCISES:
            raise ConfigError(f"exercise {exercise.key!r} is defined twice")
        EXERCISES[exercise.key] = exercise
