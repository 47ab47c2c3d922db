"""Notebook 07's scale-out lesson: its figures come from the sweeps given, and its words follow
them (replicas that gain, tie or lose against instances in one server read differently)."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import lab, lessons
from labkit.errors import ConfigError

ONE, INSTANCES, REPLICAS = "one server, 1 instance", "one server, 2 instances", "2 replicas"
THREADS = {ONE: 2, INSTANCES: 1, REPLICAS: 1}


def sweep(config: str, throughput: dict[int, float], p99_ms: dict[int, float], stable=True):
    return pd.DataFrame(
        [
            {"config": config, "concurrency": c, "throughput": t, "p99_ms": p99_ms[c],
             "compute_infer_ms": 4000 / t, "stable": stable}
            for c, t in throughput.items()
        ]
    )  # fmt: skip


def conclude(one: float, instances: float, replicas: float, **options):
    return lessons.scale_out_conclusion(
        sweep(ONE, {1: 20.0, 4: one}, {1: 60, 4: 200}),
        sweep(INSTANCES, {1: 20.0, 4: instances}, {1: 60, 4: 150}),
        sweep(REPLICAS, {1: 19.0, 4: replicas}, {1: 65, 4: 160}),
        **{"count": 2, "threads": THREADS, "cores": 2, **options},
    )


def test_replicas_that_tie_with_instances_are_called_a_tie_and_failover_their_gain():
    lesson = conclude(one=20.0, instances=30.0, replicas=28.0)
    assert lesson.figures["replicas_vs_instances"] == lessons.Ratio(28.0 / 30.0, "infer/s")
    assert lesson.figures["replicas_vs_instances_verdict"] == "tie"
    assert lesson.figures["instances_infer_s_c4"] == 30.0
    assert "gave x0.93 infer/s against 2 instances in one server" in lesson.text
    assert "the same, within the noise" in lesson.text
    # One instance had every core already: the gain is explained by its threads, not by cores.
    assert "gave x1.50 infer/s over one, although one instance's 2 threads already had all 2" in (
        lesson.text
    )
    assert "computed 200 ms a request for the one instance, 133 ms for each of the 2" in (
        lesson.text
    )
    assert "Whatever the replicas reach here, 2 instances in one server reach too" in lesson.text
    assert "replicas buy failover, not speed" in lesson.text
    assert "2, 2 and 2 threads on 2 cores" in lesson.text and "outnumber" not in lesson.text


def test_replicas_that_lose_against_instances_are_called_slower():
    lesson = conclude(one=30.0, instances=31.0, replicas=4.4)
    assert lesson.figures["replicas_vs_instances_verdict"] == "loss"
    assert "less, beyond the noise: the same cores did the same work" in lesson.text
    assert "a tie, within the noise (under x1.20 either way)" in lesson.text  # instances vs one
    assert "the replicas gave x0.15 infer/s: less, beyond the noise" in lesson.text


def test_replicas_that_gain_over_instances_are_not_credited_with_more_cores():
    lesson = conclude(one=20.0, instances=15.0, replicas=26.0)
    assert lesson.figures["replicas_vs_instances_verdict"] == "gain"
    assert "gave x1.73 infer/s against 2 instances in one server" in lesson.text
    assert "more, beyond x1.20, on the same cores. Not from more cores" in lesson.text
    assert "measuring again tells which" in lesson.text and "it is not more cores" in lesson.text
    assert "reach too" not in lesson.text
    assert "less than one, beyond the noise" in lesson.text  # instances vs one: x0.75


def test_instances_that_gain_over_one_thread_are_credited_with_the_idle_cores():
    lesson = conclude(20.0, 30.0, 28.0, threads={ONE: 1, INSTANCES: 1, REPLICAS: 1})
    assert "gave x1.50 infer/s over one: the extra instances put to work cores" in lesson.text
    assert "although" not in lesson.text


def test_a_busy_host_is_named_with_its_load_average():
    assert (
        "load average was 7.2 on 2 cores: other processes"
        in conclude(20.0, 30.0, 28.0, load_average=7.2).text
    )
    assert (
        "load average was 0.5 on 2 cores: a quiet host"
        in conclude(20.0, 30.0, 28.0, load_average=0.5).text
    )


def test_threads_that_outnumber_the_cores_are_called_out():
    lesson = conclude(20.0, 30.0, 28.0, threads={ONE: 2, INSTANCES: 2, REPLICAS: 2})
    assert "2, 4 and 4 threads on 2 cores" in lesson.text
    assert "outnumber the cores" in lesson.text


def test_unsettled_measurements_are_named():
    lesson = lessons.scale_out_conclusion(
        sweep(ONE, {4: 20.0}, {4: 200}),
        sweep(INSTANCES, {4: 30.0}, {4: 150}, stable=False),
        sweep(REPLICAS, {4: 28.0}, {4: 160}),
        cores=2,
    )
    assert "(one server, 2 instances at 4)" in lesson.text
    assert "threads on" not in lesson.text  # no thread counts given, none stated


def test_the_ratios_are_recorded_as_the_index_shows_them(tmp_path):
    lesson = conclude(one=20.0, instances=30.0, replicas=28.0)
    recorded = lab.record(tmp_path, **lesson.figures)
    assert recorded["replicas_vs_one"] == {"ratio": 1.4, "of": "infer/s"}
    assert lessons.figure_text(recorded["instances_vs_one"]) == "x1.50 infer/s"


def test_sweeps_with_no_common_level_are_refused():
    with pytest.raises(ConfigError, match="share no concurrency"):
        lessons.scale_out_conclusion(
            sweep(ONE, {1: 1.0}, {1: 1}), sweep(INSTANCES, {4: 1.0}, {4: 1}),
            sweep(REPLICAS, {4: 1.0}, {4: 1}),
        )  # fmt: skip


def test_rounds_that_spread_wider_than_the_gain_rule_make_the_tie_wider_and_say_so():
    # x0.81 is a loss under the x1.20 rule, a tie where one configuration's rounds spread by 33%
    assert conclude(20.0, 30.0, 24.3).figures["replicas_vs_instances_verdict"] == "loss"
    lesson = conclude(20.0, 30.0, 24.3, rounds=3, spread=0.33)
    assert lesson.figures["replicas_vs_instances_verdict"] == "tie"
    assert lesson.figures["rounds_spread"] == 0.33
    assert "measured 3 times, the three taken in turns" in lesson.text
    assert "a ratio counts only beyond x1.33 either way" in lesson.text
    # a gain beyond the wider limit is still a gain
    assert (
        conclude(20.0, 30.0, 41.0, rounds=3, spread=0.33).figures["replicas_vs_instances_verdict"]
        == "gain"
    )


def test_each_configurations_figure_is_its_median_round_and_the_spread_its_widest():
    from labkit.cluster.scale import ScaleOut, _median_round

    rounds = [sweep(ONE, {4: t}, {4: p}).assign(round=r)
              for r, (t, p) in enumerate([(30.0, 100), (18.0, 300), (24.0, 200)], start=1)]  # fmt: skip
    median = _median_round(rounds)
    assert (median.loc[0, "throughput"], median.loc[0, "p99_ms"], median.loc[0, "round"]) == (
        24.0,
        200,
        3,
    )
    one = pd.concat(rounds)
    scale = ScaleOut(median, median, median, THREADS, {ONE: 1}, 2, 0.5, one)
    assert scale.round_count == 3
    assert scale.spread() == pytest.approx((30.0 - 18.0) / 24.0)
    assert ScaleOut(median, median, median, THREADS, {ONE: 1}, 2, 0.5).spread() == 0.0
