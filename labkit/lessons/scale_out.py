"""Notebook 07's lesson: what replicas on one host buy, next to instances in one server.

Three sweeps of the same model on the same cores (:func:`labkit.cluster.compare_scale_out`): one
server with one instance, one server with N instances, N replicas behind HAProxy. The words
compare them at the highest concurrency all three measured; a ratio within :data:`GAIN` either
way (or within the spread of repeated rounds, where that is wider) is called a tie, within the
noise.
"""

from __future__ import annotations

import math
import os

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import GAIN, Conclusion, Ratio, unsettled

#: How a verdict reads after its ratio.
SAID = {
    "gain": "more, beyond the noise",
    "tie": "a tie, within the noise",
    "loss": "less, beyond the noise",
}


def _at(frame: pd.DataFrame, concurrency: int, column: str) -> float:
    rows = frame[frame["concurrency"] == concurrency]
    return float(rows.iloc[0][column]) if len(rows) else math.nan


def verdict(ratio: Ratio, spread: float = 0.0) -> str:
    """``gain``, ``loss`` or ``tie`` (not measured, or within :func:`tie_limit` either way)."""
    limit = tie_limit(spread)
    if ratio.value >= limit:
        return "gain"
    if ratio.value <= 1 / limit:
        return "loss"
    return "tie"


def tie_limit(spread: float = 0.0) -> float:
    """The ratio a difference must pass to count: :data:`GAIN`, or more where the repeated
    measurements of one configuration spread further (``spread``, a fraction of their median)."""
    return max(GAIN, 1 + spread)


