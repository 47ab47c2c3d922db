"""The conclusions notebook 04 prints (03's are in test_lesson_batching.py): their figures come from
the measurements given, and their words follow those figures (a loss is never called a gain, a tie
never a win)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from labkit import lessons
from labkit.errors import ConfigError


def repeats(name: str, per_level: dict[int, list[float]]) -> pd.DataFrame:
    rows = [
        {"config": name, "concurrency": c, "repeat": i, "throughput": t}
        for c, runs in per_level.items()
        for i, t in enumerate(runs)
    ]
    return pd.DataFrame(rows)


def test_a_winner_beyond_the_noise_is_better_and_the_words_count_busy_cores():
    default = repeats("default", {2: [4.0, 4.2], 4: [5.5, 5.6]})
    winner = repeats("w", {2: [7.7, 7.8], 4: [9.2, 9.3]})
    conclusion = lessons.confirm_winner(default, winner, "w", instances=(1, 2), threads=1, cores=2)
    assert conclusion.figures["verdict"] == "better"
    assert conclusion.figures["noise_band"] == pytest.approx(0.049, abs=0.001)
    # one way to state the gain: a ratio with its unit, per level and overall
    assert "at concurrency 2 x1.89 infer/s" in conclusion.text
    assert "at concurrency 4 x1.67 infer/s" in conclusion.text
    assert str(conclusion.figures["winner_vs_default"]) == "x1.78 infer/s"
    assert "%" not in conclusion.text.split("noise band")[0]
    assert "can keep 1 of the 2 cores busy, the winner's 2 can keep 2" in conclusion.text
    assert "put idle cores to work" in conclusion.text
    assert "compete" not in conclusion.text


def test_a_winner_within_the_noise_is_not_called_better():
    default = repeats("default", {4: [5.0, 6.0]})
    winner = repeats("w", {4: [5.4, 6.2]})
    conclusion = lessons.confirm_winner(default, winner, "w", instances=(2, 2), threads=1, cores=2)
    assert conclusion.figures["verdict"] == "not better beyond the noise"
    assert "instances alone cannot gain here" in conclusion.text


def test_a_winner_that_trails_beyond_the_noise_is_called_slower():
    default = repeats("default", {4: [6.0, 6.1]})
    winner = repeats("w", {4: [4.0, 4.1]})
    assert lessons.confirm_winner(default, winner, "w").figures["verdict"] == "slower"


def test_one_measurement_per_configuration_gives_no_noise_band():
    with pytest.raises(ConfigError, match="two or more"):
        lessons.confirm_winner(repeats("d", {4: [5.0]}), repeats("w", {4: [6.0]}), "w")


def test_a_ratio_reads_the_same_in_words_in_figures_json_and_in_the_index(tmp_path):
    from labkit import lab
    from labkit.lessons import Ratio, figure_text

    gain = Ratio.between(36.4, 20.0, "infer/s")
    assert str(gain) == "x1.82 infer/s"
    recorded = lab.record(tmp_path, winner_vs_default=gain)
    assert recorded["winner_vs_default"] == {"ratio": 1.82, "of": "infer/s"}
    assert figure_text(recorded["winner_vs_default"]) == str(gain)
    assert figure_text(3) == "3"
    assert math.isnan(Ratio.between(1.0, 0.0, "infer/s").value)
