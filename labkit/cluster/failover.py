"""Failover, measured: a steady load through the balancer while one replica is killed.

:class:`Traffic` sends inference requests at a fixed rate through the cluster's HTTP address and
keeps every outcome: when it was sent and answered, the HTTP status, the replica that answered
(HAProxy's ``X-Labkit-Replica`` header) and the error. :func:`failover` runs one experiment:

1. traffic for ``warmup_s``;
2. the fault: SIGKILL of a replica's ``tritonserver`` (``fault="server"``), or of one of its
   Python stubs (``fault="stub"``);
3. the moment HAProxy takes the replica out of the pool (polled on its admin socket);
4. the repair: for a dead server the cluster's supervisor starts a replacement on the same ports;
   for a dead stub :func:`labkit.server.recover` restarts the model on the same server;
5. the moment the replica is back in the pool, and the first request it answers after that;
6. ``settle_s`` more of traffic.

Every figure is measured from the kill. The load stays on loopback and is bounded in count and
time. A benchmark, not a test: the machine's load average is part of the figures.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pandas as pd

from labkit.client import INPUT_NAME, model_batches
from labkit.cluster.balancer import REPLICA_HEADER
from labkit.cluster.pool import FAULTS, Cluster
from labkit.errors import ConfigError, ServerTimeoutError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """One request: sent and answered (``time.monotonic()``), status (0: no HTTP answer),
    the replica that answered, and the error text of a failure."""

    sent: float
    done: float
    status: int
    replica: str
    error: str


class Traffic:
    """``rate_per_s`` inference requests a second to ``model`` through ``url``, from ``workers``
    threads with a kept-alive connection each; stops by itself after ``max_requests`` or
    ``max_duration_s``. A request whose slot has passed is sent at once (never more than
    ``workers`` in flight)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        prompt: str = "Hi",
        rate_per_s: float = 20.0,
        workers: int = 4,
        max_requests: int = 5000,
        max_duration_s: float = 180.0,
        timeout_s: float = 60.0,
        parameters: dict | None = None,
    ) -> None:
        if rate_per_s <= 0 or workers < 1:
            raise ConfigError(f"rate_per_s={rate_per_s} must be > 0 and workers={workers} >= 1")
        address = url.split("://", 1)[-1].rstrip("/")
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.path = f"/v2/models/{model}/infer"
        shape = [1, 1] if model_batches(address, model) else [1]
        body: dict = {
            "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": shape, "data": [prompt]}]
        }
        if parameters:
            body["parameters"] = parameters
        self.body = json.dumps(body).encode()
        self.rate_per_s = rate_per_s
        self.max_requests = max_requests
        self.max_duration_s = max_duration_s
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self.started: float | None = None
        self._threads = [
            threading.Thread(target=self._work, name=f"labkit-traffic-{i}", daemon=True)
            for i in range(workers)
        ]

    def _next_slot(self) -> float | None:
        with self._lock:
            if self._sent >= self.max_requests:
                return None
            slot = self.started + self._sent / self.rate_per_s
            self._sent += 1
        return slot if slot - self.started <= self.max_duration_s else None

    def _work(self) -> None:
        connection = None
        try:
            while not self._stop.is_set():
                slot = self._next_slot()
                if slot is None or self._stop.wait(max(0.0, slot - time.monotonic())):
                    return
                if connection is None:
                    connection = http.client.HTTPConnection(
                        self.host, self.port, timeout=self.timeout_s
                    )
                outcome = self._send(connection)
                if outcome.status == 0:  # the connection is broken: a new one next time
                    connection.close()
                    connection = None
                self.outcomes.append(outcome)
        finally:
            if connection is not None:
                connection.close()

    def _send(self, connection: http.client.HTTPConnection) -> Outcome:
        sent = time.monotonic()
        try:
            connection.request("POST", self.path, self.body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            return Outcome(sent, time.monotonic(), 0, "", repr(exc))
        error = "" if response.status == 200 else _error_text(data)
        replica = response.getheader(REPLICA_HEADER, "")
        return Outcome(sent, time.monotonic(), response.status, replica, error)

    def answered(self, replica: str | None = None, since: float = 0.0) -> list[Outcome]:
        return [
            o
            for o in list(self.outcomes)
            if o.status == 200 and o.sent >= since and (replica is None or o.replica == replica)
        ]

    def failed(self) -> list[Outcome]:
        return [o for o in list(self.outcomes) if o.status != 200]

    def frame(self, origin: float = 0.0) -> pd.DataFrame:
        """One row per request, times in seconds since ``origin``."""
        rows = [
            {
                "sent_s": round(o.sent - origin, 4),
                "done_s": round(o.done - origin, 4),
                "latency_ms": round((o.done - o.sent) * 1000, 2),
                "status": o.status,
                "replica": o.replica or "-",
                "ok": o.status == 200,
                "error": o.error,
            }
            for o in list(self.outcomes)
        ]
        columns = ["sent_s", "done_s", "latency_ms", "status", "replica", "ok", "error"]
        return pd.DataFrame(rows, columns=columns)

    def __enter__(self) -> Traffic:
        self.started = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)


