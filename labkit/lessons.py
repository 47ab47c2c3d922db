"""The conclusions the lab's measurements support, stated next to the tutorial's own figures.

Each function takes what a notebook measured and returns a :class:`Conclusion`: a table, the
headline figures (for :func:`labkit.lab.record`) and the sentences a learner reads. A difference
within the measured noise is called so, never a win.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pandas as pd

from labkit.errors import ConfigError

#: The tutorial's perf_analyzer figures: falcon-7b on an Intel i9 with an NVIDIA A6000.
TUTORIAL_HARDWARE = "falcon-7b on an NVIDIA A6000"
TUTORIAL_OFF = {1: 21.3841}  # infer/s, batching off
TUTORIAL_ON = {4: 31.8264, 8: 46.2105, 16: 53.6549}  # infer/s, dynamic_batching {}, max 8
#: The tutorial's Model Analyzer summary: best config and the default, infer/s.
TUTORIAL_ANALYZER = {"winner": "3 instances, max batch 16", "winner_infer_s": 71.944}
TUTORIAL_ANALYZER_DEFAULT = 63.9384
#: The throughput ratio below which a conclusion does not call batching a gain.
GAIN = 1.2


@dataclass
class Conclusion:
    """A notebook's result: the table it rests on, its headline figures, and the words."""

    table: pd.DataFrame
    figures: dict = field(default_factory=dict)
    text: str = ""

    def __str__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        paragraphs = "".join(f"<p>{line}</p>" for line in self.text.split("\n") if line)
        return paragraphs + self.table.to_html(index=False)


def _at(frame: pd.DataFrame, concurrency: int, column: str) -> float:
    rows = frame[frame["concurrency"] == concurrency]
    return float(rows.iloc[0][column]) if len(rows) else math.nan


def batching_conclusion(
    off: pd.DataFrame, on: pd.DataFrame, delayed: pd.DataFrame | None = None
) -> Conclusion:
    """Batching off against on (and against on with a queue delay), level by level.

    ``off``/``on``/``delayed`` are :func:`labkit.profiling.perf_analyzer` sweeps. The headline
    figures are taken at the highest concurrency both sweeps measured (8 by default).
    """
    levels = sorted(set(off["concurrency"]) & set(on["concurrency"]))
    if not levels:
        raise ConfigError(
            "the two sweeps share no concurrency level; measure both at the same ones"
        )
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
        row["tutorial infer/s"] = TUTORIAL_ON.get(c, TUTORIAL_OFF.get(c, math.nan))
        rows.append(row)
    table = pd.DataFrame(rows).round(2)
    c = levels[-1]
    ratio = _at(on, c, "throughput") / _at(off, c, "throughput")
    p99_ratio = _at(on, c, "p99_ms") / _at(off, c, "p99_ms")
    batch = _at(on, c, "avg_batch_size")
    figures = {
        f"throughput_ratio_c{c}": round(ratio, 2),
        f"p99_ratio_c{c}": round(p99_ratio, 2),
        f"avg_batch_size_c{c}": round(batch, 2),
    }
    tutorial = TUTORIAL_ON.get(c)
    lines = [
        f"At concurrency {c}, dynamic batching served {_at(on, c, 'throughput'):.2f} infer/s "
        f"against {_at(off, c, 'throughput'):.2f} without it: x{ratio:.2f}. Its p99 latency went "
        f"from {_at(off, c, 'p99_ms'):.0f} ms to {_at(on, c, 'p99_ms'):.0f} ms (x{p99_ratio:.2f}), "
        f"and Triton executed {batch:.1f} requests per call on average.",
    ]
    if tutorial:
        same = (
            "The lesson is the same here: a batch of prompts costs little more than one, so "
            "serving them together multiplies throughput."
            if ratio >= GAIN
            else f"Here batching gained x{ratio:.2f} only: on this machine a batch cost nearly "
            "as much as its requests one by one, or the measurement was noisy (see below)."
        )
        lines.append(
            f"The tutorial ({TUTORIAL_HARDWARE}) measured {TUTORIAL_OFF[1]:.1f} infer/s at "
            f"concurrency 1 without batching and {tutorial:.1f} with it at concurrency {c} "
            f"(x{tutorial / TUTORIAL_OFF[1]:.2f}); at 16, {TUTORIAL_ON[16]:.1f}: its "
            f'"nearly triple". {same}'
        )
    if delayed is not None and c in set(delayed["concurrency"]):
        d_ratio = _at(delayed, c, "throughput") / _at(off, c, "throughput")
        figures[f"delayed_throughput_ratio_c{c}"] = round(d_ratio, 2)
        figures[f"delayed_avg_batch_size_c{c}"] = round(_at(delayed, c, "avg_batch_size"), 2)
        lines.append(
            f"With a queue delay about one execution long, batches grew to "
            f"{_at(delayed, c, 'avg_batch_size'):.1f} requests and throughput to x{d_ratio:.2f}: "
            "without a delay, a request that arrives just after a batch started waits for the "
            "next one, and the clients settle into smaller groups that take turns."
        )
    unstable = [
        f"{label} at {int(r.concurrency)}"
        for label, frame in (("off", off), ("on", on), ("delayed", delayed))
        if frame is not None and "stable" in frame
        for r in frame.itertuples()
        if not r.stable
    ]
    if unstable:
        lines.append(
            "Not every measurement settled within the stability rule ("
            + ", ".join(unstable)
            + "): those figures carry more noise than the others."
        )
    return Conclusion(table, figures, "\n".join(lines))


