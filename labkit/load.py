"""Load from Python threads: requests to one model, every outcome kept (labkit's load generator).

:class:`Load` sends requests to a model from ``concurrency`` threads and records each one's
:class:`Outcome`. It is the one load generator of the lab, for three uses:

- **a closed loop** (``rate_per_s=None``): each thread sends its next request as soon as the last
  one is answered, until stopped (the soak's faults, ``tests/test_faults.py``);
- **a paced load** (``rate_per_s=20``): a request every ``1/rate_per_s`` seconds, never more than
  ``concurrency`` in flight; a request whose moment has passed is sent at once (the cluster's
  failover experiment);
- **a workload streamed once** (:func:`stream_workload`): each prompt of a
  :class:`labkit.profiling.Workload` with its own ``max_tokens``, token responses counted (what
  this process's own client costs, next to AIPerf).

Three endpoints: ``generate`` (``/v2/models/<m>/generate``, JSON), ``infer`` (``/infer``, KServe
v2 tensors) and ``stream`` (``/generate_stream``, server-sent events through
:func:`labkit.streaming.responses`, one response per token then a closing one). ``generate`` and
``infer`` keep one HTTP connection alive per thread (``http.client``). A load ends when stopped
(``stop()``, or leaving its ``with`` block), after ``max_requests`` requests or once
``max_duration_s`` has passed since it started, whichever comes first.

>>> with Load(server.http_url, "smollm2", max_tokens=2) as load:
...     load.wait_for(8)
>>> load.summary()["failed"]
0
"""

from __future__ import annotations

import http.client
import json
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from labkit import proc, streaming
from labkit.client import INPUT_NAME, error_text, infer_body, model_batches, server_address
from labkit.errors import ConfigError, InferenceError, ServerTimeoutError

if TYPE_CHECKING:
    from labkit.profiling import Workload

log = logging.getLogger(__name__)

#: What a :class:`Load` can send: ``/generate``, ``/infer`` or ``/generate_stream``.
ENDPOINTS = ("generate", "infer", "stream")


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent and when it ended (``time.monotonic()``), the HTTP status
    (0: no HTTP answer), the error text of a failure ("" when answered), the token responses of a
    streamed answer (every response but the closing one; 0 for the other endpoints) and the
    value of the load's ``replica_header`` in the answer ("" without one)."""

    sent: float
    ended: float
    status: int
    error: str = ""
    tokens: int = 0
    replica: str = ""

    @property
    def ok(self) -> bool:
        """Answered in full: status 200 and no error (a stream can fail after its 200)."""
        return self.status == 200 and not self.error

    @property
    def latency_s(self) -> float:
        return self.ended - self.sent

    @property
    def cause(self) -> str:
        """The failure in a few words, to count failures by: ``"400: Stub process ..."``."""
        return f"{self.status or 'no answer'}: {self.error[:90]}"


