"""What the thread budget predicts for more instances on a CPU, as numbers (notebooks 04, 07, 08)."""

from __future__ import annotations

import pytest

from labkit.errors import ConfigError
from labkit.lessons import predict_instances
from labkit.lessons.instances import prediction_table


@pytest.mark.parametrize(
    ("threads", "cores", "batch", "busy", "expect"),
    [(1, 2, 1.0, (1, 2), "gain"),  # an idle core, no batching: up to about 2x
     (1, 2, 3.6, (1, 2), "smaller gain"),  # a batching instance: its batches split in two
     (2, 2, 1.0, (2, 2), "no gain"),  # one instance keeps both cores busy
     (1, 1, 2.8, (1, 1), "loss"),  # no idle core and batches split: a loss
     (1, 2, 1.49, (1, 2), "gain"), (1, 2, 1.5, (1, 2), "smaller gain")],  # batching from 1.5
)  # fmt: skip
def test_the_thread_budget_predicts_from_busy_cores_and_requests_per_execution(
    threads, cores, batch, busy, expect
):
    said = predict_instances(instances=2, threads=threads, cores=cores, batch=batch)
    assert (said.busy_one, said.busy_many, said.expect) == (*busy, expect)
    assert said.ceiling == busy[1] / busy[0]


def test_instances_with_fewer_threads_each_than_one_alone_keep_their_own_cores_busy():
    said = predict_instances(instances=2, threads=2, threads_each=1, cores=2)
    assert (said.busy_one_least, said.busy_one, said.busy_many) == (1, 2, 2)
    assert said.expect == "gain if its work does not split"
    assert said.ceiling == 2.0 and said.busy_one_said == "1 to 2"
    said = predict_instances(instances=4, threads=4, threads_each=2, cores=8)
    assert (said.busy_one_least, said.busy_one, said.busy_many) == (2, 4, 8)
    assert (said.expect, said.ceiling) == ("gain", 4.0)
    said = predict_instances(instances=2, threads=1, threads_each=2, cores=2)  # copies with more
    assert (said.busy_one_least, said.expect) == (None, "gain")
    with pytest.raises(ConfigError, match="threads_each=0"):
        predict_instances(instances=2, threads=2, threads_each=0, cores=2)


def test_a_gain_says_how_much_the_idle_cores_allow():
    assert "up to about 2x" in str(predict_instances(instances=2, threads=1, cores=2))
    assert "up to about 4x" in str(predict_instances(instances=4, threads=1, cores=4))


@pytest.mark.parametrize("bad", [dict(instances=1), dict(threads=0), dict(batch=0.5)])
def test_impossible_inputs_are_refused(bad):
    with pytest.raises(ConfigError, match="predict_instances"):
        predict_instances(**({"instances": 2, "threads": 1, "cores": 2} | bad))


def test_the_predictions_table_has_a_row_each_with_the_budgets_numbers():
    table = prediction_table(
        [predict_instances(instances=2, threads=1, cores=c, batch=2.44) for c in (2, 1)]
    )
    assert list(table["server's cores"]) == [2, 1]
    assert list(table["cores busy, 2 instances"]) == [2, 1]
    assert list(table["requests per execution, 1 instance"]) == [2.4, 2.4]
    assert list(table["expect"]) == ["smaller gain", "loss"]
