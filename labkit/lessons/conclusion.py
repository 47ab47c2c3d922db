"""What every lesson returns, and the one way the lab states a gain or a loss."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from labkit.errors import ConfigError

#: The ratio a difference must pass, either way, before any lesson calls it a gain or a loss.
GAIN = 1.2

#: The lab's one rule for calling a difference, said the same way in every notebook that judges
#: one (:func:`judge` applies it).
NOISE_RULE = (
    "How the lab calls a difference, in every notebook: the two sides are measured in turns "
    "(A B A B ...), so that a host slowing down weighs on both, and each round gives one ratio. "
    "A difference counts as a gain or a loss only when the median of those ratios is "
    f"x{GAIN:.2f} or more, or x{1 / GAIN:.2f} or less, and no round points the other way; "
    "anything else is a tie, within the noise. Where two sides were measured once each instead "
    "(03's two sweeps, 04's search), the ratio must also pass the spread that same measurement "
    "showed between two things that cannot differ. This host's speed drifts by up to 2x within "
    "minutes, and differences under 20% come and go between runs."
)


@dataclass(frozen=True)
class Ratio:
    """One way to state a gain or a loss: the new figure over the old, of a named quantity.

    ``str(Ratio(1.82, "infer/s"))`` is ``"x1.82 infer/s"``: that text, and only that, appears
    in a notebook's words, its ``figures.json`` (as ``{"ratio": 1.82, "of": "infer/s"}``, through
    :func:`labkit.lab.record`) and the run's ``index.html``.
    """

    value: float
    of: str  # the quantity: "infer/s", "output tokens/s", "p99 latency", ...

    def __str__(self) -> str:
        return f"x{self.value:.2f} {self.of}"

    def as_figure(self) -> dict:
        """The JSON form ``figures.json`` keeps."""
        return {"ratio": round(float(self.value), 2), "of": self.of}

    @staticmethod
    def between(new: float, old: float, of: str) -> Ratio:
        """``new / old`` (NaN when ``old`` is 0 or missing)."""
        return Ratio(new / old if old else math.nan, of)


def figure_text(value: object) -> str:
    """How a recorded figure reads: a ratio as ``x1.82 infer/s``, a float to three significant
    digits, anything else as itself."""
    if isinstance(value, dict) and set(value) == {"ratio", "of"}:
        return str(Ratio(value["ratio"], value["of"]))
    if isinstance(value, float) and abs(value) >= 1000:  # whole units: 1474, not 1.47e+03
        return f"{value:.0f}"
    if isinstance(value, float):  # three significant digits: 0.0835, 14.4, 3.58e-06
        return f"{value:.3g}"
    return str(value)


@dataclass
class Conclusion:
    """A notebook's result: the table it rests on, its headline figures, and the words."""

    table: pd.DataFrame
    figures: dict = field(default_factory=dict)
    text: str = ""
    #: One to three short lines for the notebook's end and the run's index (lessons.Takeaway).
    takeaway: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        paragraphs = "".join(f"<p>{line}</p>" for line in self.text.split("\n") if line)
        return paragraphs + self.table.to_html(index=False)


def judge(ratios: Sequence[float], *, noise: float = 1.0) -> str:
    """``"gain"``, ``"tie"`` or ``"loss"`` of per-round ratios (new over old, more is better),
    by :data:`NOISE_RULE`: the median beyond ``max(GAIN, noise)`` either way, and no round on
    the other side of 1. ``noise`` (>= 1) is a spread the same run measured between things that
    cannot differ; a side that was not measured in a round (NaN) is left out."""
    measured = [float(r) for r in ratios if r == r and r > 0]
    if not measured:
        return "tie"
    bar = max(GAIN, noise, 1 / noise if noise > 0 else math.inf)
    # compared as the learner reads them, to two decimals: a median shown as x1.20 is not a tie
    middle = round(statistics.median(measured), 2)
    if middle >= round(bar, 2) and min(measured) > 1:
        return "gain"
    if middle <= round(1 / bar, 2) and max(measured) < 1:
        return "loss"
    return "tie"


def noise_band(runs: list[float]) -> float:
    """The spread of repeated measurements as a fraction of their mean: (max - min) / mean."""
    if len(runs) < 2:
        raise ConfigError(f"a noise band needs two or more repeated measurements, got {len(runs)}")
    mean = sum(runs) / len(runs)
    return (max(runs) - min(runs)) / mean if mean else math.inf


def unsettled(sweeps: dict[str, pd.DataFrame | None]) -> str:
    """The sentence naming every perf_analyzer measurement that did not settle within its
    stability rule (``{label: sweep}``, a sweep's ``stable`` column), or '' when all did."""
    names = [
        f"{label} at {int(r.concurrency)}"
        for label, frame in sweeps.items()
        if frame is not None and "stable" in frame
        for r in frame.itertuples()
        if not r.stable
    ]
    if not names:
        return ""
    return (
        "Not every measurement settled, perf_analyzer's last three windows agreeing within "
        "its stability percentage ("
        + ", ".join(names)
        + "): those figures carry more noise than the others."
    )
