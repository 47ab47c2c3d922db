"""Notebook 03's lesson: what dynamic batching buys, and when a queue delay is worth its wait.

Two experiments, each with the mechanism that predicts it:

- **Batching off against on**, with perf_analyzer's closed-loop clients: one ``generate`` over
  several prompts costs little more than over one, so when several requests wait together,
  running them as one batch multiplies throughput. One client never has company: nothing to batch.
- **A queue delay** (``max_queue_delay_microseconds``), with requests that arrive one at a time
  (:func:`measure_arrivals`, paced like independent users), delay and no delay in alternating
  rounds (:func:`delay_rounds`): the delay holds the first request until others join it, which
  buys bigger batches (less model time per request) and costs waiting. A lone client waits the
  whole delay on every request.

:func:`batching_conclusion` explains both with the figures that matter, calls a difference
within the measured spread a tie, and keeps at most six headline figures and a three-sentence
takeaway. :func:`sweep_table`, :func:`served_table` and :func:`arrivals_table` put the
measurements in words a learner reads, with units.
"""

from __future__ import annotations

import math

import pandas as pd

from labkit import proc, profiling
from labkit.errors import ConfigError, InferenceError
from labkit.lessons.conclusion import GAIN, Conclusion, Ratio, judge, unsettled
from labkit.load import Load

#: The tutorial's perf_analyzer figures: falcon-7b on an Intel i9 with an NVIDIA A6000.
TUTORIAL_HARDWARE = "falcon-7b on an NVIDIA A6000"
TUTORIAL_ROW = "tutorial's A6000"  # how the table names the tutorial's rows
TUTORIAL_OFF = {1: 21.3841}  # infer/s, batching off (the tutorial measured only concurrency 1)
TUTORIAL_ON = {4: 31.8264, 8: 46.2105, 16: 53.6549}  # infer/s, dynamic_batching {}, max 8

#: The settings :func:`delay_rounds` measures: paced arrivals without and with the queue delay
#: (alternating), then one closed-loop client with the delay. Every table and chart names each
#: setting by these words, and only these.
NO_DELAY, DELAY, LONE = "paced, no delay", "paced, queue delay", "1 client, queue delay"
#: How long to wait for Triton's counters to count the last answered request.
COUNTERS_TIMEOUT_S = 10.0

#: perf_analyzer's columns as a learner reads them (labkit.profiling's names -> words, units).
SWEEP_COLUMNS = {
    "concurrency": "clients",
    "throughput": "requests/s",
    "p50_ms": "p50 latency (ms)",
    "p95_ms": "p95 latency (ms)",
    "p99_ms": "p99 latency (ms)",
    "queue_ms": "queue wait (ms)",
    "compute_infer_ms": "compute of each request's batch (ms)",
    "avg_batch_size": "requests per execution",
    "request_count": "requests measured",
    "stable": "windows agreed",
}
#: Triton's counters over a whole sweep (:func:`labkit.profiling.metrics`), in words.
SERVED_COLUMNS = {
    "config": "sweep",
    "inference_count": "requests",
    "execution_count": "executions",
    "avg_batch_size": "requests per execution",
    "avg_queue_ms": "queue wait (ms)",
    "avg_compute_infer_ms": "compute of each request's batch (ms)",
}
COUNTS = ("inference_count", "execution_count", "requests")
#: :func:`measure_arrivals`' rows, in words.
ARRIVAL_COLUMNS = {
    "round": "round",
    "setting": "setting",
    "requests": "requests",
    "batch": "requests per execution",
    "queue_ms": "queue wait (ms)",
    "compute_ms": "compute of each request's batch (ms)",
    "model_ms_per_request": "model time per request (ms)",
    "p50_ms": "p50 latency (ms)",
}


def _at(frame: pd.DataFrame, concurrency: int, column: str) -> float:
    rows = frame[frame["concurrency"] == concurrency] if column in frame else frame.iloc[0:0]
    return float(rows.iloc[0][column]) if len(rows) else math.nan


