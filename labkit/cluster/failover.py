"""Failover, measured: a steady load through the balancer while one replica is killed.

A paced :class:`labkit.load.Load` sends inference requests (``/infer``) at a fixed rate through
the cluster's HTTP address and keeps every outcome: when it was sent and answered, the HTTP
status, the replica that answered (HAProxy's ``X-Labkit-Replica`` header) and the error.
:func:`failover` runs one experiment:

1. traffic for ``warmup_s``;
2. the fault: SIGKILL of a replica's ``tritonserver`` (``fault="server"``), or of one of its
   Python stubs (``fault="stub"``);
3. the moment HAProxy takes the replica out of the pool (polled on its admin socket);
4. the repair: for a dead server the cluster's supervisor starts a replacement on the same ports;
   for a dead stub :func:`labkit.server.recover` restarts the model on the same server. Before
   it, with the stub dead (and once before the kill), what each probe says of the replica
   (:func:`what_probes_see`): Triton's own endpoints, a request sent to it directly, and
   ``ready_check.py`` run as a pod's readiness probe runs it;
5. the moment the replica is back in the pool, and the first request it answers after that;
   HAProxy's own count of the requests it sent the replica while it was out (target 0);
6. ``settle_s`` more of traffic.

Every figure is measured from the kill. The load stays on loopback and is bounded in count and
time. A benchmark, not a test: the machine's load average is part of the figures.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pandas as pd

from labkit import client, proc
from labkit.cluster import ready_check
from labkit.cluster.balancer import REPLICA_HEADER
from labkit.cluster.pool import FAULTS, Cluster, PoolWatch
from labkit.errors import ConfigError, InferenceError, ServerTimeoutError, ToolError
from labkit.load import Load, Outcome

log = logging.getLogger(__name__)

#: The most requests one experiment sends (its duration bounds it too).
MAX_REQUESTS = 5000


def requests_frame(outcomes: list[Outcome], origin: float = 0.0) -> pd.DataFrame:
    """One row per request, times in seconds since ``origin``."""
    rows = [
        {
            "sent_s": round(o.sent - origin, 4),
            "done_s": round(o.ended - origin, 4),
            "latency_ms": round(o.latency_s * 1000, 2),
            "status": o.status,
            "replica": o.replica or "-",
            "ok": o.ok,
            "error": o.error,
        }
        for o in outcomes
    ]
    columns = ["sent_s", "done_s", "latency_ms", "status", "replica", "ok", "error"]
    return pd.DataFrame(rows, columns=columns)


@dataclass
class FailoverResult:
    """The figures of one experiment (``figures``), every request (``requests``, seconds since
    the kill), the pool's changes and the cluster's events (both seconds since the kill); for a
    dead stub, what each probe said of the replica before the kill and with its stub dead
    (``probes``, see :func:`what_probes_see`)."""

    figures: dict
    requests: pd.DataFrame = field(repr=False)
    pool_changes: pd.DataFrame = field(repr=False)
    events: pd.DataFrame = field(repr=False)
    probes: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """What was killed, in a few words: ``tritonserver killed`` or ``stub killed``."""
        return "tritonserver killed" if self.figures["fault_kind"] == "server" else "stub killed"

    def story(self, replica: str) -> list[str]:
        """What the cluster recorded of ``replica`` from its kill on, in the order recorded:
        ``killed ...``, ``out of the pool``, ``replacement ready`` or ``recovered``, ``in the
        pool``... (see :meth:`Cluster.events <labkit.cluster.Cluster.events>`)."""
        mine = list(self.events[self.events["who"] == replica]["event"])
        kills = [i for i, e in enumerate(mine) if e.startswith("killed ")]
        return mine[kills[-1] :] if kills else []

    def table(self) -> pd.DataFrame:
        """The figures in words, one column named after the fault (see :func:`failover_table`)."""
        f = self.figures
        rows = [
            ("what was killed", f["fault"]),
            (f"requests sent, {f['rate_per_s']:g} a second", f["requests"]),
            ("requests failed", f["failed"]),
            ("requests sent after the kill", f["sent_after_kill"]),
            ("requests sent after the kill that failed", f["failed_after_kill"]),
            ("requests sent between the kill and its leaving the pool", f["sent_until_out_of_pool"]),
            ("requests HAProxy sent it while it was out (its own count)", f["sent_to_it_while_out"]),
            ("requests the other replica answered while it was out", f["answered_by_others_while_out"]),
            ("requests it answered after it rejoined", f["answered_by_it_after_rejoin"]),
            ("seconds from the kill until it left the pool", f["s_to_leave_pool"]),
            ("how it was repaired", _REPAIR[f["fault_kind"]]),
            ("seconds from the kill until it was repaired", f["s_to_repaired"]),
            ("seconds from the kill until it rejoined the pool", f["s_to_rejoin_pool"]),
            ("seconds from the kill until its first answer after", f["s_to_first_answer_after_rejoin"]),
            ("host load average over 1 minute, before and after",
             f"{f['load_average_before'][0]:.1f} and {f['load_average_after'][0]:.1f} on {f['cpu_count']} cores"),
        ]  # fmt: skip
        rows += [(f"failed: {cause}", n) for cause, n in f["failures_by_cause"].items()]
        frame = pd.DataFrame(rows, columns=["", self.name]).set_index("")
        frame.index.name = None
        return frame

    def pool_table(self) -> pd.DataFrame:
        """HAProxy's view of each replica as it changed, seconds since the kill, in words."""
        said = self.pool_changes["status"].map(
            lambda s: "in the pool" if s == "UP" else f"out of the pool ({s})"
        )
        return pd.DataFrame(
            {
                "fault": self.name,
                "seconds since the kill": self.pool_changes["t_s"],
                "replica": self.pool_changes["replica"],
                "HAProxy's view": said,
            }
        )


