"""Notebook 07's scale-out figures: the prediction as numbers, three comparisons judged round by
round by the lab's one rule (replicas against one instance, against instances, and instances
against one), the figures recorded, and a takeaway of verdicts and failover figures."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from labkit import lab, lessons, report
from labkit.errors import ConfigError
from labkit.lessons.scale_out import predict_scale_out
from labkit.lessons.takeaway import sentence_count

ONE, INSTANCES, REPLICAS = "one server, 1 instance", "one server, 2 instances", "2 replicas"


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
        **{"count": 2, **options},
    )


def in_rounds(per_config: dict[str, list[float]], concurrency: int = 4) -> pd.DataFrame:
    """Every round of every configuration at ``concurrency``, as ``ScaleOut.rounds`` holds them."""
    return pd.DataFrame(
        [{"config": name, "concurrency": concurrency, "round": r, "throughput": t}
         for name, runs in per_config.items() for r, t in enumerate(runs, 1)]
    )  # fmt: skip


def failed(kind: str, failed: int, requests: int) -> SimpleNamespace:
    return SimpleNamespace(figures={"fault_kind": kind, "failed": failed, "requests": requests})


def words(lesson) -> list[str]:
    """The verdicts in order: replicas against one, replicas against instances, instances
    against one."""
    return [v.word for v in lesson.verdicts]


def test_the_prediction_is_numbers_from_the_shared_explanation_of_instances():
    said = predict_scale_out(2, threads=1, cores=2)
    assert said.instances == lessons.predict_instances(instances=2, threads=1, cores=2)
    assert said.instances.expect == "gain"
    assert list(said.table()["predicted"]) == [2, 1, 1, "1", 2, 1.0, "x2.00"]
    assert predict_scale_out(2, threads=1, cores=2, batch=4).instances.expect == "smaller gain"
    assert list(predict_scale_out(2, threads=1, cores=1).table()["predicted"])[3:5] == ["1", 1]


def test_labkits_default_budget_gives_one_instance_every_core_and_two_a_core_each():
    said = predict_scale_out(2, threads=2, threads_each=1, cores=2, batch=4)
    # one instance keeps 1 core busy where its work does not split over its 2 threads, 2 where it
    # does: the copies gain up to 2x, or nothing
    assert list(said.table()["predicted"]) == [2, 2, 1, "1 to 2", 2, 4, "x1.00 to x2.00"]
    assert said.instances.expect == "gain if its work does not split"
    assert said.instances.ceiling == 2.0
    assert "1 instance of 2 torch threads, 2 of 1 each," in str(said.instances)


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [(35.0, ["gain", "tie", "gain"]), (4.4, ["loss", "loss", "gain"]),
     (60.0, ["gain", "gain", "gain"])],
    ids=["tie", "loss", "gain"],
)  # fmt: skip
def test_each_comparison_is_judged_and_its_sentence_names_the_outcome_and_its_number(
    replicas, expected
):
    lesson = conclude(one=20.0, instances=36.0, replicas=replicas)
    assert words(lesson) == expected
    against = lesson.verdicts[1]
    assert against.ratio == lessons.Ratio(replicas / 36.0, "infer/s")
    assert f"{against.word}, median {against.ratio}" in str(lesson)
    assert str(lesson).count("\n") == 2  # one sentence a verdict, nothing else when all settled


def test_the_verdict_edges_follow_the_labs_one_rule():
    # replicas against instances at x1.20 is a gain, at x1.19 a tie; x0.83 a loss, x0.84 a tie
    assert [words(conclude(10.0, 10.0, r))[1] for r in (12.0, 11.9, 8.3, 8.4)] == [
        "gain", "tie", "loss", "tie",
    ]  # fmt: skip


def test_the_verdict_table_has_a_row_a_comparison_at_the_highest_common_level():
    table = conclude(20.0, 36.0, 35.0).verdict_table()
    assert list(table.columns) == ["comparison", "of", "each round", "median", "spread", "verdict"]
    assert list(table["verdict"]) == ["gain", "tie", "gain"]
    assert list(table["median"]) == [1.75, 0.97, 1.8]
    assert all(c.endswith("at concurrency 4") for c in table["comparison"])


def test_comparisons_are_judged_round_by_round():
    # x0.81 in one measurement: a loss under the x1.20 rule
    assert words(conclude(20.0, 30.0, 24.3))[1] == "loss"
    # the same medians, but one round of three had replicas ahead: not agreed, a tie
    split = in_rounds({ONE: [20.0] * 3, INSTANCES: [30.0] * 3, REPLICAS: [24.3, 22.0, 31.0]})
    assert words(conclude(20.0, 30.0, 24.3, rounds=split))[1] == "tie"
    # a host that slowed down in round 3 weighs on both sides alike: still a loss
    slowed = in_rounds({ONE: [20.0, 20.0, 10.0], INSTANCES: [30.0, 30.0, 15.0],
                        REPLICAS: [24.3, 24.0, 12.0]})  # fmt: skip
    lesson = conclude(20.0, 30.0, 24.3, rounds=slowed)
    assert words(lesson)[1] == "loss" and lesson.verdicts[1].spread() == "x0.80 to x0.81"


def test_the_ratio_recorded_is_the_median_of_the_rounds_the_verdict_judged():
    # medians 5.76 and 4.93 (x1.17), but round by round x1.18, x0.86 and x1.00: x1.00 is kept
    rounds = in_rounds({ONE: [5.1, 5.2, 5.0], INSTANCES: [4.93, 5.6, 4.8],
                        REPLICAS: [5.82, 4.82, 4.8]})  # fmt: skip
    lesson = conclude(5.1, 4.93, 5.76, rounds=rounds)
    assert str(lesson.figures["2_replicas_against_2_instances"]) == "x1.00 infer/s"
    assert lesson.verdicts[1].ratios == pytest.approx((5.82 / 4.93, 4.82 / 5.6, 1.0))


def test_at_most_four_figures_are_recorded_and_they_read_as_labels(tmp_path):
    lesson = conclude(one=20.0, instances=30.0, replicas=28.0)
    assert len(lesson.figures) == 4 and not [k for k in lesson.figures if "_vs_" in k]
    assert lesson.figures["2_instances_infer_s_c4"] == 30.0
    recorded = lab.record(tmp_path, **lesson.figures)
    assert recorded["2_replicas_against_2_instances"] == {"ratio": 0.93, "of": "infer/s"}
    assert report.figure_label("2_replicas_infer_s_c4") == "2 replicas at concurrency 4 (infer/s)"


@pytest.mark.parametrize("replicas", [4.4, 35.0, 60.0], ids=["loss", "tie", "gain"])
def test_the_takeaway_is_verdicts_and_failover_figures_in_three_sentences(replicas):
    lesson = conclude(20.0, 36.0, replicas)
    kept = lessons.with_failover(lesson, failed("server", 0, 109), failed("stub", 1, 91))
    assert kept.takeaway[:2] == lesson.takeaway and kept.figures == lesson.figures
    against = lesson.verdicts[1]
    assert against.word in kept.takeaway[1] and str(against.ratio) in kept.takeaway[1]
    assert "tritonserver, then its Python stub" in kept.takeaway[2]
    assert "1 of 200 requests failed" in kept.takeaway[2]
    assert sentence_count(kept.takeaway) == 3
    lessons.Takeaway.of(kept)  # the lab's rule holds it too
    with pytest.raises(ConfigError, match="at least one"):
        lessons.with_failover(lesson)


def test_unsettled_measurements_are_named():
    lesson = lessons.scale_out_conclusion(
        sweep(ONE, {4: 20.0}, {4: 200}),
        sweep(INSTANCES, {4: 30.0}, {4: 150}, stable=False),
        sweep(REPLICAS, {4: 28.0}, {4: 160}),
    )
    assert "2 instances at 4)" in str(lesson) and str(lesson).count("\n") == 3


def test_sweeps_with_no_common_level_are_refused():
    with pytest.raises(ConfigError, match="share no concurrency"):
        lessons.scale_out_conclusion(
            sweep(ONE, {1: 1.0}, {1: 1}), sweep(INSTANCES, {4: 1.0}, {4: 1}),
            sweep(REPLICAS, {4: 1.0}, {4: 1}),
        )  # fmt: skip


def test_each_configurations_figure_is_its_median_round():
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
    scale = ScaleOut(median, median, median, {ONE: 1}, {ONE: 1}, 2, 0.5, one)
    assert scale.round_count == 3
    assert ScaleOut(median, median, median, {ONE: 1}, {ONE: 1}, 2, 0.5).round_count == 1


def test_the_scale_out_table_reads_in_words_with_units():
    from labkit.cluster.scale import ScaleOut, _median_round

    rounds = [sweep(ONE, {4: t}, {4: 200}).assign(round=r) for r, t in [(1, 30.0), (2, 18.0)]]
    median = _median_round(rounds)
    scale = ScaleOut(median, median, median, {ONE: 1}, {ONE: 1}, 2, 0.5, pd.concat(rounds))
    table = scale.table()
    assert not [c for c in table.columns if "_" in c]
    row = table.iloc[0]
    assert (row["instances"], row["torch threads each"], row["infer/s in each round"]) == (
        1,
        1,
        "30.0, 18.0",
    )
    assert row["infer/s (median round)"] == 18.0 and row["p99 latency (ms)"] == 200
