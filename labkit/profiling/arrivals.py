"""Requests that arrive one at a time, as independent users send them, and what Triton did with
them: its statistics (``/v2/models/<model>/stats``) over the load, per batch size.

:class:`Served` reads those statistics; ``after - before`` is what a model served in between.
:func:`measure_arrivals` sends a paced (or closed-loop) load and returns the batches it made, the
queue wait and the model's time; :func:`delay_rounds` alternates a model and its twin with a
queue delay, round by round, so that the host's drift weighs on both alike.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pandas as pd

from labkit import proc
from labkit.errors import ConfigError, InferenceError
from labkit.load import Load

#: The settings :func:`delay_rounds` measures, named alike in every table and chart.
NO_DELAY, DELAY, LONE = "paced, no delay", "paced, queue delay", "1 client, queue delay"
#: How long to wait for Triton's statistics to count the last answered request.
COUNTERS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Served:
    """Triton's statistics for one model (``/v2/models/<model>/stats``) at one moment; ``after -
    before`` is what it served in between. Sums: ``queue_ms`` and ``run_ms`` over requests (each
    request is charged its whole batch's run), ``batches`` over executions by batch size."""

    requests: int = 0
    queue_ms: float = 0.0
    run_ms: float = 0.0
    batches: dict[int, tuple[int, float]] = field(default_factory=dict)  # size: (runs, ms)
    at_s: float = 0.0  # time.monotonic() when read

    @staticmethod
    def read(server, model: str) -> Served:
        """``model``'s statistics now (all its versions), from ``server``."""
        url = f"http://{server.http_url}/v2/models/{model}/stats"
        try:
            with urllib.request.urlopen(url, timeout=COUNTERS_TIMEOUT_S) as answer:
                return Served.parse(json.load(answer))
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            raise InferenceError(
                f"cannot read Triton's statistics of {model!r} at {url}: {exc!r}"
            ) from exc

    @staticmethod
    def parse(answer: dict) -> Served:
        """:meth:`read` of an answer of Triton's statistics API, read now."""
        versions = answer["model_stats"]
        batches: dict[int, tuple[int, float]] = {}
        for stats in versions:
            for b in stats.get("batch_stats", []):
                runs, ms = batches.get(int(b["batch_size"]), (0, 0.0))
                infer = b["compute_infer"]
                batches[int(b["batch_size"])] = (runs + int(infer["count"]), ms + infer["ns"] / 1e6)
        inference = [s["inference_stats"] for s in versions]
        return Served(
            requests=sum(int(i["success"]["count"]) for i in inference),
            queue_ms=sum(i["queue"]["ns"] for i in inference) / 1e6,
            run_ms=sum(i["compute_infer"]["ns"] for i in inference) / 1e6,
            batches=batches,
            at_s=time.monotonic(),
        )

    def __sub__(self, before: Served) -> Served:
        batches = {}
        for size, (runs, ms) in sorted(self.batches.items()):
            runs_before, ms_before = before.batches.get(size, (0, 0.0))
            if runs > runs_before:
                batches[size] = (runs - runs_before, ms - ms_before)
        return Served(
            self.requests - before.requests,
            self.queue_ms - before.queue_ms,
            self.run_ms - before.run_ms,
            batches,
            self.at_s - before.at_s,
        )

    @property
    def executions(self) -> int:
        return sum(runs for runs, _ in self.batches.values())

    @property
    def compute_ms(self) -> float:
        """The model's time in all, each execution counted once."""
        return sum(ms for _, ms in self.batches.values())


def measure_arrivals(
    server,
    model: str,
    *,
    every_s: float | None,
    requests: int,
    prompt: str,
    clients: int = 8,
    timeout_s: float = 300.0,
) -> dict:
    """Send ``requests`` requests to ``model``, one every ``every_s`` seconds (paced, at most
    ``clients`` in flight), or from ``clients`` closed-loop clients when ``every_s`` is None.

    The row, from Triton's statistics over the load: ``batch`` (requests per execution),
    ``queue_ms`` and ``run_ms`` (a request's average wait, and its batch's run), ``compute_ms``
    (one execution, on average), ``model_ms_per_request`` (the model's time over the requests);
    from the client: ``mean_ms``, ``p50_ms`` and ``max_ms`` (the slowest), ``executions`` (Triton's
    count), and ``seconds``, from the first send to the last
    answer (paced: at least ``requests`` gaps, so a kept-up pace counts as the pace).
    """
    if requests < 1 or (every_s is not None and every_s <= 0):
        raise ConfigError(
            f"requests={requests} must be >= 1 and every_s={every_s} > 0 (or None: closed loop)"
        )
    before = Served.read(server, model)
    load = Load(
        server.http_url,
        model,
        endpoint="infer",
        prompt=prompt,
        concurrency=clients,
        rate_per_s=1.0 / every_s if every_s else None,
        max_requests=requests,
        timeout_s=timeout_s,
    )
    with load:
        load.join(timeout_s * requests)
    summary = load.summary()
    if summary["failed"]:
        raise InferenceError(
            f"{summary['failed']} of {requests} requests to {model!r} failed: "
            f"{summary['failures_by_cause']}"
        )
    answered = summary["answered"]
    seen = [before]  # Triton counts a request just after it sends the answer

    def counted() -> bool:
        seen.append(Served.read(server, model) - before)
        return seen[-1].requests >= answered

    proc.wait_until(counted, COUNTERS_TIMEOUT_S)
    served = seen[-1]
    latencies = [o.latency_s * 1000 for o in load.outcomes if o.ok]
    runs, n = served.executions, served.requests
    return {
        "requests": answered,
        "batch": n / runs if runs else math.nan,
        "queue_ms": served.queue_ms / n if n else math.nan,
        "run_ms": served.run_ms / n if n else math.nan,
        "compute_ms": served.compute_ms / runs if runs else math.nan,
        "model_ms_per_request": served.compute_ms / n if n else math.nan,
        "mean_ms": sum(latencies) / len(latencies),
        "p50_ms": float(summary["p50_ms"]),
        "max_ms": max(latencies),
        "executions": runs,
        "seconds": max(float(summary["seconds"]), requests * (every_s or 0.0)),
    }


def delay_rounds(
    server,
    plain: str,
    delayed: str,
    *,
    every_s: float,
    requests: int,
    prompt: str,
    rounds: int = 2,
    lone_requests: int = 0,
) -> pd.DataFrame:
    """The same paced arrivals to ``plain`` (no queue delay) and ``delayed`` (its twin with one)
    in alternating rounds, then ``lone_requests`` from one closed-loop client to ``delayed``.
    One row per round and setting (:data:`NO_DELAY`, :data:`DELAY`, :data:`LONE`)."""
    if rounds < 1:
        raise ConfigError(f"rounds must be 1 or more, got {rounds}")
    rows = []
    for r in range(1, rounds + 1):
        for setting, model in ((NO_DELAY, plain), (DELAY, delayed)):
            row = measure_arrivals(server, model, every_s=every_s, requests=requests, prompt=prompt)
            rows.append({"round": r, "setting": setting, **row})
    if lone_requests:
        row = measure_arrivals(
            server, delayed, every_s=None, requests=lone_requests, prompt=prompt, clients=1
        )
        rows.append({"round": 1, "setting": LONE, **row})
    return pd.DataFrame(rows)


def paced_interval_s(compute_ms: float) -> float:
    """The gap between paced arrivals: twice one request's compute, rounded up to 0.1 s, so that
    without a delay each request finds the model idle even on a host running twice as slow."""
    if not compute_ms > 0:
        raise ConfigError(f"one request's compute must be > 0 ms, got {compute_ms}")
    return math.ceil(2 * compute_ms / 100) / 10


def queue_delay_us(every_s: float) -> int:
    """A delay of 2.5 arrival gaps: a batch's first request waits for the next two."""
    return int(round(2.5 * every_s * 1e6))
