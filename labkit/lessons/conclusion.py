"""What every lesson returns, and the one way the lab states a gain or a loss."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from labkit.errors import ConfigError

#: The throughput ratio below which a conclusion does not call a change a gain.
GAIN = 1.2


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
        "Not every measurement settled within the stability rule ("
        + ", ".join(names)
        + "): those figures carry more noise than the others."
    )
