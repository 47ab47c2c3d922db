"""Notebook 07's exercise: a readiness check that sees a dead Python stub.

``07-ready-check``: the learner writes ``my_ready(http_url, model) -> bool``, the check a balancer
or a kubelet would run against one replica. On Triton 2.51 a model stays READY on
``/v2/models/<model>/ready`` after its Python stub died, while every request to it fails with
``500 Stub process '<model>_0' is not healthy``; a check that reads only that endpoint keeps a
broken replica in the pool.

The check runs the learner's function three times against a live server of its own model: healthy
(it must say True), with the model's stub killed (False), and after the model is reloaded (True
again). The server is left healthy, whatever the answer. The reference solution asks the model's
own ready endpoint and then sends it a one-token request: an answer of 200 means a live stub.
(labkit's own check, ``labkit/cluster/ready_check.py``, counts the stub processes instead, which
costs no inference but must run on the server's host, as a pod's exec probe does.)
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from labkit import proc
from labkit.exercises.check import Check, Exercise, failed, not_done, passed, register
from labkit.server import recover, stubs

if TYPE_CHECKING:
    from labkit.server import TritonServer

KEY = "07-ready-check"
TITLE = "A readiness check that sees a dead stub"
TODO = (
    "write the body of my_ready(http_url, model): return True when the model answers, "
    "False when its Python stub is dead (Triton still calls it ready)."
)
#: How long a dead stub may take to be gone from the process table after SIGKILL.
STUB_GONE_TIMEOUT_S = 10.0

READY_ONLY_HINT = (
    "Triton 2.51 keeps answering 200 on /v2/models/<model>/ready after the stub died. Read "
    "something the stub itself must do: send the model a small request (max_tokens 1) and "
    "expect 200 (a dead stub gives 500 'Stub process ... is not healthy'), or count the "
    "model's triton_python_backend_stub processes, as labkit/cluster/ready_check.py does."
)


def my_ready_reference(http_url: str, model: str) -> bool:
    """Ready when Triton calls the model ready AND a one-token request to it is answered."""
    base = f"{http_url.rstrip('/')}/v2/models/{urllib.parse.quote(model, safe='')}"
    request = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}],
        "parameters": {"max_tokens": 1},
    }
    try:
        with urllib.request.urlopen(f"{base}/ready", timeout=2) as answer:
            if answer.status != 200:
                return False
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{base}/infer",
                data=json.dumps(request).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=5,
        ) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):  # an HTTP error (a 500 included), refused, timed out
        return False


@dataclass(frozen=True)
class Said:
    """What the learner's function returned in each state of the replica (None: it returned
    nothing), and what Triton's own ready endpoint answered with the stub dead."""

    healthy: Any
    dead: Any = None
    repaired: Any = None
    ready_when_dead: int | None = None
    seconds: float | None = None  # the kill, the two calls and the reload, together


def judge(said: Said, model: str) -> Check:
    """The check's outcome from what the function said in the three states."""
    if said.healthy is None:
        return not_done(TITLE, TODO)
    if not isinstance(said.healthy, bool):
        return failed(
            TITLE,
            f"my_ready returned {said.healthy!r} ({type(said.healthy).__name__}) for a healthy "
            f"replica of {model}.",
            "True or False.",
            "return a bool: HAProxy and the kubelet read pass or fail, nothing else.",
        )
    if not said.healthy:
        return failed(
            TITLE,
            f"my_ready said False for a healthy replica of {model} (its stub alive, answering).",
            "True: a check that fails a healthy replica keeps it out of the pool for good.",
            "call the endpoints your function reads by hand on the healthy server and look at "
            "their status codes; a URL needs the http:// it was given, and a request to the "
            "model its input text_input.",
        )
    if said.dead is not False:
        ready = (
            f"; Triton's /v2/models/{model}/ready answered {said.ready_when_dead}"
            if said.ready_when_dead is not None
            else ""
        )
        return failed(
            TITLE,
            f"my_ready said {said.dead!r} with {model}'s Python stub killed{ready}.",
            "False: every request to the model fails while its stub is dead.",
            READY_ONLY_HINT,
        )
    if said.repaired is not True:
        return failed(
            TITLE,
            f"my_ready said True healthy and False with the stub dead, but {said.repaired!r} "
            f"once {model} was reloaded with a new stub.",
            "True again: the reloaded model answers, so the replica may rejoin the pool.",
            "a check must let a repaired replica back in: look at what your function remembers "
            "or counts that a reload does not change (an old process ID, a cached answer).",
        )
    return passed(
        TITLE,
        f"my_ready said True for the healthy replica, False with {model}'s stub killed "
        f"(Triton's own /ready answered {said.ready_when_dead}), and True once it was reloaded"
        + (
            f" ({said.seconds:.0f} s for the kill, the calls and the reload)."
            if said.seconds
            else "."
        ),
    )


def _kill_stub(server: TritonServer, model: str) -> None:
    """SIGKILL the model's (first) Python stub and wait until it is gone."""
    pid = stubs(server)[model][0]
    os.kill(pid, signal.SIGKILL)
    proc.wait_until(lambda: pid not in stubs(server).get(model, []), STUB_GONE_TIMEOUT_S)


def _ready_status(server: TritonServer, model: str) -> int:
    url = f"http://{server.http_url}/v2/models/{urllib.parse.quote(model, safe='')}/ready"
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def check(
    answer: Callable[[str, str], Any], *, server: TritonServer, model: str, **_: Any
) -> Check:
    """Run ``answer`` against ``server`` healthy, with ``model``'s stub killed, then reloaded."""
    url = f"http://{server.http_url}"
    healthy = answer(url, model)
    if healthy is not True:  # nothing to learn from killing the stub yet
        return judge(Said(healthy), model)
    started = time.monotonic()
    _kill_stub(server, model)
    try:
        ready_when_dead = _ready_status(server, model)
        dead = answer(url, model)
    finally:
        recover(server, [model])  # the replica is left healthy, whatever the answer did
    repaired = answer(url, model)
    return judge(Said(True, dead, repaired, ready_when_dead, time.monotonic() - started), model)


def solution(**_: Any) -> Callable[[str, str], bool]:
    return my_ready_reference


register(Exercise(KEY, TITLE, TODO, check, solution))