def scale_out_conclusion(
    one: pd.DataFrame,
    instances: pd.DataFrame,
    replicas: pd.DataFrame,
    *,
    count: int = 2,
    threads: dict[str, int] | None = None,
    cores: int | None = None,
    load_average: float | None = None,
    rounds: int = 1,
    spread: float = 0.0,
) -> Conclusion:
    """One instance, ``count`` instances in one server, ``count`` replicas: what each gained.

    The frames are :func:`labkit.profiling.perf_analyzer` sweeps (their ``config`` column names
    them; a ``compute_infer_ms`` column, the server's compute per request, explains a gain);
    ``threads`` maps those names to the torch threads of each instance; ``cores`` is this host's
    (by default, the cores this process may use); ``load_average`` the host's while measuring.
    ``rounds`` is how many times each configuration was measured, taken in turns (the sweeps are
    each one's median round), and ``spread`` the widest spread of one configuration's rounds, as
    a fraction of its median: a difference within it is a tie.
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
        | {f"{names[k]} infer/s": _at(f, c, "throughput") for k, f in sweeps.items()}
        | {f"{names[k]} p99 ms": _at(f, c, "p99_ms") for k, f in sweeps.items()}
        for c in levels
    ]
    table = pd.DataFrame(rows).round(1)
    c = levels[-1]
    speed = {k: _at(f, c, "throughput") for k, f in sweeps.items()}
    p99 = {k: _at(f, c, "p99_ms") for k, f in sweeps.items()}
    instances_gain = Ratio.between(speed["instances"], speed["one"], "infer/s")
    replicas_gain = Ratio.between(speed["replicas"], speed["one"], "infer/s")
    versus = Ratio.between(speed["replicas"], speed["instances"], "infer/s")
    versus_p99 = Ratio.between(p99["replicas"], p99["instances"], "p99 latency")
    figures = {
        f"one_instance_infer_s_c{c}": round(speed["one"], 2),
        f"instances_infer_s_c{c}": round(speed["instances"], 2),
        f"replicas_infer_s_c{c}": round(speed["replicas"], 2),
        f"one_instance_p99_ms_c{c}": round(p99["one"], 1),
        f"instances_p99_ms_c{c}": round(p99["instances"], 1),
        f"replicas_p99_ms_c{c}": round(p99["replicas"], 1),
        "instances_vs_one": instances_gain,
        "replicas_vs_one": replicas_gain,
        "replicas_vs_instances": versus,
        "replicas_vs_instances_verdict": verdict(versus, spread),
    }
    lines = [
        f"At concurrency {c}, on the same {cores} cores: {names['one']} served "
        f"{speed['one']:.1f} infer/s (p99 {p99['one']:.0f} ms); {names['instances']} "
        f"{speed['instances']:.1f} (p99 {p99['instances']:.0f} ms); {names['replicas']} "
        f"{speed['replicas']:.1f} (p99 {p99['replicas']:.0f} ms)."
    ]
    if rounds > 1:
        lines.append(
            f"Each configuration was measured {rounds} times, the three taken in turns so that a "
            "busier moment of the host falls on all of them; these are each one's median round. "
            f"One configuration's rounds spread by up to {spread:.0%} of its median, so a ratio "
            f"counts only beyond x{tie_limit(spread):.2f} either way."
        )
        figures["rounds_spread"] = round(spread, 3)
    if threads and all(name in threads for name in names.values()):
        lines.append(_threads_line(names, threads, count, cores))
    compute = {k: _at(f, c, "compute_infer_ms") if "compute_infer_ms" in f else math.nan
               for k, f in sweeps.items()}  # fmt: skip
    one_threads = threads.get(names["one"]) if threads else None
    lines.append(_instances_line(instances_gain, count, one_threads, cores, compute, spread))
    lines.append(_replicas_line(versus, versus_p99, count, spread))
    lines.append(
        f"Against one server with one instance, the replicas gave {replicas_gain}: "
        + SAID[verdict(replicas_gain, spread)]
        + "."
    )
    if verdict(versus, spread) == "gain":
        said = (
            "Whatever the replicas' edge here, it is not more cores: one host has no more to give."
        )
    else:
        said = f"Whatever the replicas reach here, {count} instances in one server reach too."
    lines.append(
        f"{said} So on one host replicas buy failover, not speed: the next experiment kills "
        "one under load and no request fails. Speed comes from more cores, a second machine "
        "or one GPU per replica, and there the balancer's throughput approaches the sum of "
        "the replicas'."
    )
    if load_average is not None:
        busy = (
            "other processes shared the cores, so these figures move from run to run"
            if load_average > cores
            else "a quiet host"
        )
        lines.append(f"The host's load average was {load_average:.1f} on {cores} cores: {busy}.")
    caveat = unsettled({names[k]: frame for k, frame in sweeps.items()})
    if caveat:
        lines.append(caveat)
    takeaway = (
        f"At concurrency {c} on {cores} cores: {names['one']} {speed['one']:.1f} infer/s, "
        f"{names['instances']} {speed['instances']:.1f}, {names['replicas']} "
        f"{speed['replicas']:.1f}.",
        f"{count} instances against one: {instances_gain} ({verdict(instances_gain, spread)}); "
        f"{count} replicas against {count} instances: {versus} ({verdict(versus, spread)}).",
        (
            "One host gives replicas no more cores: whatever their edge here, they buy failover"
            if verdict(versus, spread) == "gain"
            else f"On one host replicas buy failover, not speed: {count} instances reach "
            + ("as far" if verdict(versus, spread) == "tie" else "further")
        )
        + "; speed comes from more cores or a second machine.",
    )
    return Conclusion(table, figures, "\n".join(lines), takeaway)


def _threads_line(names: dict[str, str], threads: dict[str, int], count: int, cores: int) -> str:
    per = {k: threads[name] for k, name in names.items()}
    total = {
        "one": per["one"],
        "instances": count * per["instances"],
        "replicas": count * per["replicas"],
    }
    said = (
        f"Each instance ran {per['one']} torch thread(s) alone, {per['instances']} as one of "
        f"{count} instances, {per['replicas']} in each replica: {total['one']}, "
        f"{total['instances']} and {total['replicas']} threads on {cores} cores."
    )
    if max(total.values()) > cores:
        return (
            f"{said} Where threads outnumber the cores they take turns, and torch's spinning "
            "workers waste the turns: the collapse notebook 04 avoids with one thread per instance."
        )
    return (
        f"{said} labkit gives every instance the cores less one (Triton's threads and the "
        "clients need one) divided by the instances that share them, replicas' instances "
        "included, so no configuration asks for more cores than there are."
    )


def _instances_line(
    gain: Ratio,
    count: int,
    one_threads: int | None,
    cores: int,
    compute: dict[str, float],
    spread: float = 0.0,
) -> str:
    said = f"{count} instances in one server gave {gain} over one"
    if verdict(gain, spread) == "tie":
        return (
            f"{said}: a tie, within the noise (under x{tie_limit(spread):.2f} either way): one instance "
            "already kept the cores as busy as they get."
        )
    if verdict(gain, spread) == "loss":
        return (
            f"{said}: less than one, beyond the noise: sharing the cores cost more than the "
            "extra instances brought."
        )
    if one_threads is None or one_threads < cores:
        return f"{said}: the extra instances put to work cores that one instance left idle."
    per_request = ""
    if not math.isnan(compute["one"]) and not math.isnan(compute["instances"]):
        per_request = (
            f" (the server computed {compute['one']:.0f} ms a request for the one instance, "
            f"{compute['instances']:.0f} ms for each of the {count})"
        )
    return (
        f"{said}, although one instance's {one_threads} threads already had all {cores} cores: "
        "the gain is not more cores. One instance computes one request at a time, and its "
        f"threads wait for each other at every step{per_request}; where other processes take "
        "the cores in turns, that waiting grows, while single-threaded instances never wait "
        "for a sibling thread."
    )


def _replicas_line(versus: Ratio, versus_p99: Ratio, count: int, spread: float = 0.0) -> str:
    said = (
        f"{count} replicas behind HAProxy gave {versus} against {count} instances in one server "
        f"(p99 {versus_p99})"
    )
    return {
        "gain": f"{said}: more, beyond x{tie_limit(spread):.2f}, on the same cores. Not from more cores: "
        "from what surrounds the model (each replica has its own Triton front end and "
        "scheduler, where the instances share one), or from the host's load changing between "
        "the measurements; measuring again tells which.",
        "tie": f"{said}: the same, within the noise: on the same cores a replica is an instance "
        "with a server of its own around it.",
        "loss": f"{said}: less, beyond the noise: the same cores did the same work, plus a "
        "second server's threads and the balancer's hop.",
    }[verdict(versus, spread)]
