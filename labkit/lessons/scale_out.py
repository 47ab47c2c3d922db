"""Notebook 07's lesson: what replicas on one host buy, next to instances in one server.

The mechanism first (:func:`predict_scale_out`): on a CPU a replica brings no new hardware, so
two replicas on one host can gain only what two instances in one server gain, the cores that one
instance leaves idle (:func:`labkit.lessons.predict_instances`, the explanation notebook 04 gives
too). Then three sweeps of the same model on the same cores
(:func:`labkit.cluster.compare_scale_out`): one server with one instance, one server with N
instances, N replicas behind HAProxy. The words compare them at the highest concurrency all three
measured, by the lab's one rule (:data:`~labkit.lessons.conclusion.NOISE_RULE`) on the rounds'
ratios. The takeaway says what replicas add on one host:
failover, measured by :func:`labkit.cluster.failover` (:func:`with_failover`).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, replace

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio, judge, unsettled
from labkit.lessons.instances import InstancePrediction, predict_instances
from labkit.repository.textgen import thread_budget, usable_cores
from labkit.server import served_config


@dataclass(frozen=True)
class ScaleOutPrediction:
    """What ``count`` instances, and ``count`` replicas, should do against one instance."""

    count: int
    instances: InstancePrediction
    text: str

    def __str__(self) -> str:
        return self.text


def predict_scale_out(
    count: int, *, threads: int, cores: int, batch: float = 1.0
) -> ScaleOutPrediction:
    """The prediction for ``count`` instances of ``threads`` torch threads each (``batch``
    requests per execution with one instance) on ``cores`` cores, and for ``count`` replicas."""
    instances = predict_instances(instances=count, threads=threads, cores=cores, batch=batch)
    text = (
        f"{instances.text} Replicas on one host share the same cores, and each replica's "
        "instance gets the torch threads an instance of one server gets: expect "
        f"{count} replicas to gain what {count} instances gain, and no more. What a replica adds "
        "is a server of its own, which can die alone: failover."
    )
    return ScaleOutPrediction(count, instances, text)


def scale_out_prediction(cluster, model: str, *, concurrency: int = 1) -> ScaleOutPrediction:
    """:func:`predict_scale_out` for ``model`` as ``cluster`` serves it: a lone instance's torch
    threads (its ``num_threads`` parameter, else labkit's thread budget), this host's cores, and
    the requests per execution ``concurrency`` clients give it (1 for a model that does not
    batch; up to ``max_batch_size`` for one that does)."""
    config = served_config(cluster.replica(0).server, model)
    explicit = config.get("parameters", {}).get("num_threads", {}).get("string_value", "")
    threads = int(explicit) if explicit else thread_budget(1)
    batch = max(1, min(int(config.get("max_batch_size", 0) or 1), concurrency))
    return predict_scale_out(cluster.size, threads=threads, cores=usable_cores(), batch=batch)


def _at(frame: pd.DataFrame, concurrency: int, column: str) -> float:
    rows = frame[frame["concurrency"] == concurrency]
    return float(rows.iloc[0][column]) if len(rows) else math.nan


def verdict(ratios: list[float] | Ratio) -> str:
    """``gain``, ``loss`` or ``tie`` of per-round ratios (or of one :class:`Ratio`), by the lab's
    one rule (:func:`~labkit.lessons.conclusion.judge`)."""
    return judge([ratios.value] if isinstance(ratios, Ratio) else ratios)


def per_round(rounds: pd.DataFrame | None, new: str, old: str, concurrency: int) -> list[float]:
    """``new``'s throughput over ``old``'s (``config`` names) at ``concurrency``, round by round
    (``rounds``: every round of every configuration; empty when not given)."""
    if rounds is None:
        return []
    level = rounds[rounds["concurrency"] == concurrency]
    speed = level.pivot_table(index="round", columns="config", values="throughput")
    if new not in speed or old not in speed:
        return []
    return [n / o for n, o in zip(speed[new], speed[old], strict=True) if o > 0]


def scale_out_conclusion(
    one: pd.DataFrame,
    instances: pd.DataFrame,
    replicas: pd.DataFrame,
    *,
    count: int = 2,
    threads: dict[str, int] | None = None,
    cores: int | None = None,
    load_average: float | None = None,
    rounds: pd.DataFrame | None = None,
    batch: float = 1.0,
) -> Conclusion:
    """One instance, ``count`` instances in one server, ``count`` replicas: what each gained,
    explained by :func:`predict_scale_out`.

    The frames are :func:`labkit.profiling.perf_analyzer` sweeps (their ``config`` column names
    them); ``threads`` maps those names to the torch threads of each instance (the lone
    instance's make the prediction; 1 when not given); ``cores`` is this host's (by default, the
    cores this process may use); ``load_average`` the host's while measuring; ``batch`` the
    requests one instance runs per execution (1: the model does not batch). ``rounds`` holds every
    round of every configuration, measured in turns (the sweeps are each one's median round):
    each comparison is judged, and shown, by the median of its per-round ratios; without them,
    by the one ratio. The lab starts every server in one session (:func:`labkit.proc.spawn`), so
    a busy host shares its cores between replicas as it would between one server's instances.
    """
    sweeps = {"one": one, "instances": instances, "replicas": replicas}
    levels = sorted(
        set(one["concurrency"]) & set(instances["concurrency"]) & set(replicas["concurrency"])
    )
    if not levels:
        raise ConfigError(
            "the three sweeps share no concurrency level; measure them at the same ones"
        )
    cores = cores or len(os.sched_getaffinity(0))
    names = {key: str(frame["config"].iloc[0]) for key, frame in sweeps.items()}
    rows = [
        {"concurrency": c}
        | {f"{names[k]} (infer/s)": _at(f, c, "throughput") for k, f in sweeps.items()}
        | {f"{names[k]} p99 (ms)": _at(f, c, "p99_ms") for k, f in sweeps.items()}
        for c in levels
    ]
    table = pd.DataFrame(rows).round(1)
    c = levels[-1]
    speed = {k: _at(f, c, "throughput") for k, f in sweeps.items()}
    p99 = {k: _at(f, c, "p99_ms") for k, f in sweeps.items()}
    gain = Ratio.between(speed["instances"], speed["one"], "infer/s")
    versus = Ratio.between(speed["replicas"], speed["instances"], "infer/s")
    versus_p99 = Ratio.between(p99["replicas"], p99["instances"], "p99 latency")
    lone = (threads or {}).get(names["one"], 1)
    predicted = predict_scale_out(count, threads=lone, cores=cores, batch=batch)
    count_rounds = int(rounds["round"].nunique()) if rounds is not None else 1
    # each comparison as the rule reads it: the median of its per-round ratios, when the rounds
    # are given (a ratio of the medians would be a figure the verdict was not judged on)
    ratios = {
        "instances": per_round(rounds, names["instances"], names["one"], c) or [gain.value],
        "replicas": per_round(rounds, names["replicas"], names["instances"], c) or [versus.value],
    }
    gain = Ratio(statistics.median(ratios["instances"]), "infer/s")
    versus = Ratio(statistics.median(ratios["replicas"]), "infer/s")
    judged = {key: verdict(values) for key, values in ratios.items()}
    figures = {
        f"one_instance_infer_s_c{c}": round(speed["one"], 2),
        f"{count}_instances_infer_s_c{c}": round(speed["instances"], 2),
        f"{count}_replicas_infer_s_c{c}": round(speed["replicas"], 2),
        f"{count}_replicas_against_{count}_instances": versus,
    }
    measured = (
        f"each the median of {count_rounds} rounds taken in turns, judged round by round"
        if count_rounds > 1
        else "one measurement each"
    )
    lines = [
        f"At concurrency {c} on {cores} cores: one instance served {speed['one']:.1f} "
        f"infer/s, {count} instances in one server {speed['instances']:.1f} and {count} replicas "
        f"behind HAProxy {speed['replicas']:.1f} ({measured}).",
        _instances_line(gain, count, predicted.instances, judged["instances"], cores, load_average),
        _replicas_line(versus, versus_p99, count, judged["replicas"]),
    ]
    if load_average is not None:
        lines.insert(
            1, f"The host's load average was {load_average:.1f} on {cores} cores after the rounds."
        )
    caveat = unsettled({names[k]: frame for k, frame in sweeps.items()})
    if caveat:
        lines.append(caveat)
    takeaway = (
        _speed_sentence(speed, versus, count, cores, judged["replicas"]),
        _mechanism_sentence(predicted.instances, cores, load_average),
        "What replicas add on one host is failover; more speed takes more cores, a second "
        "machine or one GPU per replica.",
    )
    return Conclusion(table, figures, "\n".join(lines), takeaway)


def with_failover(conclusion: Conclusion, *failovers) -> Conclusion:
    """The scale-out conclusion with its last takeaway sentence stating what the failover
    experiments measured: how many requests failed with each fault (``failovers`` are
    :class:`~labkit.cluster.FailoverResult`, anything with their ``figures``)."""
    if not failovers:
        raise ConfigError("with_failover() needs at least one failover experiment's result")
    failed = sum(f.figures["failed"] for f in failovers)
    sent = sum(f.figures["requests"] for f in failovers)
    parts = [
        "tritonserver" if f.figures["fault_kind"] == "server" else "Python stub" for f in failovers
    ]
    killed = parts[0] + "".join(f", then its {part}," for part in parts[1:])
    last = (
        f"What replicas add on one host is failover: with a replica's {killed} killed under "
        f"load, {failed} of {sent} requests failed; more speed takes more cores, a second "
        "machine or one GPU per replica."
    )
    return replace(conclusion, takeaway=(*conclusion.takeaway[:-1], last))


def _instances_line(
    gain: Ratio,
    count: int,
    predicted: InstancePrediction,
    measured: str,
    cores: int,
    load_average: float | None,
) -> str:
    said = f"{count} instances gave {gain} over one"
    busy = load_average is not None and load_average >= cores
    idle = "core" if predicted.busy_many - predicted.busy_one == 1 else "cores"
    if predicted.expect == "gain":
        if measured == "gain":
            return (
                f"{said}, as predicted: the extra instances' threads put to work the {idle} one "
                "instance left idle."
            )
        where = "within the noise" if measured == "tie" else "less, beyond the noise"
        why = (
            f"with a load average of {load_average:.1f} on {cores} cores, other processes "
            f"were already running on the {idle} one instance leaves idle"
            + ("." if measured == "tie" else ", and a second instance only split what one had.")
            if busy
            else f"the idle {idle} did not turn into requests here; measuring again tells "
            "whether that was the noise."
        )
        return (
            f"{said}, {where}, where up to about x{predicted.busy_many / predicted.busy_one:.0f} was "
            f"predicted: {why}"
        )
    if measured == "gain" and predicted.expect == "smaller gain":
        return (
            f"{said}, beyond the noise: the second core was free, so splitting the batches "
            "still paid."
        )
    if measured == "gain":
        return (
            f"{said}, beyond the noise, where no gain was predicted: measuring again tells "
            "whether the host's load changed between the rounds."
        )
    where = "within the noise" if measured == "tie" else "less, beyond the noise"
    reason = (
        "one instance already ran several requests per execution"
        if predicted.batch >= 1.5
        else "one instance already kept every core busy"
    )
    if predicted.expect == "loss" and measured == "tie":
        return f"{said}, {where}, where a loss was predicted: {reason}, yet here they kept pace."
    return f"{said}, {where}, as predicted: {reason}."


def _replicas_line(versus: Ratio, versus_p99: Ratio, count: int, measured: str) -> str:
    said = f"{count} replicas gave {versus} against {count} instances in one server"
    # the verdict is the throughput's; the tail latency is a figure beside it, not judged
    latency = (
        f" Their p99 latency was x{versus_p99.value:.2f} the instances' (the balancer adds a hop "
        "to every request); the verdict is the throughput's alone, as one sweep's p99 rests on "
        "its few slowest requests."
    )
    gain = (
        f"{said}: more, beyond the noise, on the same cores. Not from more cores, which "
        "one host does not have: from what surrounds the model (each replica has its own Triton "
        "front end and scheduler), or from the host's load changing between rounds."
    )
    return {
        "gain": gain,
        "tie": f"{said}: no difference beyond the noise, as predicted: on the same cores a "
        "replica is an instance with a server of its own around it.",
        "loss": f"{said}: less, beyond the noise: the same cores did the same work, plus a "
        "second server's threads and the balancer's hop.",
    }[measured] + latency


def _speed_sentence(
    speed: dict[str, float], versus: Ratio, count: int, cores: int, measured: str
) -> str:
    figures = (
        f"On {cores} cores, {count} replicas behind HAProxy served {speed['replicas']:.1f} "
        f"infer/s and {count} instances in one server {speed['instances']:.1f}, against "
        f"{speed['one']:.1f} for one instance"
    )
    return (
        figures
        + {
            "gain": f": replicas gained more than instances here ({versus}), from what "
            "surrounds the model, not from more cores.",
            "tie": f": {versus} between replicas and instances, no difference beyond the "
            "noise of these rounds.",
            "loss": f": replicas gained less than instances ({versus}), paying for a second server "
            "and the balancer's hop.",
        }[measured]
    )


def _mechanism_sentence(
    predicted: InstancePrediction, cores: int, load_average: float | None
) -> str:
    load = (
        f" (load average {load_average:.1f} on {cores} cores here)"
        if load_average is not None
        else ""
    )
    idle = predicted.busy_many - predicted.busy_one
    cores_word = "core" if idle == 1 else "cores"
    if predicted.expect == "gain":
        them = "it" if idle == 1 else "them"
        # the load average is named here only where it was high enough to cut the gain (the
        # text gives it in any case)
        busy = load_average is not None and load_average >= cores
        return (
            f"Both can only put to work the {cores_word} one instance of {predicted.threads} "
            f"torch thread{'s' if predicted.threads > 1 else ''} leaves idle, so up to about "
            f"{predicted.busy_many / predicted.busy_one:.0f}x, and less "
            + (
                f"here, where other processes used {them}{load}."
                if busy
                else f"when other processes use {them}."
            )
        )
    reason = (
        f"one instance already runs {predicted.batch:.1f} requests per execution"
        if predicted.busy_many > predicted.busy_one
        else "one instance already keeps every core busy"
    )
    return f"Neither can gain much here: {reason}{load}."
