"""Notebook 03's lesson: dynamic batching off against on, beside the tutorial's figures.

Every sentence that names a figure says the window it comes from: one concurrency level's
perf_analyzer measurement (the level both sweeps share at the top), a whole sweep (Triton's
counters over every level), or the tutorial's own runs. Gains and losses are :class:`Ratio`\\ s.
"""

from __future__ import annotations

import math

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import GAIN, Conclusion, Ratio, unsettled

#: The tutorial's perf_analyzer figures: falcon-7b on an Intel i9 with an NVIDIA A6000.
TUTORIAL_HARDWARE = "falcon-7b on an NVIDIA A6000"
TUTORIAL_OFF = {1: 21.3841}  # infer/s, batching off (the tutorial measured only concurrency 1)
TUTORIAL_ON = {4: 31.8264, 8: 46.2105, 16: 53.6549}  # infer/s, dynamic_batching {}, max 8

#: A batch that takes at most this many times one request's compute "costs little more than one".
LITTLE_MORE = 1.25


def _at(frame: pd.DataFrame, concurrency: int, column: str) -> float:
    rows = frame[frame["concurrency"] == concurrency] if column in frame else frame.iloc[0:0]
    return float(rows.iloc[0][column]) if len(rows) else math.nan


def batching_conclusion(
    off: pd.DataFrame,
    on: pd.DataFrame,
    delayed: pd.DataFrame | None = None,
    *,
    sweep_batch: float | None = None,
    queue_delay_us: int | None = None,
) -> Conclusion:
    """Batching off against on (and against on with a queue delay), level by level.

    ``off``/``on``/``delayed`` are :func:`labkit.profiling.perf_analyzer` sweeps. The headline
    figures are taken at the highest concurrency both sweeps measured (8 by default), in that
    level's measurement windows. ``sweep_batch`` is the average batch over the whole batching-on
    sweep (Triton's counters, every level), ``queue_delay_us`` the delayed run's queue delay.
    """
    levels = sorted(set(off["concurrency"]) & set(on["concurrency"]))
    if not levels:
        raise ConfigError(
            "the two sweeps share no concurrency level; measure both at the same ones"
        )
    table = _table(off, on, delayed, levels)
    c = levels[-1]
    gain = Ratio.between(_at(on, c, "throughput"), _at(off, c, "throughput"), "infer/s")
    p99 = Ratio.between(_at(on, c, "p99_ms"), _at(off, c, "p99_ms"), "p99 latency")
    batch = _at(on, c, "avg_batch_size")
    figures: dict = {
        f"throughput_ratio_c{c}": gain,
        f"p99_ratio_c{c}": p99,
        f"avg_batch_size_c{c}": round(batch, 2),
    }
    window = f"At concurrency {c} (perf_analyzer's measurement at that level)"
    lines = [
        f"{window}, dynamic batching served {_at(on, c, 'throughput'):.2f} infer/s against "
        f"{_at(off, c, 'throughput'):.2f} without it: {gain}. Its p99 latency went from "
        f"{_at(off, c, 'p99_ms'):.0f} ms to {_at(on, c, 'p99_ms'):.0f} ms ({p99}), and Triton "
        f"executed {batch:.2f} requests per call on average in that measurement."
    ]
    if sweep_batch is not None and not math.isnan(sweep_batch):
        figures["avg_batch_size_on_sweep"] = round(float(sweep_batch), 2)
        sweep_levels = ", ".join(str(int(level)) for level in sorted(on["concurrency"]))
        why = (
            ": the lower levels have fewer requests waiting to be batched"
            if sweep_batch < batch
            else ""
        )
        lines.append(
            f"Over the whole batching-on sweep (Triton's counters across concurrency "
            f"{sweep_levels}, every window perf_analyzer ran), the average batch was "
            f"{sweep_batch:.2f}{why}."
        )
    cost = _batch_cost(off, on, c, batch)
    if cost:
        figures[f"compute_per_request_ratio_c{c}"] = cost[1]
        lines.append(cost[0])
    lines.append(_tutorial(c, gain))
    if delayed is not None and c in set(delayed["concurrency"]):
        d_gain = Ratio.between(_at(delayed, c, "throughput"), _at(off, c, "throughput"), "infer/s")
        d_batch = _at(delayed, c, "avg_batch_size")
        figures[f"delayed_throughput_ratio_c{c}"] = d_gain
        figures[f"delayed_avg_batch_size_c{c}"] = round(d_batch, 2)
        delay = f"of {queue_delay_us / 1000:.0f} ms " if queue_delay_us else ""
        lines.append(
            f"With a queue delay {delay}(its own perf_analyzer run at concurrency {c}), Triton "
            f"executed {d_batch:.2f} requests per call and served {_at(delayed, c, 'throughput'):.2f}"
            f" infer/s, {d_gain} against batching off at {c}"
            + (
                ": without a delay, a request that arrives just after a batch started waits for "
                "the next one, and the clients settle into smaller groups that take turns."
                if d_batch > batch
                else f"; its batches were no larger than without the delay ({batch:.2f})."
            )
        )
    caveat = unsettled({"off": off, "on": on, "delayed": delayed})
    if caveat:
        lines.append(caveat)
    takeaway = [
        f"At concurrency {c}, dynamic batching gave {gain} ({_at(on, c, 'throughput'):.1f} "
        f"against {_at(off, c, 'throughput'):.1f}) and {p99}.",
        f"Triton executed {batch:.2f} requests per call at concurrency {c}"
        + (
            f", {figures['avg_batch_size_on_sweep']:.2f} over the whole sweep."
            if "avg_batch_size_on_sweep" in figures
            else "."
        ),
    ]
    if f"delayed_throughput_ratio_c{c}" in figures:
        takeaway.append(
            f"With a queue delay, {figures[f'delayed_avg_batch_size_c{c}']:.2f} requests per "
            f"call and {figures[f'delayed_throughput_ratio_c{c}']} against batching off."
        )
    return Conclusion(table, figures, "\n".join(lines), tuple(takeaway))


