"""Scale-out on one host, measured: one server, more instances in it, or replicas behind HAProxy.

:func:`compare_scale_out` measures, with the same perf_analyzer settings and on the same cores:

1. the cluster's replicas behind the balancer, each instance with its share of the cores;
2. one replica alone with one instance of the model, with the torch threads a lone server's
   instance takes (every core);
3. the same replica with as many instances as the cluster has replicas
   (``instance_group { count: N }``), each with its share of the cores.

(2) and (3) reload the model on that replica with a new ``config.pbtxt`` (the replicas share one
repository folder); the configuration the cluster served is written back and reloaded at the end,
so a replica started later (a replacement) serves what the others serve.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import pandas as pd

from labkit import profiling
from labkit.cluster.pool import Cluster
from labkit.repository import Repository, apply_edits
from labkit.repository.textgen import instance_count, thread_budget, usable_cores
from labkit.server import reload, served_config

log = logging.getLogger(__name__)


@dataclass
class ScaleOut:
    """Three sweeps of the same model on the same cores; per configuration (the sweeps'
    ``config`` labels), the torch threads of each instance and the instances on the host."""

    one_instance: pd.DataFrame
    instances: pd.DataFrame
    replicas: pd.DataFrame
    threads: dict[str, int]
    instance_counts: dict[str, int]
    cores: int  # the cores the servers may use
    load_average: float  # the host's 1-minute load average after the sweeps

    def threads_in_use(self) -> int:
        """The most torch threads one configuration ran on the host, all instances together."""
        return max(self.threads[k] * self.instance_counts[k] for k in self.threads)

    def sweeps(self) -> list[pd.DataFrame]:
        """One instance, N instances, N replicas: the order the lesson takes them in."""
        return [self.one_instance, self.instances, self.replicas]

    def table(self) -> pd.DataFrame:
        """Throughput and p99 latency per configuration and concurrency, for a notebook."""
        frame = pd.concat(self.sweeps())
        return frame.pivot(
            index="concurrency", columns="config", values=["throughput", "p99_ms"]
        ).round(1)


def compare_scale_out(
    cluster: Cluster, model: str, *, replica: int | str = 0, **perf_options: object
) -> ScaleOut:
    """Measure ``model`` three ways on this host's cores (see the module's docstring);
    ``perf_options`` go to every :func:`labkit.profiling.perf_analyzer` sweep (``concurrency``,
    ``measurement_request_count``...). A ``num_threads`` in the model's config is kept in all
    three: a user's explicit thread count wins."""
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
    replicas = profiling.perf_analyzer(cluster, model, label=labels["replicas"], **perf_options)
    try:
        alone = apply_edits(
            served, instance_count=1, parameters={"num_threads": str(threads[labels["one"]])}
        )
        reload(server, model, alone, repository=repository)
        one = profiling.perf_analyzer(server, model, label=labels["one"], **perf_options)
        several = apply_edits(
            served, instance_count=n, parameters={"num_threads": str(threads[labels["instances"]])}
        )
        reload(server, model, several, repository=repository)
        instances = profiling.perf_analyzer(
            server, model, label=labels["instances"], **perf_options
        )
    finally:
        reload(server, model, served, repository=repository)  # what the cluster serves
        cluster.wait_ready(60)
    log.info("scale-out of %s measured; threads per instance %s", model, threads)
    load = os.getloadavg()[0]
    return ScaleOut(one, instances, replicas, threads, counts, usable_cores(), load)
