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

#: The lab's one rule for calling a difference, in one line; each notebook explains it in markdown
#: (:func:`judge` applies it, :class:`Verdict` shows it).
NOISE_RULE = (
    f"A gain or a loss needs the median of the rounds' ratios at x{GAIN:.2f} or more, or "
    f"x{1 / GAIN:.2f} or less, and no round pointing the other way; anything else is a tie."
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


@dataclass(frozen=True)
class Verdict:
    """One comparison judged by :func:`judge`: the per-round ratios (new over old, more is
    better) of a named quantity, and what they add up to.

    A notebook shows verdicts as a table (:func:`verdict_table`) and at most one sentence each
    (:meth:`sentence`); why a gain, a tie or a loss comes out is the notebook's markdown.
    """

    comparison: str  # "two instances against one"
    ratios: tuple[float, ...]
    of: str  # the quantity: "infer/s", "output tokens/s", ...
    noise: float = 1.0  # a spread measured between things that cannot differ (>= 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(float(r) for r in self.ratios))

    @property
    def measured(self) -> tuple[float, ...]:
        """The rounds that measured both sides (a NaN or a non-positive ratio is left out)."""
        return tuple(r for r in self.ratios if r == r and r > 0)

    @property
    def median(self) -> float:
        return statistics.median(self.measured) if self.measured else math.nan

    @property
    def word(self) -> str:
        """``"gain"``, ``"tie"`` or ``"loss"``."""
        return judge(self.ratios, noise=self.noise)

    @property
    def ratio(self) -> Ratio:
        """The median as a :class:`Ratio`: what ``figures.json`` keeps."""
        return Ratio(self.median, self.of)

    def spread(self) -> str:
        """The lowest and highest round, ``"x0.97 to x1.10"`` (one round: its ratio)."""
        if not self.measured:
            return "not measured"
        low, high = min(self.measured), max(self.measured)
        return f"x{low:.2f}" if len(self.measured) == 1 else f"x{low:.2f} to x{high:.2f}"

    def sentence(self) -> str:
        """The one computed sentence a verdict gets: the outcome and its number."""
        if not self.measured:
            return f"{_capital(self.comparison)}: not measured."
        rounds = len(self.measured)
        return (
            f"{_capital(self.comparison)}: {self.word}, median {self.ratio} over {rounds} "
            f"round{'s' if rounds != 1 else ''} ({self.spread()})."
        )


def _capital(text: str) -> str:
    if text[1:2].isupper():  # a name spelled so: "vLLM in Triton", not "VLLM in Triton"
        return text
    return text[:1].upper() + text[1:]


def verdict_table(verdicts: Sequence[Verdict]) -> pd.DataFrame:
    """The verdict table every judging notebook shows: one row a comparison, with each round's
    ratio, their median, their spread and the verdict."""
    return pd.DataFrame(
        [
            {
                "comparison": v.comparison,
                "of": v.of,
                "each round": ", ".join(f"x{r:.2f}" for r in v.ratios if r == r),
                "median": round(v.median, 2) if v.measured else math.nan,
                "spread": v.spread(),
                "verdict": v.word,
            }
            for v in verdicts
        ],
        columns=["comparison", "of", "each round", "median", "spread", "verdict"],
    )


@dataclass
class Conclusion:
    """A notebook's result: the table it rests on, its verdicts, its headline figures and its
    takeaway. Why a verdict came out as it did is the notebook's markdown, not this object's."""

    table: pd.DataFrame
    figures: dict = field(default_factory=dict)
    #: At most one computed sentence per verdict (:meth:`Verdict.sentence`), else ''.
    text: str = ""
    #: One to three short lines for the notebook's end and the run's index (lessons.Takeaway).
    takeaway: tuple[str, ...] = ()
    verdicts: tuple[Verdict, ...] = ()

    def __str__(self) -> str:
        return self.text or "\n".join(v.sentence() for v in self.verdicts)

    def verdict_table(self) -> pd.DataFrame:
        """:func:`verdict_table` of this conclusion's verdicts."""
        return verdict_table(self.verdicts)

    def _repr_html_(self) -> str:
        paragraphs = "".join(f"<p>{line}</p>" for line in str(self).split("\n") if line)
        verdicts = self.verdict_table().to_html(index=False) if self.verdicts else ""
        return paragraphs + verdicts + self.table.to_html(index=False)


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