def _table(
    off: pd.DataFrame, on: pd.DataFrame, delayed: pd.DataFrame | None, levels: list
) -> pd.DataFrame:
    """One row per shared level; the tutorial's figures in two columns, batching off and on."""
    rows = []
    for c in levels:
        row = {
            "concurrency": c,
            "off infer/s": _at(off, c, "throughput"),
            "on infer/s": _at(on, c, "throughput"),
            "off p95 ms": _at(off, c, "p95_ms"),
            "on p95 ms": _at(on, c, "p95_ms"),
            "off p99 ms": _at(off, c, "p99_ms"),
            "on p99 ms": _at(on, c, "p99_ms"),
            "on batch": _at(on, c, "avg_batch_size"),
        }
        if delayed is not None:
            row["delayed infer/s"] = _at(delayed, c, "throughput")
            row["delayed p99 ms"] = _at(delayed, c, "p99_ms")
            row["delayed batch"] = _at(delayed, c, "avg_batch_size")
        row["tutorial off infer/s"] = TUTORIAL_OFF.get(c, math.nan)
        row["tutorial on infer/s"] = TUTORIAL_ON.get(c, math.nan)
        rows.append(row)
    return pd.DataFrame(rows).round(2)


def _batch_cost(off: pd.DataFrame, on: pd.DataFrame, c: int, batch: float) -> tuple | None:
    """The sentence on what a batch costs at level ``c``, from the server's compute times: one
    batched execution (every request in it is charged the whole execution) against one request
    alone; and the compute per request in a batch over that alone, as a :class:`Ratio`."""
    alone, batched = _at(off, c, "compute_infer_ms"), _at(on, c, "compute_infer_ms")
    if any(math.isnan(x) for x in (alone, batched, batch)) or not alone or batch <= 0:
        return None
    per_request = Ratio(batched / batch / alone, "compute per request")
    head = (
        f"In the same measurements at {c}, one batched execution ({batch:.2f} requests on "
        f"average) took {batched:.0f} ms of compute against {alone:.0f} ms for one request "
        f"alone (x{batched / alone:.2f})"
    )
    if batch >= 2 and batched / alone <= LITTLE_MORE:
        words = f"{head}: a batch cost little more than one request, {per_request}."
    elif per_request.value <= 1 / GAIN:
        words = (
            f"{head}: a batch cost more than one request, but less than its requests one by "
            f"one: {per_request}."
        )
    elif per_request.value < GAIN:
        words = (
            f"{head}: a request cost about as much in a batch as alone ({per_request}), so "
            "batching saved no compute here."
        )
    else:
        words = f"{head}: a request cost more in a batch than alone ({per_request})."
    return words, per_request


def _tutorial(c: int, gain: Ratio) -> str:
    """The tutorial's figures, each with its concurrency, and whether this run agrees."""
    off_level, off_rate = next(iter(TUTORIAL_OFF.items()))
    on_rate = TUTORIAL_ON.get(c)
    if on_rate:
        theirs = Ratio(on_rate / off_rate, "infer/s")
        measured = (
            f"{on_rate:.1f} with it at concurrency {c}: {theirs}, across two concurrencies "
            f"(it gives no unbatched figure at {c})"
        )
    else:
        measured = f"no figure at concurrency {c}"
    top, top_rate = max(TUTORIAL_ON.items())
    said = (
        f"The tutorial ({TUTORIAL_HARDWARE}) measured {off_rate:.1f} infer/s without batching at "
        f"concurrency {off_level} and {measured}; at {top}, {top_rate:.1f} infer/s, "
        f"{Ratio(top_rate / off_rate, 'infer/s')} over its unbatched figure, which it calls "
        '"nearly triple".'
    )
    if gain.value >= GAIN:
        verdict = f"Here too, at {c}, batching multiplied throughput ({gain})."
    elif gain.value > 1 / GAIN:
        verdict = (
            f"Here, at {c}, batching gave {gain}, within x{GAIN:.2f} either way of no change: "
            "a tie, not the tutorial's gain."
        )
    else:
        verdict = (
            f"Here, at {c}, batching lowered throughput ({gain}): the opposite of the tutorial's "
            "result."
        )
    return f"{said} {verdict}"
