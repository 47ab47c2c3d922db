"""Notebook 03's exercise: a queue delay that keeps paced requests within a latency budget while
they still run in batches.

Requests arrive one every ``every_s`` seconds (the notebook's paced arrivals, spaced by twice one
request's compute). The budget is one request's compute alone plus three arrival gaps
(:func:`latency_budget_ms`). The learner writes ``max_queue_delay_microseconds`` into the delayed
twin's config and reloads it; the check reads the delay back from the config Triton serves, sends
a short paced round and judges the slowest request's latency against the budget and the requests
per execution (Triton's statistics) against 1.

The reasoning the page asks for: a request waits at most the delay, then its batch's run, so the
slowest stays near ``delay + one batch's run``; a batch forms only if the delay covers at least
one arrival gap. The reference answer is 1.5 gaps: pairs form, and the slowest request
(1.5 gaps + a batch of 2's run, under a gap) stays well inside three gaps plus a compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from labkit.exercises.check import Check, Exercise, failed, passed, register
from labkit.profiling.arrivals import measure_arrivals
from labkit.repository import Repository, apply_edits
from labkit.server.live import reload, served_config

KEY = "03-queue-delay"
TITLE = "A queue delay within a latency budget"
TODO = (
    "set MY_DELAY_US to a max_queue_delay_microseconds (a whole number) and run that cell: it "
    "writes the delay into the delayed twin's config and reloads it"
)
#: Paced requests in the check's round: two batches of the reference delay's pairs, seconds in all.
ROUND_REQUESTS = 4
#: The budget's slack over one request's compute, in arrival gaps.
BUDGET_GAPS = 3.0
#: The reference delay, in arrival gaps: pairs form, far inside the budget.
SOLUTION_GAPS = 1.5


def latency_budget_ms(compute_ms: float, every_s: float) -> float:
    """The budget the slowest paced request must meet: one request's compute alone plus
    :data:`BUDGET_GAPS` arrival gaps."""
    return compute_ms + BUDGET_GAPS * every_s * 1000


@dataclass(frozen=True)
class PacedRound:
    """What the check saw: the delay the server serves, the requests' latencies (client side) and
    how many executions Triton ran for them."""

    delay_us: int
    requests: int
    slowest_ms: float
    executions: int

    @property
    def batch(self) -> float:
        """Requests per execution (1.0: every request ran alone)."""
        return self.requests / self.executions if self.executions else math.nan


def judge_config(answer: Any, config: dict) -> Check | None:
    """A failed :class:`Check` when the served ``config`` (as ``/v2/models/<m>/config`` gives it)
    cannot batch or does not serve the learner's ``answer``; None when the round may run."""
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 0:
        return failed(
            TITLE,
            f"MY_DELAY_US is {answer!r}.",
            "a whole number of microseconds, 0 or more (1 s is 1000000)",
            "write the delay as an integer, e.g. 250000 for a quarter of a second.",
        )
    batching = config.get("dynamic_batching")
    if batching is None or int(config.get("max_batch_size", 0)) < 2:
        return failed(
            TITLE,
            f"the config the server reports has max_batch_size {config.get('max_batch_size', 0)} "
            f"and {'no ' if batching is None else ''}dynamic_batching.",
            "dynamic batching on (dynamic_batching, max_batch_size 2 or more) with your delay",
            "a queue delay is a setting of dynamic batching: keep it on (apply_edits with "
            "max_queue_delay_microseconds only, as the cell shows) and reload.",
        )
    served = int(batching.get("max_queue_delay_microseconds", 0))
    if served != answer:
        return failed(
            TITLE,
            f"the server serves max_queue_delay_microseconds {served}, MY_DELAY_US is {answer}.",
            f"the server serving {answer}",
            "run the cell that writes MY_DELAY_US into the config and reloads the model.",
        )
    return None


def judge_round(seen: PacedRound, *, budget_ms: float, every_s: float) -> Check:
    """Passed when the slowest request met ``budget_ms`` and the requests ran in batches."""
    gap_us = round(every_s * 1e6)
    said = (
        f"the server serves max_queue_delay_microseconds {seen.delay_us} "
        f"({seen.delay_us / gap_us:.2g} arrival gaps of {gap_us} µs); "
        f"{seen.requests} paced requests: the slowest (their p99) took "
        f"{seen.slowest_ms:.0f} ms against a budget of {budget_ms:.0f} ms; "
        f"requests per execution: {seen.batch:.2g} ({seen.executions} executions)."
    )
    if seen.slowest_ms > budget_ms:
        run_ms = max(seen.slowest_ms - seen.delay_us / 1000, 0.0)
        return failed(
            TITLE,
            said,
            f"the slowest request within {budget_ms:.0f} ms",
            "the first request of a batch waits the whole delay, then the batch's run (here "
            f"about {run_ms:.0f} ms): shorten the delay to under "
            f"{max(budget_ms - run_ms, 0) * 1000:.0f} µs.",
        )
    if not seen.batch > 1:
        hint = (
            f"a batch forms only if the delay covers at least one arrival gap ({gap_us} µs): "
            "the first request must still wait when the next arrives; lengthen the delay."
            if seen.delay_us < gap_us
            else "the delay covers a gap, yet no two requests ran together: run the check again "
            "(a host much slower for a moment can break the pace)."
        )
        return failed(TITLE, said, "more than 1 request per execution (batches forming)", hint)
    return passed(TITLE, said)


def paced_round(server, model: str, *, every_s: float, requests: int, prompt: str) -> PacedRound:
    """``requests`` requests to ``model``, one every ``every_s`` seconds, and what they saw."""
    delay_us = int(served_config(server, model)["dynamic_batching"]["max_queue_delay_microseconds"])
    row = measure_arrivals(
        server, model, every_s=every_s, requests=requests, prompt=prompt, clients=requests,
        timeout_s=120.0,
    )  # fmt: skip
    return PacedRound(delay_us, row["requests"], row["max_ms"], row["executions"])


def check_queue_delay(
    answer: Any,
    *,
    server,
    model: str,
    every_s: float,
    compute_ms: float,
    prompt: str,
    requests: int = ROUND_REQUESTS,
    **_: Any,
) -> Check:
    """Read the delay ``model`` serves, send a paced round and judge it."""
    refused = judge_config(answer, served_config(server, model))
    if refused is not None:
        return refused
    seen = paced_round(server, model, every_s=every_s, requests=requests, prompt=prompt)
    return judge_round(seen, budget_ms=latency_budget_ms(compute_ms, every_s), every_s=every_s)


def solution(*, server, repo: Repository, model: str, every_s: float, **_: Any) -> int:
    """The reference answer: 1.5 arrival gaps, written into ``model``'s config and reloaded."""
    delay_us = round(SOLUTION_GAPS * every_s * 1e6)
    config = apply_edits(repo.config(model), max_queue_delay_microseconds=delay_us)
    reload(server, model, config, repository=repo)
    return delay_us


QUEUE_DELAY = Exercise(KEY, TITLE, TODO, check_queue_delay, solution)
register(QUEUE_DELAY)
