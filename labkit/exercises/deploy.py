"""Notebook 01's exercise: bound ``max_tokens`` from the model's configuration, live.

``01-token-bound``: the learner sets ``max_tokens_limit`` of ``smollm2_first`` to the limit the
page states (:data:`STATED_LIMIT`) in the run's copy of its ``config.pbtxt`` and reloads the model
on the running server. The check reads the limit from the configuration Triton reports (the one
``model.py`` was initialised with), then asks for :data:`STATED_LIMIT` new tokens (answered) and
one more (refused with HTTP 400 and the model's reason). The reference solution does the edit and
the reload.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from labkit import client
from labkit.errors import InferenceError, ServerError
from labkit.exercises.check import Check, Exercise, failed, passed, register
from labkit.repository import Repository
from labkit.server import TritonServer, reload, served_config

KEY = "01-token-bound"
TITLE = "Bound max_tokens from the config"
#: The model of the exercise, and the limit the page asks for: 24 new tokens take one to two
#: seconds on 2 CPU cores, and stay above the config's default answer length (``max_tokens`` 16).
MODEL = "smollm2_first"
STATED_LIMIT = 24
LIMIT_KEY = "max_tokens_limit"
PROMPT = "I am going"
TODO = (
    f"set {LIMIT_KEY} to {STATED_LIMIT} in the run's config.pbtxt, reload the model on the "
    f"running server, and write the limit you set in MY_LIMIT."
)
RELOAD_HINT = (
    "Triton reads config.pbtxt only when it loads a model: load it again on the running server "
    "with lab.reload(server, MODEL_NAME) (no restart), then run this check again."
)


def _number(value: Any) -> int | None:
    """``value`` as a whole number (24, "24", 24.0), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(str(value).strip())
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


@dataclass(frozen=True)
class Served:
    """What the check read before sending anything: the limit and default Triton reports for the
    model (None: the parameter is absent) and the limit written in the repository's file."""

    model: str
    limit: str | None
    default: str | None
    in_file: str | None


def judge_config(answer: Any, served: Served, stated: int = STATED_LIMIT) -> Check | None:
    """The failed :class:`Check` when the configuration Triton reports is not the stated bound
    (or the answer does not say what Triton enforces); None when the requests may decide."""
    limit = _number(answer)
    if limit is None:
        return failed(
            TITLE,
            f"MY_LIMIT is {answer!r}.",
            f"a whole number: the {LIMIT_KEY} you set ({stated}).",
            "write the number itself, for example MY_LIMIT = 12, not a sentence or a list.",
        )
    reported = served.limit
    seen = f"Triton reports {LIMIT_KEY} {reported} for {served.model}"
    if reported is None:
        return failed(
            TITLE,
            f"Triton reports no {LIMIT_KEY} parameter for {served.model}.",
            f'a parameter {LIMIT_KEY} with string_value "{stated}".',
            f"{served.model}'s model.py reads {LIMIT_KEY}; edit that key, not a new one, "
            "then reload the model.",
        )
    if served.in_file is not None and served.in_file != reported:
        return failed(
            TITLE,
            f"{seen}, while the run's config.pbtxt says {served.in_file}: "
            "the edit is written but not loaded.",
            f"Triton reporting {LIMIT_KEY} {stated}.",
            RELOAD_HINT.replace("MODEL_NAME", repr(served.model)),
        )
    if reported != str(stated):
        hint = (
            f"max_tokens is the default answer length (when a request names none); the bound is "
            f"{LIMIT_KEY}. Set that one to {stated} and reload the model."
            if served.default == str(stated)
            else f"the page asks for {stated}; edit {LIMIT_KEY} again and reload the model."
        )
        return failed(TITLE, f"{seen}.", f"{LIMIT_KEY} {stated}, as the page states.", hint)
    if limit != stated:
        return failed(
            TITLE,
            f"{seen}, but MY_LIMIT is {limit}.",
            f"MY_LIMIT = {stated}: the limit Triton now enforces.",
            "write in MY_LIMIT the number you set, so your notes say what the server does.",
        )
    return None


