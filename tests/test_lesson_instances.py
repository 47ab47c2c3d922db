"""The one explanation of instances on a CPU that notebooks 04 and 07 both give."""

from __future__ import annotations

import pytest

from labkit.errors import ConfigError
from labkit.lessons import predict_instances


def test_an_idle_core_and_no_batching_predicts_a_gain_of_the_idle_cores():
    said = predict_instances(instances=2, threads=1, cores=2)
    assert (said.busy_one, said.busy_many, said.expect) == (1, 2, "gain")
    assert "up to 2x" in said.text and "1 of the 2 cores" in said.text


def test_a_batching_instance_predicts_no_gain_even_with_an_idle_core():
    said = predict_instances(instances=2, threads=1, cores=2, batch=3.6)
    assert said.expect == "no gain"
    assert "3.6 requests per execution" in said.text


def test_no_idle_core_predicts_no_gain():
    said = predict_instances(instances=2, threads=2, cores=2)
    assert (said.busy_one, said.busy_many, said.expect) == (2, 2, "no gain")


@pytest.mark.parametrize("bad", [dict(instances=1), dict(threads=0), dict(batch=0.5)])
def test_impossible_inputs_are_refused(bad):
    with pytest.raises(ConfigError, match="predict_instances"):
        predict_instances(**({"instances": 2, "threads": 1, "cores": 2} | bad))
