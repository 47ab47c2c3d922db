"""Notebook 06's exercise: cap the requests the in-flight engine runs at once, for a
time-to-first-token budget.

The lab's in-flight model (``smollm2_inflight``) admits a request as soon as one of its
``max_running_requests`` slots is free; a request that finds them all taken waits for an answer
to end. The learner sets the cap in the run's ``config.pbtxt`` and reloads the model live; the
check reads the cap from the config the server reports, sends ``clients`` streaming requests at
once (the same short prompt, :data:`TOKENS` new tokens each) and compares the time to first token
(TTFT) of the last client to have its first token with the budget: :data:`BUDGET_STEPS` steps of
the engine, a step being the time between two tokens of one answer (the ITL) measured in the same
burst. A client given a slot at once gets its first token within a step or two; a client that
waits for a slot waits for a whole answer of :data:`TOKENS` steps, so the budget tells the two
apart on any host, however fast. The reference solution is the smallest cap that meets it: one
slot per client.
"""

from __future__ import annotations

import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from labkit import streaming
from labkit.exercises.check import Check, Exercise, failed, passed, register
from labkit.repository import Repository, apply_edits
from labkit.server.live import reload, served_config

KEY = "06-first-token-cap"
TITLE = "A cap on running requests for a first-token budget"
PARAMETER = "max_running_requests"
PROMPT = "Once upon a time there was"  # its greedy answer runs past TOKENS tokens
TOKENS = 12  # new tokens per answer: an answer takes this many steps of the engine
BUDGET_STEPS = TOKENS // 2  # the last first token within half an answer: no one waits for one
ROUNDS = 2  # a burst over the budget is sent again before the check says failed
TODO = (
    f"set MY_CAP to the smallest {PARAMETER} that meets the budget, then write it to the config "
    "and reload the model (the two commented lines of the cell), and run this cell again."
)


@dataclass(frozen=True)
class Burst:
    """One burst of clients streaming at once: each client's TTFT and tokens, and the engine's
    step (the median time between two tokens of one answer)."""

    ttft_s: tuple[float, ...]
    tokens: tuple[int, ...]
    step_s: float

    @property
    def last_s(self) -> float:
        """The TTFT of the last client to get its first token."""
        return max(self.ttft_s)

    @property
    def last_steps(self) -> float:
        return self.last_s / self.step_s


def served_cap(server: Any, model: str) -> int | None:
    """The cap in the config the server reports for ``model`` (None when it sets none)."""
    value = served_config(server, model).get("parameters", {}).get(PARAMETER, {})
    text = value.get("string_value", "").strip()
    return int(text) if text.isdigit() else None


def burst(server: Any, model: str, clients: int, tokens: int = TOKENS) -> Burst:
    """Send ``clients`` streaming requests at once and time each one's tokens."""
    start = threading.Barrier(clients, timeout=60.0)

    def one(_: int):
        start.wait()
        return streaming.measure(server.http_url, model, PROMPT, max_tokens=tokens)

    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(one, range(clients)))
    gaps = [1 / a.tokens_per_s for a in answers if a.tokens > 1 and a.tokens_per_s > 0]
    if not gaps:
        raise ValueError(
            f"no answer had two tokens or more (tokens: {[a.tokens for a in answers]})"
        )
    return Burst(
        tuple(a.ttft_s for a in answers), tuple(a.tokens for a in answers), statistics.median(gaps)
    )


def judge(answer: Any, cap: int | None, bursts: list[Burst], clients: int) -> Check:
    """The verdict on ``answer`` from the cap the server reports and the bursts it answered
    (the best of them counts; none when the cap already decides)."""
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 1:
        return failed(
            TITLE,
            f"your answer is {answer!r}.",
            f"a whole number of requests, 1 or more: the model refuses any other {PARAMETER} "
            "(its load fails with that reason, and the reload keeps the previous config).",
            "write the number of requests the engine may run at once, for example MY_CAP = 3.",
        )
    if cap != answer:
        return failed(
            TITLE,
            f"the server runs the model with {PARAMETER} "
            f"{'not set (the engine default, 16)' if cap is None else cap}; your answer is {answer}.",
            f"the config the server reports to say {PARAMETER} {answer}.",
            "write it to the run's config and reload the model: the two commented lines of your "
            "cell, uncommented. If the reload raised an error, Triton refused the config and kept "
            "the old one: read its reason.",
        )
    best = min(bursts, key=lambda b: b.last_steps)
    budget_s = BUDGET_STEPS * best.step_s
    rounds = f", in the better of {len(bursts)} rounds" if len(bursts) > 1 else ""
    seen = (
        f"{PARAMETER} {cap} on the server; of {clients} clients streaming at once, the first got "
        f"its first token after {min(best.ttft_s):.2f} s, the last after {best.last_s:.2f} s: "
        f"{best.last_steps:.1f} steps of the engine, one step (the time between two tokens of an "
        f"answer) taking {best.step_s * 1000:.0f} ms{rounds}"
    )
    if best.last_steps <= BUDGET_STEPS:
        if cap > clients:
            return failed(
                TITLE,
                seen + ": within the budget.",
                f"the smallest cap that meets the budget for {clients} clients.",
                f"the budget is met, but {cap} slots are more than {clients} clients take. Each "
                "slot beyond the clients you plan for lets one more answer into every step when "
                "more clients come, and a step over more answers is longer: every answer's "
                "tokens come more slowly. Lower the cap until the next lower one would miss.",
            )
        return passed(TITLE, seen + f": within the budget of {BUDGET_STEPS} steps.")
    if cap >= clients:
        hint = (
            "every client had a slot, so its first token should have come within a step or two; "
            "the host was busy during the burst. Run this cell again."
        )
    else:
        slots = "1 slot" if cap == 1 else f"{cap} slots"
        hint = (
            f"with {slots}, the clients beyond the first {cap} wait for a slot, and a slot is "
            f"freed only when an answer of {TOKENS} tokens ({TOKENS} steps) ends. How many slots "
            f"do {clients} clients that arrive together need?"
        )
    return failed(
        TITLE,
        seen + ".",
        f"the last client's first token within {BUDGET_STEPS} steps "
        f"({budget_s:.2f} s at this step).",
        hint,
    )


def check(answer: Any, *, server: Any, model: str, clients: int, **_: Any) -> Check:
    """Read the served cap; where it is the answer, send bursts of ``clients`` at once."""
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 1:
        return judge(answer, None, [], clients)
    cap = served_cap(server, model)
    if cap != answer:
        return judge(answer, cap, [], clients)
    bursts: list[Burst] = []
    for _round in range(ROUNDS):
        bursts.append(burst(server, model, clients))
        if bursts[-1].last_steps <= BUDGET_STEPS:
            break  # a burst within the budget decides; one over it is sent again
    return judge(answer, cap, bursts, clients)


def solution(*, server: Any, repo: Repository, model: str, clients: int, **_: Any) -> int:
    """One slot per client, written to the run's config and reloaded live."""
    capped = apply_edits(repo.config(model), parameters={PARAMETER: str(clients)})
    reload(server, model, capped, repository=repo)
    return clients


register(Exercise(KEY, TITLE, TODO, check, solution))
