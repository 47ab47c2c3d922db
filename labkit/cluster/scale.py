"""Scale-out on one host, measured: one server, more instances in it, or replicas behind HAProxy.

:func:`compare_scale_out` measures, with the same perf_analyzer settings and on the same cores:

1. the cluster's replicas behind the balancer, each instance with its share of the cores;
2. one replica alone with one instance of the model, with the torch threads a lone server's
   instance takes;
3. the same replica with as many instances as the cluster has replicas
   (``instance_group { count: N }``), each with its share of the cores.

(2) and (3) are twins of the model (``<model>_one``, ``<model>_x<N>``), loaded on that replica
only, beside the model the cluster serves, which is never changed. So the three can be measured
in turns, several rounds, with no reload between them: a busier moment of a shared host then
falls on all three, and each comparison is judged round by round. The twins
are unloaded and removed at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import pandas as pd

from labkit import profiling
from labkit.cluster.pool import Cluster
from labkit.errors import ConfigError, LabkitError
from labkit.repository import Repository, apply_edits
from labkit.repository.textgen import instance_count, thread_budget, usable_cores
from labkit.server import reload, served_config

log = logging.getLogger(__name__)


#: How many times each configuration is measured, in turns.
ROUNDS = 3


@dataclass
class ScaleOut:
    """Three sweeps of the same model on the same cores (each configuration's median round);
    per configuration (the sweeps' ``config`` labels), the torch threads of each instance and the
    instances on the host; and every round measured."""

    one_instance: pd.DataFrame
    instances: pd.DataFrame
    replicas: pd.DataFrame
    threads: dict[str, int]
    instance_counts: dict[str, int]
    cores: int  # the cores the servers may use
    load_average: float  # the host's 1-minute load average after the sweeps
    rounds: pd.DataFrame | None = None  # every round of every configuration (a ``round`` column)

    def threads_in_use(self) -> int:
        """The most torch threads one configuration ran on the host, all instances together."""
        return max(self.threads[k] * self.instance_counts[k] for k in self.threads)

    def sweeps(self) -> list[pd.DataFrame]:
        """One instance, N instances, N replicas: the order the lesson takes them in."""
        return [self.one_instance, self.instances, self.replicas]

    @property
    def round_count(self) -> int:
        return int(self.rounds["round"].nunique()) if self.rounds is not None else 1

    def table(self) -> pd.DataFrame:
        """Per configuration and concurrency, in words: its instances and torch threads, its
        median round's requests per second and p99 latency, and every round's requests per
        second, in the order measured."""
        rows = []
        for frame in self.sweeps():
            for level in frame.itertuples():
                config, c = level.config, int(level.concurrency)
                rounds = (
                    self.rounds[
                        (self.rounds["config"] == config) & (self.rounds["concurrency"] == c)
                    ]
                    if self.rounds is not None
                    else frame[frame["concurrency"] == c]
                )
                rows.append(
                    {
                        "configuration": config,
                        "concurrency": c,
                        "instances": self.instance_counts.get(config),
                        "torch threads each": self.threads.get(config),
                        "infer/s (median round)": round(float(level.throughput), 1),
                        "p99 latency (ms)": round(float(level.p99_ms)),
                        "infer/s in each round": ", ".join(
                            f"{t:.1f}" for t in rounds["throughput"]
                        ),
                    }
                )
        return pd.DataFrame(rows)


def compare_scale_out(
    cluster: Cluster,
    model: str,
    *,
    replica: int | str = 0,
    rounds: int = ROUNDS,
    **perf_options: object,
) -> ScaleOut:
    """Measure ``model`` three ways on this host's cores, ``rounds`` times in turns (see the
    module's docstring); ``perf_options`` go to every :func:`labkit.profiling.perf_analyzer`
    sweep (``concurrency``, ``measurement_request_count``...). A ``num_threads`` in the model's
    config is kept in all three: a user's explicit thread count wins."""
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    n = cluster.size
    server = cluster.replica(replica).server
    repository = Repository(cluster.model_repository)
    served = repository.config(model)
    per_replica = instance_count(served_config(server, model))
    explicit = (
        int(served.parameters["num_threads"].string_value or 0)
        if ("num_threads" in served.parameters)
        else 0
    )
    labels = {
        "one": "one server, 1 instance",
        "instances": f"one server, {n} instances",
        "replicas": f"{n} replicas behind HAProxy",
    }
    counts = {labels["one"]: 1, labels["instances"]: n, labels["replicas"]: per_replica * n}
    threads = {label: explicit or thread_budget(k) for label, k in counts.items()}
    twins = {"one": f"{model}_one", "instances": f"{model}_x{n}"}
    measured: dict[str, list[pd.DataFrame]] = {key: [] for key in labels}
    try:
        for key, count in (("one", 1), ("instances", n)):
            config = apply_edits(
                served,
                instance_count=count,
                parameters={"num_threads": str(threads[labels[key]])},
            )
            repository.add_twin(model, twins[key], config)
            reload(server, twins[key], repository=repository)
        targets = {"replicas": (cluster, model), "one": (server, twins["one"]),
                   "instances": (server, twins["instances"])}  # fmt: skip
        order = ["replicas", "one", "instances"]
        for r in range(rounds):
            for key in order[r % 3 :] + order[: r % 3]:  # each round starts with another one
                where, name = targets[key]
                frame = profiling.perf_analyzer(
                    where, name, label=f"{labels[key]} round {r + 1}", **perf_options
                )
                measured[key].append(frame.assign(config=labels[key], round=r + 1))
    finally:
        for name in twins.values():
            if name in repository.models():
                with contextlib.suppress(LabkitError):
                    server.unload_model(name)
                repository.remove(name)
        cluster.wait_ready(60)
    log.info("scale-out of %s measured; threads per instance %s", model, threads)
    load = os.getloadavg()[0]
    median = {key: _median_round(frames) for key, frames in measured.items()}
    every = pd.concat([f for frames in measured.values() for f in frames], ignore_index=True)
    return ScaleOut(
        median["one"], median["instances"], median["replicas"], threads, counts,
        usable_cores(), load, every,
    )  # fmt: skip


def _median_round(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Per concurrency, the round with the median throughput (the lower middle of an even count)."""
    every = pd.concat(frames, ignore_index=True)
    rows = []
    for _, level in every.groupby("concurrency", sort=True):
        ranked = level.sort_values("throughput", kind="stable")
        rows.append(ranked.iloc[(len(ranked) - 1) // 2])
    return pd.DataFrame(rows).reset_index(drop=True)
