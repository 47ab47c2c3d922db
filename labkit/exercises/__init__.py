"""Checked exercises: at the end of each notebook the learner does one real thing on the live
server, and a check says whether it worked and, if not, why (:mod:`labkit.exercises.check`).

Each notebook's exercises live in a module of their own; :data:`EXERCISES` holds them all by key,
and :func:`run` runs one::

    exercises.run("01-token-bound", MY_LIMIT, solutions=SOLUTIONS, server=server, model=MODEL)
"""

from __future__ import annotations

from typing import Any

from labkit.errors import ConfigError

# Each notebook's exercises register themselves when their module is imported.
from labkit.exercises import (  # noqa: F401 (imported for their registrations)
    analyzer,  # 04
    batching,  # 03
    deploy,  # 01
    inflight,  # 06
    models,  # 02
    neuron,  # 05
    pipeline,  # 08
    replicas,  # 07
)
from labkit.exercises.check import (
    EXERCISES,
    FAILED,
    NOT_DONE,
    PASSED,
    Check,
    Exercise,
    SolutionFailed,
    failed,
    not_done,
    passed,
    register,
    untouched,
)


def run(key: str, answer: Any = ..., *, solutions: bool = False, **context: Any) -> Check:
    """Check the learner's ``answer`` to exercise ``key`` against the live server in ``context``;
    with ``solutions``, the reference solution's instead (a failure then stops the notebook)."""
    if key not in EXERCISES:
        raise ConfigError(f"no exercise {key!r}; the lab's exercises are {', '.join(EXERCISES)}")
    return EXERCISES[key].run(answer, solutions=solutions, **context)


__all__ = [
    "EXERCISES",
    "FAILED",
    "NOT_DONE",
    "PASSED",
    "Check",
    "Exercise",
    "SolutionFailed",
    "failed",
    "not_done",
    "passed",
    "register",
    "run",
    "untouched",
]
