"""The one explanation of instances on a CPU that notebooks 04 and 07 both give."""

from __future__ import annotations

import pytest

from labkit.errors import ConfigError
from labkit.lessons import predict_instances


def test_an_idle_core_and_no_batching_predicts_a_gain_of_the_idle_cores():
    said = predict_instances(instances=2, threads=1, cores=2)
    assert (said.busy_one, said.busy_many, said.expect) == (1, 2, "gain")
    assert "up to about 2x" in said.text and "1 of the 2 cores" in said.text


def test_a_batching_instance_predicts_a_smaller_gain_that_a_busy_core_turns_into_a_loss():
    said = predict_instances(instances=2, threads=1, cores=2, batch=3.6)
    assert said.expect == "smaller gain" and "less than 2x" in said.text and "loses" in said.text
    assert "3.6 requests per execution" in said.text


def test_no_idle_core_predicts_no_gain():
    said = predict_instances(instances=2, threads=2, cores=2)
    assert (said.busy_one, said.busy_many, said.expect) == (2, 2, "no gain")


@pytest.mark.parametrize("bad", [dict(instances=1), dict(threads=0), dict(batch=0.5)])
def test_impossible_inputs_are_refused(bad):
    with pytest.raises(ConfigError, match="predict_instances"):
        predict_instances(**({"instances": 2, "threads": 1, "cores": 2} | bad))


def test_on_a_server_of_one_core_the_budget_reads_as_one_core_and_a_batching_model_loses():
    said = predict_instances(instances=2, threads=1, cores=1, batch=2.8)
    assert said.expect == "loss" and said.text.endswith("expect a loss.")
    assert said.text.startswith(
        "Each instance runs 1 torch thread, so one instance already keeps the server's one core "
        "busy, and 2 share that core."
    )
    assert "1 of the 1 cores" not in said.text and said.text.endswith("expect a loss.")
