"""Notebook 05's conclusion: its words follow the figures given (constructed results)."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import lessons
from labkit.errors import ConfigError

CHECKS = ["tp 1 divides 2 cores", "config parses"]


def comparison(worst: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"model": "add_sub", "output": "a + b", "max_abs_diff": 0.0},
            {"model": "minilm", "output": "sentence embedding", "max_abs_diff": worst},
        ]
    )


def perf(low: float, high: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"concurrency": 4, "throughput": high, "p50_ms": 2.0, "p99_ms": 4.0},
            {"concurrency": 1, "throughput": low, "p50_ms": 1.0, "p99_ms": 2.0},
        ]
    )


def test_a_gain_on_the_cpu_stand_in_is_called_a_gain_and_cpu_figures():
    c = lessons.neuron_conclusion("cpu", comparison(2e-6), perf(100, 250), CHECKS)
    assert "a gain of x2.50 infer/s" in c.text
    assert "stand-in target" in c.text and "These are CPU figures, not Inferentia's" in c.text
    assert "match in-process PyTorch" in c.text
    assert c.figures["concurrency_scaling"] == lessons.Ratio(2.5, "infer/s")
    assert c.figures["answers_match"] is True and c.figures["offline_checks"] == 2


def test_a_tie_is_within_the_noise_not_a_gain():
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf(100, 110), CHECKS)
    assert "x1.10 infer/s, within x1.2 either way: no gain" in c.text
    assert "a gain" not in c.text and "a loss" not in c.text


def test_a_loss_is_called_a_loss():
    c = lessons.neuron_conclusion("cpu", comparison(0.0), perf(100, 60), CHECKS)
    assert "a loss of x0.60 infer/s" in c.text


def test_on_a_neuron_target_the_words_say_neuroncores_and_drop_the_cpu_caveat():
    c = lessons.neuron_conclusion("inf2", comparison(0.0), perf(100, 300), CHECKS)
    assert "on inf2 NeuronCores" in c.text and "CPU figures" not in c.text


def test_answers_off_by_more_than_the_tolerance_are_called_different():
    c = lessons.neuron_conclusion("cpu", comparison(0.5), perf(100, 300), CHECKS)
    assert "differ from in-process PyTorch by up to 5.0e-01" in c.text
    assert c.figures["answers_match"] is False


def test_an_empty_sweep_is_refused():
    with pytest.raises(ConfigError, match="needs the comparison table and a perf sweep"):
        lessons.neuron_conclusion("cpu", comparison(0.0), perf(1, 1).iloc[0:0], CHECKS)
