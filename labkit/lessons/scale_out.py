"""Notebook 07's figures: the prediction as numbers, the three sweeps of
:func:`labkit.cluster.compare_scale_out` judged round by round, and a takeaway from those verdicts
and the failover experiments. Why a replica on a CPU gains only what an instance gains, and what
each verdict means, is the notebook's markdown."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Verdict, unsettled
from labkit.lessons.instances import InstancePrediction, predict_instances
from labkit.repository.textgen import thread_budget, usable_cores
from labkit.server import served_config


@dataclass(frozen=True)
class ScaleOutPrediction:
    """What ``count`` instances, and ``count`` replicas, can gain against one instance."""

    count: int
    instances: InstancePrediction

    def table(self) -> pd.DataFrame:
        """The prediction's numbers, one a row; the most ``count`` instances (or replicas) can
        gain is the cores they can keep busy over the cores one instance can."""
        p, n = self.instances, self.count
        return pd.DataFrame(
            {"predicted": [p.cores, p.threads, p.threads_each or p.threads, p.busy_one_said,
                  p.busy_many, p.batch, _gain_said(p)]},
            index=["cores", "torch threads of one instance alone",
                   f"torch threads of each of {n} instances (or replicas)",
                   "cores 1 instance keeps busy (as its work splits over its threads)",
                   f"cores {n} instances (or replicas) can keep busy",
                   "requests per execution (1: no batching)",
                   f"gain the idle cores allow, {n} against 1 (infer/s)"],
        )  # fmt: skip


def _gain_said(p: InstancePrediction) -> str:
    """The most the idle cores allow, a range where one instance's work may not split over its
    threads (then the copies gain only where it does not)."""
    most, least = p.busy_many / (p.busy_one_least or p.busy_one), p.busy_many / p.busy_one
    return f"x{most:.2f}" if most == least else f"x{least:.2f} to x{most:.2f}"


def predict_scale_out(
    count: int, *, threads: int, cores: int, batch: float = 1.0, threads_each: int | None = None
) -> ScaleOutPrediction:
    """:func:`predict_instances` for ``count`` instances, or replicas, against one."""
    said = predict_instances(
        instances=count, threads=threads, cores=cores, batch=batch, threads_each=threads_each
    )
    return ScaleOutPrediction(count, said)


def scale_out_prediction(cluster, model: str, *, concurrency: int = 1) -> ScaleOutPrediction:
    """:func:`predict_scale_out` for ``model`` as ``cluster`` serves it: the torch threads of a
    lone instance and of each of ``cluster.size`` (its ``num_threads`` parameter, else labkit's
    thread budget for each, as :func:`labkit.cluster.compare_scale_out` loads them), this host's
    cores, and the requests per execution ``concurrency`` clients give it (1 for a model that
    does not batch)."""
    config = served_config(cluster.replica(0).server, model)
    explicit = config.get("parameters", {}).get("num_threads", {}).get("string_value", "")
    lone, each = (
        (int(explicit),) * 2 if explicit else (thread_budget(1), thread_budget(cluster.size))
    )
    batch = max(1, min(int(config.get("max_batch_size", 0) or 1), concurrency))
    return predict_scale_out(
        cluster.size, threads=lone, cores=usable_cores(), batch=batch, threads_each=each
    )


def _ratios(every: pd.DataFrame, new: str, old: str, level: int) -> list[float]:
    """``new``'s infer/s over ``old``'s (``config`` names) at ``level``, round by round."""
    speed = every[every["concurrency"] == level].pivot_table(
        index="round", columns="config", values="throughput"
    )
    return [n / o if o > 0 else math.nan for n, o in zip(speed[new], speed[old], strict=True)]


def scale_out_conclusion(
    one: pd.DataFrame,
    instances: pd.DataFrame,
    replicas: pd.DataFrame,
    *,
    count: int = 2,
    rounds: pd.DataFrame | None = None,
) -> Conclusion:
    """Replicas against one instance, replicas against instances and instances against one, at
    the highest concurrency all three sweeps measured (:func:`labkit.profiling.perf_analyzer`
    frames, named by their ``config``), each judged on its per-round ratios when ``rounds`` (every
    round of every configuration) is given."""
    sweeps = {str(f["config"].iloc[0]): f for f in (one, instances, replicas)}
    levels = sorted(set.intersection(*(set(f["concurrency"]) for f in sweeps.values())))
    if not levels:
        raise ConfigError(
            "the three sweeps share no concurrency level; measure them at the same ones"
        )
    c, (lone, many, spread) = levels[-1], list(sweeps)
    pairs = [(spread, lone, f"{count} replicas against 1 instance"),
             (spread, many, f"{count} replicas against {count} instances in one server"),
             (many, lone, f"{count} instances in one server against 1 instance")]  # fmt: skip
    every = pd.concat(sweeps.values()).assign(round=1) if rounds is None else rounds
    verdicts = tuple(
        Verdict(f"{said} at concurrency {c}", _ratios(every, new, old, c), "infer/s")
        for new, old, said in pairs
    )
    speed = {
        k: round(float(f.set_index("concurrency").at[c, "throughput"]), 2)
        for k, f in sweeps.items()
    }
    figures = {
        f"one_instance_infer_s_c{c}": speed[lone],
        f"{count}_instances_infer_s_c{c}": speed[many],
        f"{count}_replicas_infer_s_c{c}": speed[spread],
        f"{count}_replicas_against_{count}_instances": verdicts[1].ratio,
    }
    table = pd.concat(sweeps.values())[["config", "concurrency", "throughput", "p99_ms"]]
    table.columns = ["configuration", "concurrency", "infer/s", "p99 latency (ms)"]
    text = "\n".join([v.sentence() for v in verdicts] + [unsettled(sweeps)]).strip()
    return Conclusion(table, figures, text, tuple(v.sentence() for v in verdicts[:2]), verdicts)


def with_failover(conclusion: Conclusion, *failovers) -> Conclusion:
    """The scale-out takeaway with a last line of what the failover experiments measured: how many
    requests failed with each fault (``failovers``: :class:`~labkit.cluster.FailoverResult`)."""
    if not failovers:
        raise ConfigError("with_failover() needs at least one failover experiment's result")
    failed = sum(f.figures["failed"] for f in failovers)
    sent = sum(f.figures["requests"] for f in failovers)
    parts = [
        "tritonserver" if f.figures["fault_kind"] == "server" else "Python stub" for f in failovers
    ]
    killed = parts[0] + "".join(f", then its {part}," for part in parts[1:])
    last = f"With a replica's {killed} killed under load, {failed} of {sent} requests failed."
    return replace(conclusion, takeaway=(*conclusion.takeaway[:2], last))