@dataclass(frozen=True)
class Outcome:
    """One request's outcome: the HTTP status (200 answered) and the text or the refusal."""

    max_tokens: int
    status: int | None
    said: str
    seconds: float = 0.0


def judge_requests(at: Outcome, past: Outcome, stated: int = STATED_LIMIT) -> Check:
    """Passed when a request at the limit is answered and one past it is refused with 400 and a
    reason that names the limit."""
    if at.status != 200:
        return failed(
            TITLE,
            f"a request for max_tokens {at.max_tokens} was refused ({at.status}): {at.said}",
            f"an answer: {at.max_tokens} is within the limit of {stated}.",
            "the limit counts as allowed; if the server log shows the model failed, reload it.",
        )
    if past.status == 200:
        return failed(
            TITLE,
            f"a request for max_tokens {past.max_tokens} was answered: {past.said!r}",
            f"HTTP 400 naming {LIMIT_KEY}: {past.max_tokens} is past the limit of {stated}.",
            RELOAD_HINT.replace("MODEL_NAME", "the model"),
        )
    if past.status != 400 or LIMIT_KEY not in past.said:
        return failed(
            TITLE,
            f"a request for max_tokens {past.max_tokens} got ({past.status}): {past.said}",
            f"HTTP 400 with the model's reason, which names {LIMIT_KEY}.",
            "a refusal for another reason: read it, fix what it names, and run the check again.",
        )
    return passed(
        TITLE,
        f"a request for max_tokens {at.max_tokens} was answered ({at.seconds:.1f} s), one for "
        f"{past.max_tokens} refused with HTTP 400: {past.said}",
    )


def _ask(server: TritonServer, model: str, max_tokens: int) -> Outcome:
    try:
        answer = client.generate(server.http_url, model, PROMPT, max_tokens=max_tokens)
    except InferenceError as exc:
        return Outcome(max_tokens, getattr(exc, "status", None), getattr(exc, "server_message", ""))
    return Outcome(max_tokens, 200, answer.text, answer.seconds)


def _repository(server: TritonServer, repository: str | os.PathLike | None):
    folder = repository or getattr(server, "model_repository", None)
    return Repository(folder) if folder else None


def read_served(
    server: TritonServer, model: str = MODEL, repository: str | os.PathLike | None = None
) -> Served:
    """The limit and default Triton reports for ``model``, and the limit in the repository's file."""
    parameters = served_config(server, model).get("parameters", {})
    repo = _repository(server, repository)
    in_file = None
    if repo is not None and repo.config_path(model).is_file():
        written = repo.config(model).parameters
        in_file = written[LIMIT_KEY].string_value if LIMIT_KEY in written else None
    return Served(
        model,
        parameters.get(LIMIT_KEY, {}).get("string_value"),
        parameters.get("max_tokens", {}).get("string_value"),
        in_file,
    )


def check_token_bound(
    answer: Any,
    *,
    server: TritonServer,
    model: str = MODEL,
    repository: str | os.PathLike | None = None,
    **_: Any,
) -> Check:
    """Judge ``answer`` (the limit the learner set) against what ``server`` enforces for ``model``."""
    try:
        served = read_served(server, model, repository)
    except ServerError as exc:
        return failed(
            TITLE,
            f"{exc}",
            f"{model} loaded and READY, reporting {LIMIT_KEY} {STATED_LIMIT}.",
            f"load it on the running server with lab.reload(server, {model!r}).",
        )
    wrong = judge_config(answer, served)
    if wrong is not None:
        return wrong
    return judge_requests(_ask(server, model, STATED_LIMIT), _ask(server, model, STATED_LIMIT + 1))


def solve_token_bound(
    *,
    server: TritonServer,
    model: str = MODEL,
    repository: str | os.PathLike | None = None,
    **_: Any,
) -> int:
    """The reference solution: write the stated limit into the run's config and reload the model
    on the running server (its other models keep serving)."""
    repo = _repository(server, repository)
    repo.edit(model, parameters={LIMIT_KEY: str(STATED_LIMIT)})
    reload(server, model, repository=repo)
    return STATED_LIMIT


TOKEN_BOUND = Exercise(KEY, TITLE, TODO, check_token_bound, solve_token_bound)
register(TOKEN_BOUND)