def _error_text(data: bytes) -> str:
    text = data.decode("utf-8", "replace")
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text


class PoolWatch:
    """Polls HAProxy's view of the pool every ``interval_s`` and keeps each change of state."""

    def __init__(self, cluster: Cluster, interval_s: float = 0.02) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.changes: list[tuple[float, str, str]] = []
        self._state: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="labkit-pool-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                view = self.cluster.balancer.servers()
            except OSError:
                continue
            now = time.monotonic()
            for name, row in view.items():
                status = row["status"].split()[0]  # "DOWN 1/2" while going down -> DOWN
                if self._state.get(name) != status:
                    self._state[name] = status
                    self.changes.append((now, name, status))

    def first(self, replica: str, status_is_up: bool, after: float) -> float | None:
        """The first time after ``after`` that ``replica`` became UP (or anything but UP)."""
        for t, name, status in list(self.changes):
            if name == replica and t >= after and (status == "UP") == status_is_up:
                return t
        return None

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class FailoverResult:
    """The figures of one experiment (``figures``), every request (``requests``, seconds since
    the kill), the pool's changes and the cluster's events (both seconds since the kill)."""

    figures: dict
    requests: pd.DataFrame = field(repr=False)
    pool_changes: pd.DataFrame = field(repr=False)
    events: pd.DataFrame = field(repr=False)

    def table(self) -> pd.DataFrame:
        """The figures as a two-column table, for a notebook."""
        skip = {"failures_by_cause"}
        rows = [(k, v) for k, v in self.figures.items() if k not in skip]
        rows += [(f"failed: {cause}", n) for cause, n in self.figures["failures_by_cause"].items()]
        return pd.DataFrame(rows, columns=["figure", "value"]).set_index("figure")


def _wait(condition, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := condition()) is None:
        if time.monotonic() > deadline:
            raise ServerTimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.02)
    return value


