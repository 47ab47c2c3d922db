"""Notebook 03's measurements and verdicts: dynamic batching off against on, and a queue delay
with requests that arrive one at a time. Why each comes out as it does is the notebook's prose."""

from __future__ import annotations

import math

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Verdict
from labkit.profiling.arrivals import DELAY, LONE, NO_DELAY, Served

#: The tutorial's perf_analyzer figures (falcon-7b, NVIDIA A6000), requests/s.
TUTORIAL_ROWS = {"tutorial's A6000, batching off, 1 client": 21.3841,
                 "tutorial's A6000, batching on, 8 clients": 46.2105}  # fmt: skip
#: The price table's column for the run of the batch a request was in.
RUN = "its batch's run (ms)"
#: A sweep's headline figures, in the order of the headline table's columns.
SWEPT = ("throughput", "avg_batch_size", "queue_ms", "p50_ms")
#: What a table cell says for a figure a setting has none of.
NONE = "–"

SWEEP_COLUMNS = {
    "concurrency": "clients",
    "throughput": "requests/s",
    "p50_ms": "p50 latency (ms)",
    "p95_ms": "p95 latency (ms)",
    "p99_ms": "p99 latency (ms)",
    "queue_ms": "queue wait (ms)",
    "compute_infer_ms": "its batch's run, per request (ms)",
    "avg_batch_size": "requests per execution",
    "request_count": "requests measured",
    "stable": "windows agreed",
}
SERVED_COLUMNS = {
    "config": "sweep",
    "inference_count": "requests",
    "execution_count": "executions",
    "avg_batch_size": "requests per execution",
    "avg_queue_ms": "queue wait (ms)",
    "avg_compute_infer_ms": "its batch's run, per request (ms)",
}
ARRIVAL_COLUMNS = {
    "round": "round",
    "setting": "setting",
    "requests": "requests",
    "batch": "requests per execution",
    "queue_ms": "queue wait (ms)",
    "compute_ms": "one execution (ms)",
    "model_ms_per_request": "model time per request (ms)",
    "p50_ms": "p50 latency (ms)",
}


def _rounded(frame: pd.DataFrame, columns: dict, *counts: str) -> pd.DataFrame:
    """``frame``'s ``columns`` renamed to words; milliseconds and ``counts`` as whole numbers."""
    table = frame[[c for c in columns if c in frame]].copy()
    for column in table:
        if "_ms" in column or column in counts:
            table[column] = table[column].round(0).astype("Int64")
    table = table.round(2).rename(columns=columns).rename_axis(columns=None)
    first = next(iter(columns.values()))
    return table.set_index(first) if first in table else table


def sweep_table(frame: pd.DataFrame) -> pd.DataFrame:
    """A perf_analyzer sweep, one row per number of clients, in words with units."""
    if "stable" in frame:
        frame = frame.assign(stable=frame["stable"].map({True: "yes", False: "no"}))
    return _rounded(frame, SWEEP_COLUMNS, "request_count")


def served_table(served: pd.DataFrame) -> pd.DataFrame:
    """Triton's counters over each sweep (metrics frames with a ``config`` column), in words."""
    return _rounded(served, SERVED_COLUMNS, "inference_count", "execution_count")


def batch_cost_table(served: Served) -> pd.DataFrame:
    """What an execution cost by its batch size, from ``after - before`` :class:`Served`: its
    runs, one run's time, that time per request, and its share of the interval's time."""
    rows = [(str(size), runs, ms, size * runs) for size, (runs, ms) in served.batches.items()]
    rows.append(("all", served.executions, served.compute_ms, served.requests))
    return pd.DataFrame(
        [
            {
                "requests per execution": size,
                "executions": runs,
                "one execution (ms)": round(ms / runs),
                "model time per request (ms)": round(ms / requests),
                "share of the time computing (%)": round(100 * ms / 1000 / served.at_s, 1),
            }
            for size, runs, ms, requests in rows
            if runs
        ]
    ).set_index("requests per execution")


def arrivals_table(arrivals: pd.DataFrame) -> pd.DataFrame:
    """:func:`delay_rounds`' rows, in words, rounded."""
    return _rounded(arrivals, {"setting": "setting", **ARRIVAL_COLUMNS})


def delay_price(arrivals: pd.DataFrame) -> pd.DataFrame:
    """What the queue delay cost a paced request, averaged over the rounds: its latency, and
    the parts of it (queue wait, its batch's run, the rest), without and with the delay, and the
    change; the parts add up to the mean latency."""
    mean = arrivals.groupby("setting")[["mean_ms", "queue_ms", "run_ms", "p50_ms"]].mean()
    mean = mean.reindex([NO_DELAY, DELAY])
    mean.loc["change"] = mean.loc[DELAY] - mean.loc[NO_DELAY]
    table = pd.DataFrame(
        {
            "mean latency (ms)": mean["mean_ms"],
            "queue wait (ms)": mean["queue_ms"],
            RUN: mean["run_ms"],
            "the rest (ms)": mean["mean_ms"] - mean["queue_ms"] - mean["run_ms"],
            "p50 latency (ms)": mean["p50_ms"],
        }
    )
    return table.round(0).astype(int).rename_axis("setting")