#: What the repair of each fault is, as a learner reads it.
_REPAIR = {"server": "a new server, same ports", "stub": "its model reloaded, same server"}


def failover_table(*results: FailoverResult) -> pd.DataFrame:
    """The experiments side by side, one column each, in words."""
    return pd.concat([r.table() for r in results], axis=1)


def what_probes_see(
    cluster: Cluster,
    replica: int | str,
    model: str,
    prompt: str = "Hi",
    parameters: dict | None = None,
) -> dict[str, str]:
    """What each probe says of one replica now, in words: Triton's ``/v2/health/ready`` and
    ``/v2/models/<model>/ready``, an inference request sent to it directly (not through the
    balancer), ``ready_check.py`` run as a pod's readiness probe runs it (a command; its exit
    status and what it printed), and HAProxy's view of it."""
    server = cluster.replica(replica).server
    url = f"http://{server.http_url}"

    def status(path: str) -> str:
        try:
            with urllib.request.urlopen(url + path, timeout=5) as response:
                return str(response.status)
        except urllib.error.HTTPError as exc:
            return str(exc.code)
        except OSError as exc:
            return f"no answer ({exc})"

    try:
        batched = client.model_batches(server.http_url, model)
        client.infer_json(
            server.http_url, model, prompt, batched=batched, timeout_s=30, **(parameters or {})
        )
        request = "answered"
    except InferenceError as exc:  # "... refused the request (500): Stub process ..."
        request = re.sub(r"^.*\((\d+)\): ", r"\1 ", str(exc))
    command = [sys.executable, ready_check.__file__, f"--url={url}", f"--server-pid={server.pid}"]
    try:
        ran = proc.run(command, timeout_s=30, check=False)
        check = f"exit {ran.returncode}: {ran.stdout.strip()}"
    except ToolError as exc:
        check = f"did not finish: {exc}"
    name = cluster.replica(replica).name
    return {
        "Triton's /v2/health/ready": status("/v2/health/ready"),
        f"Triton's /v2/models/{model}/ready": status(f"/v2/models/{model}/ready"),
        "an inference request sent to it directly": request,
        "ready_check.py, as a pod's readiness probe runs it": check,
        "HAProxy's view of it": "in the pool" if name in cluster.in_pool() else "out of the pool",
    }