def noise_band(runs: list[float]) -> float:
    """The spread of repeated measurements as a fraction of their mean: (max - min) / mean."""
    if len(runs) < 2:
        raise ConfigError(f"a noise band needs two or more repeated measurements, got {len(runs)}")
    mean = sum(runs) / len(runs)
    return (max(runs) - min(runs)) / mean if mean else math.inf


def confirm_winner(
    default: pd.DataFrame,
    winner: pd.DataFrame,
    name: str,
    *,
    instances: tuple[int, int] | None = None,
    threads: int | None = None,
    cores: int | None = None,
) -> Conclusion:
    """Is the search's winner better than the default, beyond the noise?

    ``default`` and ``winner`` hold repeated perf_analyzer measurements (a ``repeat`` column)
    at one or more concurrencies. The noise band at a level is the larger spread of the two
    configurations' repeats; the winner is called better only where its mean throughput beats
    the default's by more than that band, and slower only where it trails by more.
    ``instances`` (the default's and the winner's instance counts), ``threads`` (torch threads
    per instance) and ``cores`` (this machine's, by default) let the words say how many cores
    each configuration kept busy: on a CPU, that is what extra instances change.
    """
    rows = []
    for c in sorted(set(default["concurrency"]) & set(winner["concurrency"])):
        base = default[default["concurrency"] == c]["throughput"].tolist()
        best = winner[winner["concurrency"] == c]["throughput"].tolist()
        band = max(noise_band(base), noise_band(best))
        change = (sum(best) / len(best)) / (sum(base) / len(base)) - 1
        verdict = "better" if change > band else "slower" if change < -band else "within the noise"
        rows.append(
            {
                "concurrency": c,
                "default infer/s": sum(base) / len(base),
                f"{name} infer/s": sum(best) / len(best),
                "change": change,
                "noise band": band,
                "verdict": verdict,
            }
        )
    if not rows:
        raise ConfigError("the default and the winner share no concurrency level")
    table = pd.DataFrame(rows).round(3)
    overall = (
        "better"
        if all(v == "better" for v in table["verdict"])
        else "slower"
        if any(v == "slower" for v in table["verdict"])
        else "not better beyond the noise"
    )
    figures = {
        "winner": name,
        "winner_vs_default_throughput": round(1 + float(table["change"].mean()), 3),
        "noise_band": round(float(table["noise band"].max()), 3),
        "verdict": overall,
    }
    per_level = "; ".join(
        f"at concurrency {int(r['concurrency'])} {r['change']:+.1%} (noise band "
        f"{r['noise band']:.1%}): {r['verdict']}"
        for r in rows
    )
    text = (
        f"Measured again after warm-up, {name} against the default: {per_level}. So the winner "
        f"is {overall}. The tutorial's search on an A6000 found "
        f"{TUTORIAL_ANALYZER['winner']} at {TUTORIAL_ANALYZER['winner_infer_s']:.1f} infer/s "
        f"against {TUTORIAL_ANALYZER_DEFAULT:.1f} for its default (+"
        f"{TUTORIAL_ANALYZER['winner_infer_s'] / TUTORIAL_ANALYZER_DEFAULT - 1:.0%}). "
        + _cores_used(instances, threads, cores or os.cpu_count() or 1)
    )
    return Conclusion(table, figures, text)


def _cores_used(instances: tuple[int, int] | None, threads: int | None, cores: int) -> str:
    """What instance counts mean on a CPU: how many cores each configuration can keep busy."""
    if not instances or not threads:
        return (
            "On a CPU, an extra instance gains only by putting cores to work that the others "
            "left idle; where every core is already busy, instances compete for them."
        )
    (d, w), t = instances, threads
    used_d, used_w = min(d * t, cores), min(w * t, cores)
    said = (
        f"Here each instance runs {t} torch thread(s): the default's {d} instance(s) can keep "
        f"{used_d} of the {cores} cores busy, the winner's {w} can keep {used_w}."
    )
    if used_w > used_d:
        return f"{said} Its extra instances put idle cores to work, which a GPU does not need."
    if used_w < used_d:
        return f"{said} It keeps fewer cores busy, so whatever it gains comes from batching."
    return f"{said} Both keep the same cores busy: instances alone cannot gain here."
