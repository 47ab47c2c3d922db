"""Notebook 05's conclusion: its words follow the figures given (constructed results)."""

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


def test_a_gain_in_every_round_is_a_gain_explained_by_the_batches_and_called_cpu_figures():
    c = lessons.neuron_conclusion("cpu", comparison(2e-6), perf([100, 110], [250, 260]), CHECKS)
    assert "add_sub served 255 infer/s with 4 clients in flight against 105 with 1" in c.text
    assert "(x2.43 infer/s): more clients served more, in each of 2 rounds." in c.text
    assert (
        "the dynamic batcher joins them, 2.50 to a call on average (against 1.00 with 1)" in c.text
    )
    # x2.43 = x2.50 per call times x0.97 calls a second (255 / 2.5 = 102 against 105)
    assert "x2.43 in requests a second is x2.50 in requests per call times x0.97" in c.text
    assert (
        "(102 against 105): the calls ran about as often as with one client, each answering more"
        in c.text
    )
    assert "These are CPU figures, not Inferentia's" in c.text
    assert "both models answer as in-process PyTorch does" in c.text
    assert "the largest difference is 2.0e-06, float rounding (the limit is 0.001)" in c.text
    exact = lessons.neuron_conclusion("cpu", comparison(0.0), perf([100, 110], [250, 260]), CHECKS)
    assert "the largest difference is none at all: on the CPU stand-in the compiled model" in (
        exact.text
    )
    assert "checks the serving (inputs, outputs, batching) more than the compiler" in exact.text
    assert exact.takeaway[0].endswith(
        "PyTorch does to the last bit, on the CPU stand-in of the compiler."
    )
    assert c.takeaway[0].endswith("(largest difference 2.0e-06).")
    assert c.figures["throughput_with_4_clients_against_1"] == lessons.Ratio(255 / 105, "infer/s")
    assert c.figures["throughput_infer_s_c1"] == 105 and len(c.figures) <= 6
    assert c.takeaway[1] == (
        "4 clients in flight against 1 gave x2.43 infer/s (255 against 105 on average, more in "
        "each of 2 rounds), as Triton batched their requests (2.50 a call); a CPU figure, not Inferentia's."
    )
    assert sentence_count(c.takeaway) == 3


def test_a_gain_beyond_the_batch_is_said_to_come_from_calls_back_to_back():
    # the run's figures: 1463 infer/s at 1 client, 3764 at 4 with 1.99 requests per call
    c = lessons.neuron_conclusion(
        "cpu", comparison(2e-6), perf([1461, 1465], [3792, 3736], batch=1.99), CHECKS
    )
    assert "joins them, 1.99 to a call on average (against 1.00 with 1)" in c.text
    assert (
        "The x2.57 in requests a second is x1.99 in requests per call times x1.29 in calls a "
        "second (1891 against 1463): with a request always waiting" in c.text
    )
    assert c.takeaway[1] == (
        "4 clients in flight against 1 gave x2.57 infer/s (3764 against 1463 on average, more in "
        "each of 2 rounds), as Triton batched their requests (1.99 a call) and ran x1.29 as many calls a "
        "second, back to back; a CPU figure, not Inferentia's."
    )
    assert sentence_count(c.takeaway) == 3


def test_a_round_the_other_way_is_within_the_noise_even_past_the_gain_threshold():
    # round by round: x2.80, then x0.97 (the host slowed between the two levels of round 1)
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf([100, 300], [280, 290]), CHECKS)
    assert c.figures["throughput_with_4_clients_against_1"].value > lessons.GAIN
    assert "within the noise, by the lab's rule" in c.text
    assert "more clients served more" not in c.text and "within the noise" in c.takeaway[1]


def test_a_tie_is_within_the_noise_not_a_gain():
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf([100], [110]), CHECKS)
    assert "(x1.10 infer/s): within the noise" in c.text
    assert "served more" not in c.text and "served less" not in c.text


def test_a_loss_in_every_round_is_called_a_loss():
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf([100, 98], [60, 61]), CHECKS)
    assert "more clients served less, in each of 2 rounds; they only queued." in c.text
    assert "a loss" in c.takeaway[1]


def test_without_joined_requests_the_why_is_the_overlapped_round_trip():
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf([100], [250], batch=1.0), CHECKS)
    assert "those trips overlap" in c.text and "batcher joins them" not in c.text
    assert "batched their requests" not in c.takeaway[1]


def test_on_a_neuron_target_the_words_say_neuroncores_and_drop_the_cpu_caveat():
    c = lessons.neuron_conclusion("inf2", comparison(0.0), perf([100], [300]), CHECKS)
    assert "on inf2 NeuronCores" in c.text and "CPU figures" not in c.text
    assert "CPU figure" not in " ".join(c.takeaway)


def test_answers_off_by_more_than_the_tolerance_are_called_different():
    c = lessons.neuron_conclusion("cpu", comparison(0.5), perf([100], [300]), CHECKS)
    assert "differ from in-process PyTorch by up to 5.0e-01" in c.text
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