def _wait(condition, timeout_s: float, what: str) -> float:
    """The first value of ``condition`` that is not None (a moment), polled every 20 ms."""
    value = None

    def happened() -> bool:
        nonlocal value
        value = condition()
        return value is not None

    if not proc.wait_until(happened, timeout_s, 0.02):
        raise ServerTimeoutError(f"{what} did not happen within {timeout_s:g} s")
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
    if rate_per_s <= 0 or workers < 1:
        raise ConfigError(f"rate_per_s={rate_per_s} must be > 0 and workers={workers} >= 1")
    name = cluster.replica(replica).name
    cluster.wait_ready(timeout_s)
    load_before = os.getloadavg()
    traffic = Load(
        cluster.http_url,
        model,
        endpoint="infer",
        prompt=prompt,
        parameters=parameters,
        concurrency=workers,
        rate_per_s=rate_per_s,
        max_requests=MAX_REQUESTS,
        max_duration_s=timeout_s * 2 + warmup_s + settle_s,
        timeout_s=60.0,
        replica_header=REPLICA_HEADER,
    )
    with PoolWatch(cluster) as watch, traffic:
        _wait(
            lambda: traffic.answered(replica=name) or None,
            timeout_s,
            f"a request answered by {name}",
        )
        time.sleep(warmup_s)
        before = (
            what_probes_see(cluster, name, model, prompt, parameters) if fault == "stub" else None
        )
        killed = cluster.kill(name, fault, model if fault == "stub" else None)
        left = _wait(
            lambda: watch.first(name, False, killed), timeout_s, f"{name} leaving the pool"
        )
        if fault == "stub":
            dead = what_probes_see(cluster, name, model, prompt, parameters)
            cluster.recover(name)
        rejoined = _wait(lambda: watch.first(name, True, left), timeout_s, f"{name} rejoining")
        served = _wait(
            lambda: min((o.ended for o in traffic.answered(rejoined, replica=name)), default=None),
            timeout_s,
            f"a request answered by {name} after it rejoined",
        )
        time.sleep(settle_s)
    events = cluster.events()
    repaired = cluster.when(
        name, "replacement ready" if fault == "server" else "recovered", after=killed
    )
    outcomes = traffic.outcomes
    summary = traffic.summary()
    figures = {
        "fault": f"SIGKILL of {name}'s {'tritonserver' if fault == 'server' else 'Python stub'}",
        "fault_kind": fault,
        "replica": name,
        "replicas": cluster.size,
        "rate_per_s": rate_per_s,
        "requests": summary["requests"],
        "answered": summary["answered"],
        "failed": summary["failed"],
        "failures_by_cause": summary["failures_by_cause"],
        "sent_after_kill": sum(1 for o in outcomes if o.sent >= killed),
        "failed_after_kill": len(traffic.failures(killed)),
        "sent_until_out_of_pool": sum(1 for o in outcomes if killed <= o.sent < left),
        "answered_by_others_while_out": sum(
            1 for o in outcomes if o.ok and o.replica != name and left <= o.sent < rejoined
        ),
        "s_to_leave_pool": round(left - killed, 3),
        "s_to_repaired": round(repaired - killed, 3) if repaired else None,
        "s_to_rejoin_pool": round(rejoined - killed, 3),
        "s_to_first_answer_after_rejoin": round(served - killed, 3),
        "sent_to_it_while_out": watch.sent_while_out(name),  # HAProxy's own count
        "answered_by_it_after_rejoin": len(traffic.answered(rejoined, replica=name)),
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
    probes = None
    if before is not None:
        probes = pd.DataFrame({"before the kill": before, "with its stub dead": dead})
    log.info("failover %s: %s", fault, figures)
    return FailoverResult(figures, requests_frame(outcomes, killed), changes, events, probes)


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
    # The kill and the exit from the pool are often a fraction of a second apart: their labels
    # go on either side of their lines, so that they never print over each other.
    for at, label, dash, side in [
        (0.0, "kill", "solid", "top left"),
        (f["s_to_leave_pool"], "out of the pool", "dash", "top right"),
        (f["s_to_rejoin_pool"], "back in the pool", "dot", "top right"),
    ]:
        fig.add_vline(x=at, line_dash=dash, annotation_text=label, annotation_position=side)
    fig.update_layout(
        barmode="stack",
        title=f"{f['fault']}: {f['failed']} of {f['requests']} requests failed",
        xaxis_title="seconds since the kill",
        yaxis_title=f"requests per {bin_s:g} s",
        yaxis={"dtick": 1, "rangemode": "tozero"},  # whole requests: ticks at 0, 1, 2...
        legend_title="",
    )
    return fig
