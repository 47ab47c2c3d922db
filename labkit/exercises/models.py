"""Notebook 02's exercise: add a model to the running server and load it live.

``02-load-live``: the learner copies a model the run's repository holds (``tiny-falcon``, the
quickest) under a new name, loads it on the running server (explicit model control: a folder in
the repository is not served until it is loaded), and writes down first how much memory its
process will hold. The check reads the server's repository index (the new model READY, the
notebook's models still READY), sends the new model one request that must be answered, and puts
the memory its process holds beside the prediction. The reference solution adds ``tiny-falcon-2``
and loads it; it unloads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from labkit import client
from labkit.capacity import served_memory
from labkit.errors import InferenceError
from labkit.exercises.check import Check, Exercise, failed, passed, register, untouched
from labkit.repository import Repository, prepare_run_repository
from labkit.server import TritonServer, reload

KEY = "02-load-live"
TITLE = "Load a model live"
SOURCE = "tiny-falcon"
SOLUTION_NAME = "tiny-falcon-2"
PROMPT = "Where is the nearest"
#: A prediction within this fraction of the memory held reads as close: the plan's estimate per
#: copy (0.5 GiB of process, tiny-falcon's weights are 13 MB) is within it of what one holds.
CLOSE = 0.4
TODO = (
    "copy tiny-falcon under a new name into the run's repository, load it on the running server, "
    "and write its name in NEW_MODEL (and your memory prediction in MY_PREDICTION_GIB)."
)
LOAD_HINT = "load it on the running server with lab.reload(server, NEW_MODEL): no restart needed."


@dataclass(frozen=True)
class Seen:
    """What the check read: the repository's models, the server's index (name -> state), the
    models the notebook served before the exercise."""

    in_repository: list[str]
    states: dict[str, str]
    earlier: list[str] = field(default_factory=list)


def judge_index(answer: Any, seen: Seen) -> Check | None:
    """The failed :class:`Check` when ``answer`` is not a new model READY beside the notebook's
    models; None when a request may decide."""
    if not isinstance(answer, str) or not answer:
        return failed(
            TITLE,
            f"NEW_MODEL is {answer!r}.",
            "the new model's name, a string such as 'tiny-falcon-2'.",
            "write the name in quotes, as the folder in the run's repository is called.",
        )
    if answer in seen.earlier:
        return failed(
            TITLE,
            f"{answer} was already served before the exercise.",
            "a model the server did not serve yet, under a new name.",
            f"copy it under another name: repo.add_twin({answer!r}, 'my-copy', "
            f"repo.config({answer!r})), then load 'my-copy'.",
        )
    if answer not in seen.in_repository:
        return failed(
            TITLE,
            f"the run's repository has no model folder named {answer!r} "
            f"(it holds {', '.join(sorted(seen.in_repository))}).",
            f"a folder {answer}/ in the run's repository, with its config.pbtxt.",
            f"add it first: repo.add_twin('{SOURCE}', {answer!r}, repo.config('{SOURCE}')); "
            "the name must be the folder's.",
        )
    state = seen.states.get(answer) or "UNAVAILABLE"
    if state != "READY":
        return failed(
            TITLE,
            f"{answer} is in the repository, but the server's index says {state}: "
            "copied, not loaded.",
            f"{answer} READY in the server's index.",
            "the server runs with explicit model control and loads only what it is asked to; "
            + LOAD_HINT,
        )
    gone = [m for m in seen.earlier if seen.states.get(m) != "READY"]
    if gone:
        return failed(
            TITLE,
            f"{answer} is READY, but {', '.join(gone)} no longer is.",
            "the notebook's models still READY beside the new one.",
            f"loading one model leaves the others serving; load {gone[0]!r} again with "
            f"lab.reload(server, {gone[0]!r}).",
        )
    return None


def judge_memory(answer: str, held_gib: float | None, predicted: Any, answered: str) -> Check:
    """The passed :class:`Check`, with the memory held beside the learner's prediction."""
    said = f"{answer} is READY beside the notebook's models and answered: {answered!r}."
    if held_gib is None:
        return passed(TITLE, said + " (A remote server's processes are not measured here.)")
    held = f" Its process holds {held_gib:.2f} GiB"
    if untouched(predicted) or not isinstance(predicted, int | float):
        return passed(TITLE, said + held + "; you wrote no prediction in MY_PREDICTION_GIB.")
    off = (float(predicted) - held_gib) / held_gib
    if abs(off) <= CLOSE:
        verdict = "close: a copy holds about what the model it copies held"
    elif off < 0:
        verdict = (
            "far below: each copy is a process with its own Python, PyTorch and transformers "
            "(about 0.4 GiB) besides its weights"
        )
    else:
        verdict = (
            "far above: a copy holds about what the model it copies held (the measured column "
            "of the memory table), not the sum of every model"
        )
    return passed(
        TITLE, said + held + f"; you predicted {predicted:g} GiB ({off:+.0%}): {verdict}."
    )


def _answer(server: TritonServer, model: str) -> str:
    return client.generate(server.http_url, model, PROMPT, max_tokens=4).text


def _held_gib(server: TritonServer, model: str) -> float | None:
    if getattr(server, "pid", None) is None:  # remote: its processes are not on this machine
        return None
    frame = served_memory(server)
    if model not in frame.index:
        return None
    row = frame.loc[model]
    return float(row["gpu (GiB)"] or row["resident (GiB)"])


def check_load_live(
    answer: Any,
    *,
    server: TritonServer,
    repository: Any = None,
    models: list[str] | None = None,
    predicted_gib: Any = ...,
    **_: Any,
) -> Check:
    """Judge ``answer`` (the new model's name) against the live server's index, one request and
    the memory its process holds."""
    repo = Repository(repository or server.model_repository)
    states = {row["name"]: row.get("state", "") for row in server.model_index()}
    wrong = judge_index(answer, Seen(repo.models(), states, list(models or [])))
    if wrong is not None:
        return wrong
    try:
        answered = _answer(server, answer)
    except InferenceError as exc:
        return failed(
            TITLE,
            f"{answer} is READY but refused a request: {exc}",
            "an answer to one short prompt.",
            f"{answer} must be a text generator (a copy of {SOURCE}); read the reason above.",
        )
    return judge_memory(answer, _held_gib(server, answer), predicted_gib, answered)


def solve_load_live(*, server: TritonServer, repository: Any = None, **_: Any) -> str:
    """The reference solution: a copy of tiny-falcon named tiny-falcon-2 in the run's repository
    (tiny-falcon added from the catalog first where the run lacks it), loaded live."""
    repo = Repository(repository or server.model_repository)
    if SOURCE not in repo.models():  # a GPU host's MODELS: the hub models, no tiny-falcon
        prepare_run_repository(repo.path.parent, models=[SOURCE])
    if SOLUTION_NAME not in repo.models():
        repo.add_twin(SOURCE, SOLUTION_NAME, repo.config(SOURCE))
    reload(server, SOLUTION_NAME, repository=repo)
    return SOLUTION_NAME


LOAD_LIVE = Exercise(KEY, TITLE, TODO, check_load_live, solve_load_live)
register(LOAD_LIVE)
