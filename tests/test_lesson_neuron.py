"""Notebook 05's verdicts, figures and takeaway from constructed results."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import lessons
from labkit.errors import ConfigError
from labkit.lessons.neuron import DIFFERENCE, measurements_table
from labkit.lessons.takeaway import sentence_count

CHECKS = ["tp 1 divides 2 cores", "config parses"]


def comparison(worst: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"model": "add_sub", "output": "a + b", DIFFERENCE: 0.0},
            {"model": "minilm", "output": "sentence embedding", DIFFERENCE: worst},
        ]
    )


def perf(low: list[float], high: list[float], batch: float = 2.5) -> pd.DataFrame:
    """Rounds of a sweep at concurrency 1 and 4: ``low[i]`` and ``high[i]`` are round i+1's."""
    rows = []
    for number, (a, b) in enumerate(zip(low, high, strict=True), 1):
        rows.append({"concurrency": 1, "throughput": a, "p50_ms": 1.0, "p99_ms": 2.0,
                     "avg_batch_size": 1.0, "round": number})  # fmt: skip
        rows.append({"concurrency": 4, "throughput": b, "p50_ms": 2.0, "p99_ms": 4.0 + number,
                     "avg_batch_size": batch, "round": number})  # fmt: skip
    return pd.DataFrame(rows)


def test_a_gain_in_every_round_is_a_gain_with_its_figures_and_takeaway():
    c = lessons.neuron_conclusion("cpu", comparison(2e-6), perf([100, 110], [250, 260]), CHECKS)
    infer, calls = c.verdicts
    assert (infer.word, infer.of, infer.ratios) == ("gain", "infer/s", (2.5, 260 / 110))
    # calls a second: requests a second over requests per call (250 / 2.5 against 100 / 1)
    assert (calls.of, calls.ratios) == ("calls a second", (1.0, 104 / 110)) and calls.word == "tie"
    assert list(c.verdict_table()["verdict"]) == ["gain", "tie"]
    assert c.figures["throughput_with_4_clients_against_1_median_of_rounds"] == lessons.Ratio(
        infer.median, "infer/s"
    )
    assert c.figures["throughput_infer_s_c1"] == 105 and c.figures["throughput_infer_s_c4"] == 255
    assert c.figures["largest_difference_from_PyTorch"] == 2e-6 and len(c.figures) == 6
    assert str(c).splitlines()[0].startswith("4 clients in flight against 1: gain, median x2.43")
    assert "2.0e-06" in c.takeaway[0] and "CPU" in c.takeaway[0]
    assert c.takeaway[1] == (
        "4 clients in flight against 1: gain, x2.43 infer/s, 2.50 requests per call against 1.00."
    )
    assert c.takeaway[2].startswith("2 checks") and sentence_count(c.takeaway) == 3


def test_the_run_s_own_figures_give_more_calls_a_second_as_well_as_bigger_calls():
    # 1463 infer/s at 1 client, 3764 at 4 with 1.99 requests per call: x1.29 calls a second
    c = lessons.neuron_conclusion(
        "cpu", comparison(2e-6), perf([1461, 1465], [3792, 3736], batch=1.99), CHECKS
    )
    assert [(v.word, round(v.median, 2)) for v in c.verdicts] == [("gain", 2.57), ("gain", 1.29)]


def test_a_round_the_other_way_is_a_tie_even_past_the_gain_threshold():
    # round by round: x2.80, then x0.97 (the host slowed between the two levels of round 1)
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf([100, 300], [280, 290]), CHECKS)
    assert c.verdicts[0].median > lessons.GAIN and c.verdicts[0].word == "tie"
    assert ": tie, x" in c.takeaway[1]


@pytest.mark.parametrize(
    ("low", "high", "word"),
    [
        ([100], [110], "tie"),
        ([100], [119], "tie"),
        ([100], [120], "gain"),
        ([100, 98], [60, 61], "loss"),
    ],
)
def test_the_verdict_on_requests_a_second_at_its_edges(low, high, word):
    assert (
        lessons.neuron_conclusion("cpu", comparison(0.0), perf(low, high), CHECKS).verdicts[0].word
        == word
    )


def test_without_requests_per_call_only_requests_a_second_is_judged():
    sweep = perf([100], [250]).drop(columns=["avg_batch_size", "round"])
    c = lessons.neuron_conclusion("cpu", comparison(0.0), sweep, CHECKS)
    assert [v.of for v in c.verdicts] == ["infer/s"] and "per call" not in c.takeaway[1]
    assert c.table["requests per call"].tolist() == ["", ""]


def test_on_a_neuron_target_the_takeaway_names_the_neuroncores_and_exact_answers():
    c = lessons.neuron_conclusion("inf2", comparison(0.0), perf([100], [300]), CHECKS)
    assert "inf2 NeuronCores" in c.takeaway[0] and "CPU" not in " ".join(c.takeaway)
    assert "same numbers" in c.takeaway[0] and c.figures["compile_target"] == "inf2"


def test_answers_off_by_more_than_the_tolerance_show_their_difference():
    c = lessons.neuron_conclusion("cpu", comparison(0.5), perf([100], [300]), CHECKS)
    assert "5.0e-01" in c.takeaway[0]
    assert c.figures["largest_difference_from_PyTorch"] == 0.5


def test_the_table_gives_each_level_its_rounds_in_words():
    table = measurements_table(perf([100, 110], [250, 260]))
    assert list(table.columns) == [
        "clients in flight", "infer/s, round 1", "infer/s, round 2",
        "p99 latency (ms), worst round", "requests per call",
    ]  # fmt: skip
    assert table.iloc[1].tolist() == [4, "250", "260", "6.0", "2.50"]


def test_an_empty_sweep_is_refused():
    with pytest.raises(ConfigError, match="needs the comparison table and a perf sweep"):
        lessons.neuron_conclusion("cpu", comparison(0.0), perf([1], [1]).iloc[0:0], CHECKS)