def sweep_table(frame: pd.DataFrame) -> pd.DataFrame:
    """A perf_analyzer sweep (:func:`labkit.profiling.perf_analyzer`) as a learner reads it: one
    row per number of clients, columns in words with units, rounded."""
    table = _whole(frame[[c for c in SWEEP_COLUMNS if c in frame]], "request_count")
    if "stable" in table:
        table["stable"] = table["stable"].map({True: "yes", False: "no"})
    table = table.round(2).rename(columns=SWEEP_COLUMNS)
    return table.set_index("clients") if "clients" in table else table


def _whole(frame: pd.DataFrame, *counts: str) -> pd.DataFrame:
    """``frame`` with its milliseconds and ``counts`` columns as whole numbers (blank if none)."""
    frame = frame.copy()
    for column in frame:
        if column.endswith("_ms") or column in counts:
            frame[column] = frame[column].round(0).astype("Int64")
    return frame


def served_table(served: pd.DataFrame) -> pd.DataFrame:
    """Triton's counters over each sweep (:func:`labkit.profiling.metrics` ``since=`` frames with
    a ``config`` column), in words."""
    table = _whole(served[[c for c in SERVED_COLUMNS if c in served]], *COUNTS)
    table = table.round(2).rename(columns=SERVED_COLUMNS).rename_axis(columns=None)
    return table.set_index("sweep") if "sweep" in table else table


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
    """Send ``requests`` requests to ``model``, one every ``every_s`` seconds (paced, as
    independent users arrive; at most ``clients`` in flight), or from ``clients`` closed-loop
    clients when ``every_s`` is None; return what the server did with them.

    The row: ``batch`` (requests per execution), ``queue_ms`` (average wait in the scheduler's
    queue), ``compute_ms`` (average compute per execution: each request of a batch is charged the
    whole execution), ``model_ms_per_request`` (compute per execution over the batch: the model's
    time each request cost), and the client's ``p50_ms``, from Triton's counters over the load.
    ``seconds`` is the time the requests are counted over: from the first send to the last
    answer, and for paced arrivals at least ``requests`` gaps (the last request's own gap ends
    after it is sent, so ``requests`` paced at 1.25 a second count as 1.25 a second, not more).
    """
    if requests < 1 or (every_s is not None and every_s <= 0):
        raise ConfigError(
            f"requests={requests} must be >= 1 and every_s={every_s} > 0 (or None: closed loop)"
        )
    before = profiling.metrics(server)
    rate = 1.0 / every_s if every_s else None
    load = Load(
        server.http_url,
        model,
        endpoint="infer",
        prompt=prompt,
        concurrency=clients,
        rate_per_s=rate,
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
    served = _served_since(server, model, before, summary["answered"])
    seconds = float(summary["seconds"])
    if every_s:  # paced: counted over the requests' whole pacing, not up to the last answer
        seconds = max(seconds, requests * every_s)
    batch = float(served["avg_batch_size"])
    compute = float(served["avg_compute_infer_ms"])
    return {
        "requests": summary["answered"],
        "batch": batch,
        "queue_ms": float(served["avg_queue_ms"]),
        "compute_ms": compute,
        "model_ms_per_request": compute / batch if batch else math.nan,
        "p50_ms": float(summary["p50_ms"]),
        "seconds": seconds,
    }


def _served_since(server, model: str, before: pd.DataFrame, answered: int) -> pd.Series:
    """Triton's counters for ``model`` since ``before``, once they count every answered request
    (Triton counts a request just after it sends the answer)."""
    seen: list[pd.Series] = []

    def counted() -> bool:
        seen.append(profiling.metrics(server, since=before).set_index("model").loc[model])
        return seen[-1]["inference_count"] >= answered

    proc.wait_until(counted, COUNTERS_TIMEOUT_S)
    return seen[-1]


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
    """The same paced arrivals to ``plain`` (batching, no queue delay) and ``delayed`` (the same
    model with one), in alternating rounds (no delay, delay, no delay, delay, ...): the host's
    drift falls on both alike, and the rounds show the spread. Then, when ``lone_requests``,
    that many requests from one closed-loop client to ``delayed``: low load. One row per round
    and setting (:data:`NO_DELAY`, :data:`DELAY`, :data:`LONE`)."""
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


def arrivals_table(arrivals: pd.DataFrame) -> pd.DataFrame:
    """:func:`delay_rounds`' (or :func:`measure_arrivals`') rows, in words, rounded."""
    table = arrivals[[c for c in ARRIVAL_COLUMNS if c in arrivals]].copy()
    for column in ("queue_ms", "compute_ms", "model_ms_per_request", "p50_ms"):
        if column in table:
            table[column] = table[column].round(0).astype("Int64")
    table = table.round(2).rename(columns=ARRIVAL_COLUMNS)
    return table.set_index("setting") if "setting" in table else table


def paced_interval_s(compute_ms: float) -> float:
    """The gap between paced arrivals: twice one request's compute (``compute_ms``, alone),
    rounded up to 0.1 s, so that without a delay each request finds the model idle and runs
    alone, even when the host runs up to twice as slow as when ``compute_ms`` was measured."""
    if not compute_ms > 0:
        raise ConfigError(f"one request's compute must be > 0 ms, got {compute_ms}")
    return math.ceil(2 * compute_ms / 100) / 10


def queue_delay_us(every_s: float) -> int:
    """A delay of 2.5 arrival gaps: the first request of a batch waits for the next two, and the
    batch leaves before a fourth can arrive."""
    return int(round(2.5 * every_s * 1e6))


def verdict(new: list[float], old: list[float]) -> int:
    """+1, 0 or -1 (a rise, a tie, a fall) of ``new`` against ``old``, measured in alternating
    rounds: the lab's one rule (:func:`~labkit.lessons.conclusion.judge`) on their ratios, round
    by round."""
    return {"gain": 1, "tie": 0, "loss": -1}[
        judge([n / o for n, o in zip(new, old, strict=False) if o])
    ]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def batching_conclusion(
    off: pd.DataFrame,
    on: pd.DataFrame,
    arrivals: pd.DataFrame | None = None,
    *,
    every_s: float | None = None,
    delay_us: int | None = None,
) -> Conclusion:
    """What the notebook measured, explained: batching off against on at the most clients both
    sweeps measured, and (when given) the queue delay's ``arrivals`` (:func:`delay_rounds`: paced
    rounds, one request every ``every_s`` seconds, and a lone client). ``delay_us`` is the delay.

    A gain counts only beyond x1.2 and beyond the drift the two sweeps show at 1 client (where
    batching has nothing to group, so off and on measure the same thing); the delay's effects
    count only where every round of one setting is beyond every round of the other.
    """
    levels = sorted(set(off["concurrency"]) & set(on["concurrency"]))
    if not levels:
        raise ConfigError(
            "the two sweeps share no concurrency level; measure both at the same ones"
        )
    c = levels[-1]
    rate_off, rate_on = _at(off, c, "throughput"), _at(on, c, "throughput")
    gain = Ratio.between(rate_on, rate_off, "requests/s")
    batch = _at(on, c, "avg_batch_size")
    drift = _drift(off, on) if c != 1 else 1.0
    bar = max(GAIN, drift)
    figures: dict = {f"batching_gain_at_{c}_clients": gain}
    if not math.isnan(batch):
        figures[f"requests_per_execution_at_{c}_clients"] = round(batch, 2)
    rows = [
        _row(f"batching off, {c} clients", rate_off, off, c),
        _row(f"batching on, {c} clients", rate_on, on, c),
    ]
    lines = [_batching_words(c, gain, bar, batch, off, on)]
    if drift > 1.0:
        lines.append(
            f"At 1 client, where there is nothing to batch, the two sweeps differ by "
            f"x{drift:.2f}: that is this host's drift between them"
            + (
                f", within the lab's x{GAIN:.2f}, so the rule above stands as it is."
                if bar <= GAIN
                else f", wider than the lab's x{GAIN:.2f}, so by the rule above only a change "
                f"beyond x{bar:.2f} counts."
            )
        )
    lines.append(_tutorial())
    takeaway = [_batching_takeaway(c, gain, bar, rate_on, rate_off, batch)]
    if arrivals is not None and not arrivals.empty:
        words, line, delay_figures, delay_rows = _delay(arrivals, every_s, delay_us)
        figures.update(delay_figures)
        rows += delay_rows
        lines.append(words)
        takeaway += line
    caveat = unsettled({"batching off": off, "batching on": on})
    if caveat:
        lines.append(caveat)
    table = pd.DataFrame(rows + _tutorial_rows()).set_index("measured")
    return Conclusion(table, figures, "\n".join(lines), tuple(takeaway))


def _drift(off: pd.DataFrame, on: pd.DataFrame) -> float:
    """How far apart the two sweeps are at 1 client (>= 1), or 1 when either lacks it."""
    ratio = _at(on, 1, "throughput") / _at(off, 1, "throughput")
    if math.isnan(ratio) or ratio <= 0:
        return 1.0
    return max(ratio, 1 / ratio)


#: What a table cell says for a figure this setting has none of.
NONE = "–"


def _cell(value: float, digits: int = 0) -> float | int | str:
    """A table cell: ``value`` rounded (an int for whole milliseconds), or :data:`NONE`."""
    value = float(value)
    if math.isnan(value):
        return NONE
    return round(value) if digits == 0 else round(value, digits)


def _row(measured: str, rate: float, frame: pd.DataFrame, c: int) -> dict:
    return {
        "measured": measured,
        "requests/s": _cell(rate, 2),
        "requests per execution": _cell(_at(frame, c, "avg_batch_size"), 2),
        "queue wait (ms)": _cell(_at(frame, c, "queue_ms")),
        "p50 latency (ms)": _cell(_at(frame, c, "p50_ms")),
    }


def _batching_words(
    c: int, gain: Ratio, bar: float, batch: float, off: pd.DataFrame, on: pd.DataFrame
) -> str:
    rate_off, rate_on = _at(off, c, "throughput"), _at(on, c, "throughput")
    alone, batched = _at(off, c, "compute_infer_ms"), _at(on, c, "compute_infer_ms")
    cost = (
        f", and the batch a request ran in, {batch:.1f} requests on average, computed for "
        f"{batched:.0f} ms against {alone:.0f} ms for one request alone (an average over the "
        "requests: a larger batch counts once for each of its requests, so it weighs more)"
        if not any(math.isnan(x) for x in (alone, batched, batch))
        else ""
    )
    if gain.value >= bar:
        said = (
            f"With {c} clients, batching served {rate_on:.2f} requests/s against {rate_off:.2f} "
            f"without it ({gain}): Triton ran {batch:.1f} requests per execution{cost}."
        )
    elif gain.value > 1 / bar:
        said = (
            f"With {c} clients, batching served {rate_on:.2f} requests/s against {rate_off:.2f} "
            f"without it ({gain}), within x{bar:.2f} either way: a tie on this host. Triton ran "
            f"{batch:.1f} requests per execution{cost}."
        )
    else:
        said = (
            f"With {c} clients, batching served fewer requests: {rate_on:.2f} a second against "
            f"{rate_off:.2f} ({gain}); Triton ran {batch:.1f} requests per execution{cost}."
        )
    return f"{said} {_groups(c, batch)}" if not math.isnan(batch) else said


def _groups(c: int, batch: float) -> str:
    """Why ``c`` closed-loop clients made batches of ``batch``: the requests answered together
    come back together."""
    if batch >= c - 0.5:
        return (
            f"All {c} clients travelled as one group: the requests answered together come back "
            "together, so every batch was full the moment it formed."
        )
    return (
        f"Not {c} per execution, because closed-loop clients travel in groups: the requests "
        "answered together come back together, and one group waits in the queue while another "
        "runs."
    )


def _batching_takeaway(
    c: int, gain: Ratio, bar: float, rate_on: float, rate_off: float, batch: float
) -> str:
    rates = _rates(rate_on, rate_off)
    if gain.value >= bar:
        return (
            f"Dynamic batching served {gain.value:.1f} times as many requests per second with "
            f"{c} clients ({rates}) by running {batch:.1f} requests per execution."
        )
    if gain.value > 1 / bar:
        return (
            f"With {c} clients, dynamic batching's {rates} requests per second is within this "
            "host's noise."
        )
    return f"With {c} clients, dynamic batching served fewer requests per second ({rates})."


def _rates(rate_on: float, rate_off: float) -> str:
    """Two rates, with the digits that let a reader divide them and get the ratio said beside
    them: two decimals under 10 requests/s (5.33 against 1.85, x2.88), one above."""
    digits = 2 if max(rate_on, rate_off) < 10 else 1
    return f"{rate_on:.{digits}f} against {rate_off:.{digits}f}"


def _tutorial() -> str:
    """The tutorial's figures in one sentence (the table has them beside this run's)."""
    off_rate = TUTORIAL_OFF[1]
    top, top_rate = max(TUTORIAL_ON.items())
    return (
        f"The tutorial ({TUTORIAL_HARDWARE}) went from {off_rate:.1f} requests/s without "
        f"batching at 1 client to {TUTORIAL_ON[8]:.1f} with it at 8 and {top_rate:.1f} at {top}, "
        f'its "nearly triple" (x{TUTORIAL_ON[8] / off_rate:.1f} and x{top_rate / off_rate:.1f} '
        "by its own figures). It set 1 client without batching beside many with it, which is "
        "fair because without batching more clients serve no more requests a second (the first "
        "sweep above shows it here); a GPU gains for the same reason, one pass over the weights "
        "serves the whole batch."
    )


def _tutorial_rows() -> list[dict]:
    rows = (("batching off, 1 client", TUTORIAL_OFF[1]), ("batching on, 8 clients", TUTORIAL_ON[8]))
    return [
        {
            "measured": f"{TUTORIAL_ROW}, {setting}",
            "requests/s": _cell(rate, 2),
            "requests per execution": NONE,
            "queue wait (ms)": NONE,
            "p50 latency (ms)": NONE,
        }
        for setting, rate in rows
    ]


def _delay(
    arrivals: pd.DataFrame, every_s: float | None, delay_us: int | None
) -> tuple[str, list[str], dict, list[dict]]:
    """The queue delay's words, takeaway lines, figures and table rows."""
    by = {s: arrivals[arrivals["setting"] == s] for s in (NO_DELAY, DELAY)}
    alone = arrivals[arrivals["setting"] == LONE]
    lone = alone.mean(numeric_only=True) if not alone.empty else None
    if any(frame.empty for frame in by.values()):
        raise ConfigError(
            f"the arrivals need rows of both settings, {NO_DELAY!r} and {DELAY!r} (delay_rounds)"
        )
    mean = {s: frame.mean(numeric_only=True) for s, frame in by.items()}
    batches = {s: list(frame["batch"]) for s, frame in by.items()}
    per_request = {s: list(frame["model_ms_per_request"]) for s, frame in by.items()}
    bigger = verdict(batches[DELAY], batches[NO_DELAY])
    cheaper = -verdict(per_request[DELAY], per_request[NO_DELAY])
    wait = mean[DELAY]["queue_ms"] - mean[NO_DELAY]["queue_ms"]
    delay = f"{delay_us / 1e6:.2f} s " if delay_us else ""  # as the notebook prints it
    pace = f"one every {every_s:.1f} s" if every_s else "paced"
    figures: dict = {
        "requests_per_execution_with_queue_delay": round(float(mean[DELAY]["batch"]), 2),
        "queue_wait_with_delay_ms": round(float(mean[DELAY]["queue_ms"])),
    }
    rounds = len(by[DELAY])
    if bigger > 0:
        bought = (
            f"made batches of {mean[DELAY]['batch']:.1f} requests instead of "
            f"{mean[NO_DELAY]['batch']:.1f}"
        )
    else:
        bought = (
            f"made batches of {mean[DELAY]['batch']:.1f} requests against "
            f"{mean[NO_DELAY]['batch']:.1f} without it, within the spread of its {rounds} rounds"
        )
    model_time = (
        f"{mean[NO_DELAY]['model_ms_per_request']:.0f} to "
        f"{mean[DELAY]['model_ms_per_request']:.0f} ms"
    )
    saved = {
        1: f", which cut the model's time per request from {model_time}",
        0: f"; the model's time per request ({model_time}) changed within the rounds' spread",
        -1: f", yet the model's time per request rose from {model_time}",
    }[cheaper]
    figures["with queue delay against without"] = Ratio.between(
        mean[DELAY]["model_ms_per_request"],
        mean[NO_DELAY]["model_ms_per_request"],
        "model time per request",
    )
    words = (
        f"With requests arriving one at a time ({pace}), the {delay}queue delay {bought}"
        f"{saved}; the price was {wait / 1000:.2f} s more waiting in the queue per request "
        f"(p50 latency {mean[NO_DELAY]['p50_ms'] / 1000:.2f} s without the delay, "
        f"{mean[DELAY]['p50_ms'] / 1000:.2f} s with it, over {rounds} alternating rounds each)."
    )
    if every_s:
        served = [_rate(mean[s]) for s in (NO_DELAY, DELAY)]
        words += (
            f" Both paced settings answered about as many requests a second as arrived "
            f"({served[0]:.2f} and {served[1]:.2f}, at a pace of {1 / every_s:.2f}; with the "
            "delay the last batch still waits and computes after the last arrival): a delay "
            "changes what a request costs and how long it waits, not how many are answered."
        )
    rows = [_arrival_row(NO_DELAY, mean[NO_DELAY]), _arrival_row(DELAY, mean[DELAY])]
    if bigger > 0 and cheaper <= 0:
        line = [
            f"With requests arriving apart, a queue delay made batches of "
            f"{mean[DELAY]['batch']:.1f} instead of {mean[NO_DELAY]['batch']:.1f}, but the "
            f"model's time per request ({model_time}) did not fall beyond the noise: it bought "
            f"nothing here for {wait / 1000:.2f} s more waiting in the queue per request."
        ]
    elif bigger > 0:
        line = [
            f"With requests arriving apart, a queue delay made batches of "
            f"{mean[DELAY]['batch']:.1f} instead of {mean[NO_DELAY]['batch']:.1f} and cut the "
            f"model's time per request from {model_time}, room for more traffic on the same "
            f"model, at {wait / 1000:.2f} s more waiting in the queue per request (p50 latency "
            f"{mean[NO_DELAY]['p50_ms'] / 1000:.2f} s against {mean[DELAY]['p50_ms'] / 1000:.2f} s): "
            "worth it where the model's time is scarce, not where latency is."
        ]
    else:
        line = [
            f"A queue delay bought no bigger batches here ({mean[DELAY]['batch']:.1f} against "
            f"{mean[NO_DELAY]['batch']:.1f}), only {wait / 1000:.2f} s more waiting in the queue "
            "per request."
        ]
    if lone is not None:
        figures["one lone client's queue wait (ms)"] = round(float(lone["queue_ms"]))
        rows.append(_arrival_row(LONE, lone))
        words += (
            f" A lone client gains nothing from it: each of its {int(lone['requests'])} requests "
            "waited "
            f"{lone['queue_ms'] / 1000:.2f} s in the queue, the whole delay, for company that "
            f"never came, and ran in batches of {lone['batch']:.1f}."
        )
        line.append(
            "At low load it is pure cost: every request of one client waited "
            f"{lone['queue_ms'] / 1000:.2f} s in the queue, the whole delay."
        )
    return words, line, figures, rows


def _rate(row) -> float:
    """Requests answered a second, over the time :func:`measure_arrivals` counted them."""
    return float(row["requests"]) / float(row["seconds"])


def _arrival_row(measured: str, row) -> dict:
    return {
        "measured": measured,
        "requests/s": _cell(_rate(row), 2),
        "requests per execution": _cell(row["batch"], 2),
        "queue wait (ms)": _cell(row["queue_ms"]),
        "p50 latency (ms)": _cell(row["p50_ms"]),
    }
