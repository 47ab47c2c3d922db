"""Notebook 05's figures: the add_sub sweep as a table, the verdict on more clients in flight,
and a takeaway made of them. Why each outcome comes out is the notebook's markdown."""

from __future__ import annotations

import math

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Verdict

#: Largest difference from in-process PyTorch that still counts as the same answer.
TOLERANCE = 1e-3
#: :func:`labkit.neuron.walkthrough.compare`'s column of differences (its ``DIFFERENCE``).
DIFFERENCE = "largest difference from PyTorch"


def _sweep(perf: pd.DataFrame) -> pd.DataFrame:
    """The sweep with a round (1 if it ran once), requests per call (NaN where not measured)
    and calls of the model a second (requests a second over requests per call)."""
    sweep = perf.assign(
        avg_batch_size=perf.get("avg_batch_size", math.nan), round=perf.get("round", 1)
    )
    batch = sweep["avg_batch_size"]
    return sweep.assign(calls=sweep["throughput"] / batch.where(batch > 0))


def measurements_table(perf: pd.DataFrame) -> pd.DataFrame:
    """One row per concurrency level: its infer/s in each round, its worst p99 and the requests
    the batcher put in each call, as text at the precision that matters."""
    by = _sweep(perf).groupby("concurrency")
    table = by["throughput"].apply(list).apply(lambda runs: [f"{v:.0f}" for v in runs])
    rows = pd.DataFrame(table.tolist(), index=table.index)
    rows.columns = [f"infer/s, round {n}" for n in range(1, rows.shape[1] + 1)]
    rows["p99 latency (ms), worst round"] = by["p99_ms"].max().map("{:.1f}".format)
    rows["requests per call"] = by["avg_batch_size"].mean().map("{:.2f}".format).replace("nan", "")
    return rows.rename_axis("clients in flight").reset_index()


def neuron_conclusion(
    target: str, comparison: pd.DataFrame, perf: pd.DataFrame, checks: list[str]
) -> Conclusion:
    """Notebook 05's verdicts and figures: the most and the fewest clients in flight compared
    round by round, in requests a second and in calls of the model a second (requests over
    requests per call); the largest difference from PyTorch; the device checks made offline."""
    if perf.empty or comparison.empty:
        raise ConfigError("neuron_conclusion needs the comparison table and a perf sweep")
    worst = float(comparison[DIFFERENCE].max())
    sweep = _sweep(perf)
    low, high = int(sweep["concurrency"].min()), int(sweep["concurrency"].max())
    at = {n: sweep[sweep["concurrency"] == n].set_index("round") for n in (low, high)}
    against = f"{high} clients in flight against {low}"
    ratios = {
        of: (at[high][c] / at[low][c]).dropna()
        for c, of in (("throughput", "infer/s"), ("calls", "calls a second"))
    }
    # calls a second only where the server reported requests per call
    verdicts = tuple(Verdict(against, r, of) for of, r in ratios.items() if len(r))
    infer = {n: float(at[n]["throughput"].mean()) for n in (low, high)}
    batch = {n: float(at[n]["avg_batch_size"].mean()) for n in (low, high)}
    figures = {
        "compile_target": target,
        "largest_difference_from_PyTorch": worst,
        f"throughput_infer_s_c{low}": infer[low],
        f"throughput_infer_s_c{high}": infer[high],
        # the verdict's median of the rounds' ratios, not the ratio of the means above
        f"throughput_with_{high}_clients_against_{low}_median_of_rounds": verdicts[0].ratio,
        "device_checks_validated_offline": len(checks),
    }
    where = "this host's CPU" if target == "cpu" else f"{target} NeuronCores"
    gave = "the same numbers as" if worst == 0 else f"numbers up to {worst:.1e} from"
    calls = (
        ""
        if math.isnan(batch[high])
        else f", {batch[high]:.2f} requests per call against {batch[low]:.2f}"
    )
    takeaway = (
        f"Served on {where}, both models gave {gave} in-process PyTorch ({TOLERANCE:g} allowed).",
        f"{against}: {verdicts[0].word}, {verdicts[0].ratio}{calls}.",
        f"{len(checks)} checks of the vLLM model for inf2 passed without a device; serving it "
        "takes an inf2 or trn1 host.",
    )
    return Conclusion(measurements_table(perf), figures, "", takeaway, verdicts)
