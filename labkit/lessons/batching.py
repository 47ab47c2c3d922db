"""Notebook 03's lesson: dynamic batching off against on, beside the tutorial's figures."""

from __future__ import annotations

import math

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import GAIN, Conclusion

#: The tutorial's perf_analyzer figures: falcon-7b on an Intel i9 with an NVIDIA A6000.
TUTORIAL_HARDWARE = "falcon-7b on an NVIDIA A6000"
TUTORIAL_OFF = {1: 21.3841}  # infer/s, batching off
TUTORIAL_ON = {4: 31.8264, 8: 46.2105, 16: 53.6549}  # infer/s, dynamic_batching {}, max 8


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