def failover(
    cluster: Cluster,
    model: str,
    *,
    fault: str = "server",
    replica: int | str = 0,
    rate_per_s: float = 20.0,
    workers: int = 4,
    warmup_s: float = 3.0,
    settle_s: float = 3.0,
    timeout_s: float = 120.0,
    prompt: str = "Hi",
    parameters: dict | None = None,
) -> FailoverResult:
    """Kill one replica under a steady load through the balancer; measure what the clients saw."""
    if fault not in FAULTS:
        raise ConfigError(f"fault={fault!r}; use one of {', '.join(FAULTS)}")
    name = cluster.replica(replica).name
    cluster.wait_ready(timeout_s)
    load_before = os.getloadavg()
    traffic = Traffic(
        cluster.http_url,
        model,
        prompt=prompt,
        rate_per_s=rate_per_s,
        workers=workers,
        max_duration_s=timeout_s * 2 + warmup_s + settle_s,
        parameters=parameters,
    )
    with PoolWatch(cluster) as watch, traffic:
        _wait(lambda: traffic.answered(name) or None, timeout_s, f"a request answered by {name}")
        time.sleep(warmup_s)
        killed = cluster.kill(name, fault, model if fault == "stub" else None)
        left = _wait(
            lambda: watch.first(name, False, killed), timeout_s, f"{name} leaving the pool"
        )
        repaired = None
        if fault == "stub":
            cluster.recover(name)
            repaired = time.monotonic()
        rejoined = _wait(lambda: watch.first(name, True, left), timeout_s, f"{name} rejoining")
        served = _wait(
            lambda: min((o.done for o in traffic.answered(name, since=rejoined)), default=None),
            timeout_s,
            f"a request answered by {name} after it rejoined",
        )
        time.sleep(settle_s)
    events = cluster.events()
    if fault == "server":
        repaired = cluster.when(name, "replacement ready", after=killed)
    failures = traffic.failed()
    causes = Counter(f"{o.status or 'no answer'}: {o.error[:90]}" for o in failures)
    # Answered by it after it left and before it was seen back (the watch polls every 20 ms).
    after_left = [
        o for o in traffic.answered(name) if o.sent > left + 0.05 and o.done < rejoined - 0.05
    ]
    figures = {
        "fault": f"SIGKILL of {name}'s {'tritonserver' if fault == 'server' else 'Python stub'}",
        "replicas": cluster.size,
        "rate_per_s": rate_per_s,
        "requests": len(traffic.outcomes),
        "answered": len(traffic.outcomes) - len(failures),
        "failed": len(failures),
        "failures_by_cause": dict(causes),
        "s_to_leave_pool": round(left - killed, 3),
        "s_to_repaired": round(repaired - killed, 3) if repaired else None,
        "s_to_rejoin_pool": round(rejoined - killed, 3),
        "s_to_first_answer_after_rejoin": round(served - killed, 3),
        "answered_by_it_while_out": len(after_left),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    changes = pd.DataFrame(
        [{"t_s": round(t - killed, 3), "replica": n, "status": s} for t, n, s in watch.changes],
        columns=["t_s", "replica", "status"],
    )
    origin = killed - (cluster.started_at or 0.0)
    events = events.assign(t_s=(events["t_s"] - origin).round(3))
    log.info("failover %s: %s", fault, figures)
    return FailoverResult(figures, traffic.frame(killed), changes, events)


def figure(result: FailoverResult, bin_s: float = 0.25):
    """Requests answered per ``bin_s`` by each replica, failed ones in red, and the moments of
    the kill, of leaving the pool and of rejoining it (a plotly figure)."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotly is only needed to draw)

    frame = result.requests.assign(bin=lambda f: (f["done_s"] // bin_s) * bin_s)
    fig = go.Figure()
    for replica, group in frame[frame["ok"]].groupby("replica"):
        counts = group.groupby("bin").size()
        fig.add_bar(x=counts.index, y=counts.values, name=f"answered by {replica}", width=bin_s)
    failed = frame[~frame["ok"]].groupby("bin").size()
    if len(failed):
        fig.add_bar(
            x=failed.index, y=failed.values, name="failed", marker_color="crimson", width=bin_s
        )
    f = result.figures
    for at, label, dash in [
        (0.0, "kill", "solid"),
        (f["s_to_leave_pool"], "out of the pool", "dash"),
        (f["s_to_rejoin_pool"], "back in the pool", "dot"),
    ]:
        fig.add_vline(x=at, line_dash=dash, annotation_text=label, annotation_position="top")
    fig.update_layout(
        barmode="stack",
        title=f"{f['fault']}: {f['failed']} of {f['requests']} requests failed",
        xaxis_title="seconds since the kill",
        yaxis_title=f"requests per {bin_s:g} s",
        legend_title="",
    )
    return fig