def batching_conclusion(
    off: pd.DataFrame, on: pd.DataFrame, arrivals: pd.DataFrame | None = None
) -> Conclusion:
    """Verdicts, headline table, figures and takeaway: batching off against on at the most
    clients both sweeps measured (bounded by the drift the two show at 1 client, where batching
    has nothing to group), then the queue delay's paced rounds (:func:`delay_rounds`' rows)."""
    levels = sorted(set(off["concurrency"]) & set(on["concurrency"]))
    if not levels:
        raise ConfigError(
            "the two sweeps share no concurrency level; measure both at the same ones"
        )
    c, verdicts, drift = levels[-1], [], 1.0
    if c != 1 and 1 in levels:
        alone = Verdict("batching on against off, 1 client (nothing to group)",
                        [_at(on, 1, "throughput") / _at(off, 1, "throughput")], "requests/s")  # fmt: skip
        verdicts.append(alone)
        drift = max(alone.median, 1 / alone.median) if alone.measured else 1.0
    ratio = _at(on, c, "throughput") / _at(off, c, "throughput")
    gain = Verdict(f"batching on against off, {c} clients", [ratio], "requests/s", noise=drift)
    verdicts.append(gain)
    batch = _at(on, c, "avg_batch_size")
    figures: dict = {gain.comparison: gain.ratio, f"requests per execution, {c} clients": batch}
    rows = [_row(f"batching {name}, {c} clients", *(_at(frame, c, k) for k in SWEPT))
            for name, frame in (("off", off), ("on", on))]  # fmt: skip
    takeaway = [f"Dynamic batching against none at {c} clients: {gain.word}, {gain.ratio}, in "
                f"batches of {batch:.1f}."]  # fmt: skip
    if arrivals is not None and not arrivals.empty:
        delay_verdicts, delay_figures, delay_rows, delay_takeaway = _delay(arrivals)
        verdicts += delay_verdicts
        figures.update(delay_figures)
        rows += delay_rows
        takeaway += delay_takeaway
    rows += [_row(name, rate) for name, rate in TUTORIAL_ROWS.items()]
    table = pd.DataFrame(rows).set_index("measured")
    return Conclusion(table, figures, "", tuple(takeaway), tuple(verdicts))


def _delay(arrivals: pd.DataFrame) -> tuple[list, dict, list, list]:
    """The queue delay's verdicts (round by round: requests per execution, and requests per
    second of model time), figures, headline rows and takeaway lines."""
    by = {s: arrivals[arrivals["setting"] == s].sort_values("round") for s in (NO_DELAY, DELAY)}
    if any(frame.empty for frame in by.values()):
        raise ConfigError(f"the arrivals need rows of both settings, {NO_DELAY!r} and {DELAY!r}")
    none, delay = (by[s].reset_index(drop=True) for s in (NO_DELAY, DELAY))
    what = "queue delay against none, paced"
    bigger = Verdict(what, delay["batch"] / none["batch"], "requests per execution")
    cheaper = Verdict(what, none["model_ms_per_request"] / delay["model_ms_per_request"],
                      "requests per second of model time")  # fmt: skip
    price = delay_price(arrivals).loc["change"] / 1000  # seconds
    mean = {s: frame.mean(numeric_only=True) for s, frame in by.items()}
    mean[LONE] = arrivals[arrivals["setting"] == LONE].mean(numeric_only=True)
    figures = {
        what: cheaper.ratio,
        "requests per execution with the queue delay": mean[DELAY]["batch"],
        "p50 latency the queue delay added (s)": price["p50 latency (ms)"],
    }
    if mean[LONE].notna().any():
        figures["one lone client's queue wait (s)"] = mean[LONE]["queue_ms"] / 1000
    rows = [_row(s, m["requests"] / m["seconds"], *m[["batch", "queue_ms", "p50_ms"]])
            for s, m in mean.items() if m.notna().any()]  # fmt: skip
    takeaway = [
        f"A queue delay with paced arrivals: {cheaper.word}, {cheaper.ratio}, in batches of "
        f"{mean[DELAY]['batch']:.1f} instead of {mean[NO_DELAY]['batch']:.1f}.",
        f"Its price: p50 latency {price['p50 latency (ms)']:+.2f} s; on average "
        f"{price['queue wait (ms)']:+.2f} s of queue wait and {price[RUN]:+.2f} s of batch run "
        "per request.",
    ]
    return [bigger, cheaper], figures, rows, takeaway


def _at(frame: pd.DataFrame, concurrency: int, column: str) -> float:
    rows = frame[frame["concurrency"] == concurrency] if column in frame else frame.iloc[0:0]
    return float(rows.iloc[0][column]) if len(rows) else math.nan


def _row(measured: str, rate: float, batch=math.nan, queue_ms=math.nan, p50_ms=math.nan) -> dict:
    """A headline row: requests/s, requests per execution, queue wait and p50 (– for none)."""
    cells = {"requests/s": (rate, 2), "requests per execution": (batch, 2),
             "queue wait (ms)": (queue_ms, 0), "p50 latency (ms)": (p50_ms, 0)}  # fmt: skip
    return {"measured": measured} | {
        name: NONE if math.isnan(float(v)) else round(float(v), d) if d else round(float(v))
        for name, (v, d) in cells.items()
    }