class Load:
    """Requests to ``model`` at ``url`` from ``concurrency`` threads; a context manager.

    Request ``i`` sends ``workload.prompts[i]`` with ``workload.max_tokens[i]`` (cycling through
    the workload) or else ``prompt`` with ``max_tokens`` (not sent when None), plus
    ``parameters``. ``rate_per_s=None`` is a closed loop; a number paces the requests. It stops
    after ``max_requests`` requests or ``max_duration_s`` seconds (None: no such bound), or when
    stopped. ``timeout_s`` bounds the wait for each answer. ``batched`` says whether the model
    has a batch dimension (``infer`` only; asked from the server when None).
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        endpoint: str = "generate",
        prompt: str = "Hi",
        max_tokens: int | None = None,
        workload: Workload | None = None,
        parameters: dict | None = None,
        concurrency: int = 4,
        rate_per_s: float | None = None,
        max_requests: int | None = None,
        max_duration_s: float | None = None,
        timeout_s: float = 120.0,
        replica_header: str | None = None,
        batched: bool | None = None,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise ConfigError(f"endpoint={endpoint!r}; use one of {', '.join(ENDPOINTS)}")
        if concurrency < 1 or (rate_per_s is not None and rate_per_s <= 0):
            raise ConfigError(
                f"concurrency={concurrency} must be >= 1 and rate_per_s={rate_per_s} > 0 "
                "(or None for a closed loop)"
            )
        if (max_requests is not None and max_requests < 0) or (
            max_duration_s is not None and max_duration_s < 0
        ):
            raise ConfigError(
                f"max_requests={max_requests} and max_duration_s={max_duration_s} must be >= 0 "
                "(or None: no bound)"
            )
        self.address = server_address(url)
        self.host, _, port = self.address.rpartition(":")
        self.port = int(port)
        self.model = model
        self.endpoint = endpoint
        self.rate_per_s = rate_per_s
        self.max_requests = max_requests
        self.max_duration_s = max_duration_s
        self.timeout_s = timeout_s
        self.replica_header = replica_header
        self.path = f"/v2/models/{model}/{'generate_stream' if endpoint == 'stream' else endpoint}"
        if workload is not None:
            requests = list(zip(workload.prompts, workload.max_tokens, strict=True))
        else:
            requests = [(prompt, max_tokens)]
        if endpoint == "infer" and batched is None:
            batched = model_batches(self.address, model)
        self._requests = [
            (p, self._parameters(parameters, tokens), self._body(p, parameters, tokens, batched))
            for p, tokens in requests
        ]
        self.started: float | None = None
        self._outcomes: list[Outcome] = []
        self._claimed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"labkit-load-{i}", daemon=True)
            for i in range(concurrency)
        ]

    def __repr__(self) -> str:
        pace = f"{self.rate_per_s:g}/s" if self.rate_per_s else "closed loop"
        return (
            f"Load({self.endpoint} {self.address}{self.path}, {len(self._threads)} threads, "
            f"{pace}, {len(self._outcomes)} requests, running={self.running})"
        )

    # -- what each request sends ---------------------------------------------------------------
    @staticmethod
    def _parameters(parameters: dict | None, max_tokens: int | None) -> dict:
        merged = dict(parameters or {})
        if max_tokens is not None:
            merged["max_tokens"] = int(max_tokens)
        return merged

    def _body(
        self, prompt: str, parameters: dict | None, max_tokens: int | None, batched: bool | None
    ) -> bytes:
        merged = self._parameters(parameters, max_tokens)
        if self.endpoint == "stream":
            return b""  # labkit.streaming builds the request
        if self.endpoint == "generate":
            return json.dumps({INPUT_NAME: prompt, **merged}).encode()
        return json.dumps(infer_body(prompt, batched=bool(batched), parameters=merged)).encode()

    # -- the threads ---------------------------------------------------------------------------
    def _claim(self) -> tuple[int, float] | None:
        """The next request's number and the moment to send it, or None when the load is over."""
        with self._lock:
            index = self._claimed
            if self.max_requests is not None and index >= self.max_requests:
                return None
            self._claimed += 1
        slot = self.started + index / self.rate_per_s if self.rate_per_s else time.monotonic()
        if self.max_duration_s is not None and slot - self.started > self.max_duration_s:
            return None
        return index, slot

    def _work(self) -> None:
        connection = None
        try:
            while not self._stop.is_set():
                claim = self._claim()
                if claim is None or self._stop.wait(max(0.0, claim[1] - time.monotonic())):
                    return
                prompt, parameters, body = self._requests[claim[0] % len(self._requests)]
                if self.endpoint == "stream":
                    outcome = self._stream(prompt, parameters)
                else:
                    if connection is None:
                        connection = http.client.HTTPConnection(
                            self.host, self.port, timeout=self.timeout_s
                        )
                    outcome = self._post(connection, body)
                    if outcome.status == 0:  # the connection is broken: a new one next time
                        connection.close()
                        connection = None
                with self._lock:
                    self._outcomes.append(outcome)
        finally:
            if connection is not None:
                connection.close()

    def _post(self, connection: http.client.HTTPConnection, body: bytes) -> Outcome:
        sent = time.monotonic()
        try:
            connection.request("POST", self.path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            # error_text reads the body of any response, not only of urllib's HTTPError
            error = "" if response.status == 200 else str(error_text(response))
            if not error:
                response.read()  # the whole body, so that the connection can carry the next one
        except (OSError, http.client.HTTPException) as exc:
            return Outcome(sent, time.monotonic(), 0, repr(exc))
        replica = response.getheader(self.replica_header, "") if self.replica_header else ""
        return Outcome(sent, time.monotonic(), response.status, error, replica=replica)

    def _stream(self, prompt: str, parameters: dict) -> Outcome:
        sent, count = time.monotonic(), 0
        try:
            for _ in streaming.responses(
                self.address, self.model, prompt, timeout_s=self.timeout_s, **parameters
            ):
                count += 1
        except InferenceError as exc:
            status = exc.status if isinstance(exc.status, int) else 0
            if exc.status == "in stream":  # refused after the stream began: HTTP said 200
                status = 200
            return Outcome(sent, time.monotonic(), status, exc.server_message or str(exc), count)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return Outcome(sent, time.monotonic(), 0, repr(exc), count)
        # one response per token, then the closing one
        return Outcome(sent, time.monotonic(), 200, tokens=max(0, count - 1))

    # -- start and stop ------------------------------------------------------------------------
    def start(self) -> Load:
        """Start the threads (once; ``with Load(...)`` calls it)."""
        if self.started is None:
            self.started = time.monotonic()
            for thread in self._threads:
                thread.start()
        return self

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        """Send no more requests; wait (``timeout_s`` and a little) for those in flight. Idempotent."""
        self._stop.set()
        self._join(self.timeout_s + 5)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait until a bounded load has sent its last request and had its answer."""
        if self.max_requests is None and self.max_duration_s is None and not self._stop.is_set():
            raise ConfigError(
                "this load has no max_requests or max_duration_s and runs until stopped; "
                "call stop() instead of join()"
            )
        if not self._join(timeout_s):
            raise ServerTimeoutError(
                f"{self!r} still had requests in flight after {timeout_s:g} s; pass a larger "
                "timeout_s or fewer max_requests"
            )

    def _join(self, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = [thread.name for thread in self._threads if thread.is_alive()]
        if left:
            log.warning("%s: threads %s still wait for an answer", self.path, left)
        return not left

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what happened -------------------------------------------------------------------------
    @property
    def outcomes(self) -> list[Outcome]:
        """Every request so far, in the order they ended (a copy)."""
        with self._lock:
            return list(self._outcomes)

    def answered(
        self, since: float = 0.0, until: float = float("inf"), replica: str | None = None
    ) -> list[Outcome]:
        """The requests sent in ``[since, until)`` and answered (by ``replica`` when given)."""
        return [
            o
            for o in self.outcomes
            if o.ok and since <= o.sent < until and (replica is None or o.replica == replica)
        ]

    def successes(self, since: float = 0.0, until: float = float("inf")) -> int:
        """How many requests sent in ``[since, until)`` were answered."""
        return len(self.answered(since, until))

    def failures(self, since: float = 0.0, until: float = float("inf")) -> list[Outcome]:
        """The requests sent in ``[since, until)`` that failed."""
        return [o for o in self.outcomes if not o.ok and since <= o.sent < until]

    def wait_for(self, count: int, since: float = 0.0, timeout_s: float = 120.0) -> None:
        """Wait until ``count`` requests sent after ``since`` were answered."""
        over = False

        def settled() -> bool:
            nonlocal over
            over = self.started is not None and not self.running  # before counting: no race
            return self.successes(since) >= count or over

        proc.wait_until(settled, timeout_s, 0.05)
        if self.successes(since) < count:
            failures = [o.cause for o in self.failures(since)[-3:]]
            raise ServerTimeoutError(
                f"{self.address}{self.path} answered {self.successes(since)} of {count} "
                f"requests {'before the load ended' if over else f'within {timeout_s:g} s'}"
                f"; last failures: {failures}"
            )

    def summary(self) -> dict:
        """Requests, answered, failed (by cause), tokens, seconds from the start to the last
        answer, answers and tokens a second, and the p50 / p99 latency of the answered ones."""
        outcomes = self.outcomes
        answered = [o for o in outcomes if o.ok]
        seconds = max((o.ended for o in outcomes), default=self.started or 0.0) - (
            self.started or 0.0
        )
        tokens = sum(o.tokens for o in answered)
        latencies = sorted(o.latency_s * 1000 for o in answered)
        return {
            "requests": len(outcomes),
            "answered": len(answered),
            "failed": len(outcomes) - len(answered),
            "failures_by_cause": dict(Counter(o.cause for o in outcomes if not o.ok)),
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "answered_per_s": round(len(answered) / seconds, 2) if seconds > 0 else None,
            "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
            "p50_ms": round(_percentile(latencies, 50), 2) if latencies else None,
            "p99_ms": round(_percentile(latencies, 99), 2) if latencies else None,
        }


def _percentile(values: Sequence[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def stream_workload(url: str, model: str, workload: Workload, concurrency: int) -> dict:
    """Each request of ``workload`` streamed once by ``concurrency`` threads of this process
    (``/generate_stream``, its own ``max_tokens`` each): output tokens/s, seconds and the CPU
    seconds this process used. Raises :class:`~labkit.errors.InferenceError` if any failed."""
    client_before = time.process_time()
    started = time.monotonic()
    with Load(
        url,
        model,
        endpoint="stream",
        workload=workload,
        concurrency=concurrency,
        max_requests=len(workload),
        timeout_s=600.0,
    ) as load:
        load.join()
    seconds = time.monotonic() - started
    failed = load.failures()
    if failed:
        raise InferenceError(
            f"{len(failed)} of {len(workload)} streamed requests to {model!r} failed: "
            f"{sorted({o.cause for o in failed})[:3]}"
        )
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": round(sum(o.tokens for o in load.outcomes) / seconds, 2),
        "seconds": round(seconds, 2),
        "client_cpu_s": round(time.process_time() - client_before, 2),
    }
