"""Notebook 05's lesson: what ran here, what it showed, and what waits for a Neuron device."""

from __future__ import annotations

import math

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import GAIN, Conclusion, Ratio, judge

#: Largest difference from in-process PyTorch that still counts as the same answer.
TOLERANCE = 1e-3
#: :func:`labkit.neuron.walkthrough.compare`'s column of differences (its ``DIFFERENCE``).
DIFFERENCE = "largest difference from PyTorch"
#: Above this many requests per call on average, the batcher visibly joined requests.
JOINED = 1.1
#: Calls a second that changed by this factor or more (either way) are said to have changed.
CALLS_CHANGED = 1.05


def _runs(perf: pd.DataFrame, level: int) -> list[float]:
    return [float(v) for v in perf.loc[perf["concurrency"] == level, "throughput"]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _batch(perf: pd.DataFrame, level: int) -> float:
    """The average requests per call of the model at ``level`` (NaN when not measured)."""
    if "avg_batch_size" not in perf:
        return math.nan
    sizes = perf.loc[perf["concurrency"] == level, "avg_batch_size"].dropna()
    return float(sizes.mean()) if len(sizes) else math.nan


def _calls(low_mean: float, batch_low: float, high_mean: float, batch_high: float) -> float | None:
    """How many times as many calls of the model a second ran at the highest level as at the
    lowest: requests a second over requests per call (None when a batch was not measured)."""
    if any(math.isnan(b) or b <= 0 for b in (batch_low, batch_high)):
        return None
    return (high_mean / batch_high) / (low_mean / batch_low)


def _calls_words(
    gain: float, batch_low: float, batch_high: float, calls: float, low_mean: float
) -> str:
    """The gain in requests a second split into requests per call times calls a second."""
    if calls >= CALLS_CHANGED:
        how = (
            "with a request always waiting, the calls also follow each other without the idle "
            "round trip between them"
        )
    elif calls <= 1 / CALLS_CHANGED:
        how = f"a call of {batch_high:.2f} requests takes longer than a call of one"
    else:
        how = "the calls ran about as often as with one client, each answering more"
    calls_low = low_mean / batch_low
    return (
        f"The x{gain:.2f} in requests a second is x{batch_high / batch_low:.2f} in requests per "
        f"call times x{calls:.2f} in calls a second ({calls_low * calls:.0f} against "
        f"{calls_low:.0f}): {how}."
    )


def measurements_table(perf: pd.DataFrame) -> pd.DataFrame:
    """The add_sub sweep in a learner's words: one row per concurrency level, its throughput in
    each round, its worst p99 and the requests the batcher put in each call, as text at the
    precision that matters (a table shows them as they are written)."""
    rounds = sorted(perf["round"].unique()) if "round" in perf else [None]
    rows = []
    for level in sorted(perf["concurrency"].unique()):
        at = perf[perf["concurrency"] == level]
        row = {"clients in flight": int(level)}
        for number in rounds:
            sweep = at if number is None else at[at["round"] == number]
            title = "infer/s" if number is None else f"infer/s, round {number}"
            row[title] = f"{float(sweep['throughput'].mean()):.0f}"
        row["p99 latency (ms), worst round"] = f"{float(at['p99_ms'].max()):.1f}"
        batch = _batch(perf, level)
        row["requests per call"] = "" if math.isnan(batch) else f"{batch:.2f}"
        rows.append(row)
    return pd.DataFrame(rows)


def neuron_conclusion(
    target: str,
    comparison: pd.DataFrame,
    perf: pd.DataFrame,
    checks: list[str],
) -> Conclusion:
    """Notebook 05's result from what it measured and validated.

    ``target`` is the compile target the notebook used (``cpu`` is the stand-in for Neuron);
    ``comparison`` is :func:`labkit.neuron.walkthrough.compare`'s table, ``perf`` the add_sub
    perf_analyzer sweep (one or more rounds, a ``round`` column), ``checks`` the offline
    validations of the configs made for the device. Throughput from the lowest to the highest
    concurrency is a :class:`Ratio` of the rounds' means; the verdict is the lab's one rule
    (:func:`~labkit.lessons.conclusion.judge`) on each round's ratio, else within the noise.
    """
    if perf.empty or comparison.empty:
        raise ConfigError("neuron_conclusion needs the comparison table and a perf sweep")
    worst = float(comparison[DIFFERENCE].max())
    same = worst < TOLERANCE
    levels = sorted(int(c) for c in perf["concurrency"].unique())
    low, high = levels[0], levels[-1]
    low_runs, high_runs = _runs(perf, low), _runs(perf, high)
    low_mean, high_mean = _mean(low_runs), _mean(high_runs)
    scaling = Ratio.between(high_mean, low_mean, "infer/s")
    rounds = min(len(low_runs), len(high_runs))
    every = f"in each of {rounds} rounds" if rounds > 1 else "in one round"
    mean_of = " on average" if rounds > 1 else ""
    # each round measures both levels, one after the other: the lab's one rule on their ratios
    paired = [h / lo for lo, h in zip(low_runs, high_runs, strict=False) if lo]
    verdict = {"gain": "gain", "loss": "loss", "tie": "noise"}[judge(paired)]
    batch_low, batch_high = _batch(perf, low), _batch(perf, high)
    joined = not math.isnan(batch_high) and batch_high > JOINED
    on_device = target != "cpu"
    where = f"on {target} NeuronCores" if on_device else "on this host's CPU, the stand-in target"

    bit_exact = worst == 0 and not on_device  # the CPU stand-in's trace: the same operations
    exact = (
        "none at all: on the CPU stand-in the compiled model is a trace of the same operations "
        "on the same processor, so this checks the serving (inputs, outputs, batching) more "
        "than the compiler; on NeuronCores the compiler changes the arithmetic and float "
        "rounding shows"
        if bit_exact
        else f"{worst:.1e}, float rounding"
    )
    answers = (
        f"Served by Triton {where}, both models answer as in-process PyTorch does: the largest "
        f"difference is {exact} (the limit is {TOLERANCE:g})."
        if same
        else f"Served by Triton {where}, the answers differ from in-process PyTorch by up to "
        f"{worst:.1e}, over the {TOLERANCE:g} allowed: the compiled model does not compute what "
        "the eager one does."
    )
    figures_said = (
        f"add_sub served {high_mean:.0f} infer/s with {high} clients in flight against "
        f"{low_mean:.0f} with {low} ({scaling})"
    )
    if verdict == "gain":
        result = f"{figures_said}: more clients served more, {every}."
    elif verdict == "loss":
        result = f"{figures_said}: more clients served less, {every}; they only queued."
    else:
        result = (
            f"{figures_said}: within the noise, by the lab's rule (the median of the rounds' "
            f"ratios under x{GAIN:.2f}, or a round the other way)."
        )
    calls = _calls(low_mean, batch_low, high_mean, batch_high)
    if joined:
        why = (
            f"Why: one client sends its next request only after its answer is back, so the "
            f"model idles during every round trip; with {high}, requests wait in Triton's queue "
            f"and the dynamic batcher joins them, {batch_high:.2f} to a call on average (against "
            f"{batch_low:.2f} with {low}), and one call of the model answers them all."
        )
        if calls is not None:
            why += " " + _calls_words(scaling.value, batch_low, batch_high, calls, low_mean)
    else:
        why = (
            f"Why: add_sub's arithmetic takes microseconds, so a request's time is the trip "
            f"through HTTP, Triton and the Python stub; with {high} clients those trips overlap, "
            "even where the batcher seldom joins requests."
        )
    lines = [answers, result, why]
    if not on_device:
        lines.append(
            "These are CPU figures, not Inferentia's: on inf2 the compiled graph runs on "
            "NeuronCores, where a call costs its own time; the folders made for inf2 here are "
            "timed on an inf2 host."
        )
    lines.append(
        f"Written and validated here for the device, not run: {len(checks)} checks of the vLLM "
        "model for inf2, its engine arguments and its setup plan."
    )
    figures = {
        "compile_target": target,
        "largest_difference_from_PyTorch": worst,
        # unrounded: labkit.lab.record rounds them once, as the takeaway's words do
        f"throughput_infer_s_c{low}": low_mean,
        f"throughput_infer_s_c{high}": high_mean,
        f"throughput_with_{high}_clients_against_{low}": scaling,
        "device_checks_validated_offline": len(checks),
    }
    said = {
        "gain": f"{scaling} ({high_mean:.0f} against {low_mean:.0f}{mean_of}, more {every})",
        "loss": f"{scaling}, a loss ({high_mean:.0f} against {low_mean:.0f}{mean_of}, less "
        f"{every})",
        "noise": f"{scaling}, within the noise ({high_mean:.0f} against {low_mean:.0f})",
    }[verdict]
    because = ""
    if joined and verdict == "gain":
        because = f", as Triton batched their requests ({batch_high:.2f} a call)"
        if calls is not None and calls >= CALLS_CHANGED:
            because += f" and ran x{calls:.2f} as many calls a second, back to back"
    cpu = "" if on_device else "; a CPU figure, not Inferentia's"
    takeaway = (
        ("Compiled and served by Triton, both models answered as in-process PyTorch does"
         if same else "Compiled and served by Triton, the answers differ from PyTorch's")
        + (
            " to the last bit, on the CPU stand-in of the compiler."
            if bit_exact
            else f" (largest difference {worst:.1e})."
        ),
        f"{high} clients in flight against {low} gave {said}{because}{cpu}.",
        "The inf2 folders, the NeuronCore split and the vLLM model for inf2 were written and "
        "checked here; compiling and timing them takes an inf2 host.",
    )  # fmt: skip
    return Conclusion(measurements_table(perf), figures, "\n".join(lines), takeaway)
