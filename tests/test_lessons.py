"""Notebook 04's figures and verdicts (03's are in test_lesson_batching.py): they come from the
measurements given, a verdict counts only when the rounds agree, and the takeaway names each
verdict with its number."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from labkit import lessons
from labkit.errors import ConfigError
from labkit.lessons.takeaway import sentence_count


def search(winner_change="max batch size 8 -> 4", winner_batch=4, default_tput=7.6, twin=None):
    """:func:`labkit.profiling.analyzer.ranked`'s table of a search, winner first: ``w`` (by
    default a max batch size of 4), the default ``d`` (8) and ``two`` (2 instances), measured
    once each at 4 clients; ``twin``: the throughput of a fourth, with the default's settings."""
    rows = [
        ("w", winner_change, 1, winner_batch, 8.16, 2.5, 330.0, False),
        ("d", "none", 1, 8, default_tput, 2.4, 340.0, True),
        ("two", "2 instances", 2, 8, 5.9, 1.6, 700.0, False),
    ]
    if twin is not None:
        rows.insert(0, ("twin", "none", 1, 8, twin, 2.4, 335.0, False))
    columns = ["config", "change", "instances", "max_batch_size", "throughput"]
    columns += ["avg_batch_size", "compute_infer_ms", "is_default"]
    frame = pd.DataFrame(rows, columns=columns).assign(concurrency=4)
    return frame.assign(rank=range(1, len(frame) + 1))


def in_rounds(per_round: dict[str, list[float]], batch=None, ms=None) -> pd.DataFrame:
    """One measurement of each configuration a round: ``{config: [infer/s per round]}``."""
    batch, ms = batch or {}, ms or {}
    return pd.DataFrame(
        {
            "round": r,
            "config": name,
            "concurrency": 4,
            "throughput": t,
            "avg_batch_size": batch.get(name, 2.4),
            "compute_infer_ms": ms.get(name, 340.0),
        }
        for name, runs in per_round.items()
        for r, t in enumerate(runs, 1)
    )


def test_one_round_gives_no_verdict():
    with pytest.raises(ConfigError, match="two or more rounds"):
        lessons.analyzer.verdict([1.5])
    with pytest.raises(ConfigError, match="two or more rounds"):
        lessons.analyzer.verdict([1.5, float("nan")])


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [([0.65, 0.47, 0.99, 0.50], "loss"),  # measured with the server on one core, load 4.4
     ([0.65, 0.47, 1.02, 0.50], "tie"),  # one round the other way: not agreed
     ([0.65, 0.95], "loss"),  # the median beyond x1.20, neither round the other way
     ([0.9, 0.85], "tie"),  # the same way each round, but the median within x1.20
     ([1.56, 1.40, 1.05], "gain"), ([1.56, 1.05, 1.02], "tie"), ([1.2, 1.15, 1.3], "gain"),
     ([0.6, 0.95, 0.6], "loss"), ([1.0, 1.0], "tie")],
)  # fmt: skip
def test_the_median_beyond_the_bar_and_no_round_the_other_way_make_a_verdict(ratios, expected):
    assert lessons.analyzer.verdict(ratios) == expected
    assert lessons.judge(ratios) == expected  # 04's verdict is the lab's one rule


@pytest.mark.parametrize(
    ("ratios", "noise", "expected"),
    [([1.25], 1.0, "gain"), ([1.15], 1.0, "tie"), ([0.8], 1.0, "loss"),  # one round: x1.20
     ([1.25, 1.3], 1.4, "tie"), ([1.5, 1.45], 1.4, "gain"),  # a measured noise wider than x1.20
     ([0.75, 0.75], 1.4, "tie"), ([0.75, 0.75], 1 / 1.4, "tie"), ([0.7, 0.7], 1.4, "loss"),
     ([1.3, float("nan"), 1.4], 1.0, "gain"), ([float("nan")], 1.0, "tie"), ([], 1.0, "tie")],
)  # fmt: skip
def test_the_lab_judges_every_difference_by_one_rule(ratios, noise, expected):
    assert lessons.judge(ratios, noise=noise) == expected


def test_the_rule_said_to_the_learner_states_the_bar_the_code_applies():
    assert f"x{lessons.GAIN:.2f}" in lessons.NOISE_RULE
    assert f"x{1 / lessons.GAIN:.2f}" in lessons.NOISE_RULE


def test_the_rule_reads_the_median_as_the_learner_does_to_two_decimals():
    # 1.26, 1.198, 1.02: shown as x1.20, so judged as x1.20, not a tie beside it
    assert lessons.judge([1.26, 1.198, 1.02]) == "gain"
    assert lessons.judge([1.26, 1.194, 1.02]) == "tie"  # shown as x1.19
    assert lessons.judge([0.7, 0.834, 0.9]) == "loss"  # shown as x0.83


def test_each_configuration_gets_a_verdict_of_its_rounds_the_pick_first():
    rounds = in_rounds(
        {"d": [6.0, 5.8, 6.2], "w": [5.9, 6.1, 6.0], "two": [3.8, 3.5, 4.1]},
        batch={"two": 1.6},
        ms={"two": 700.0},
    )
    conclusion = lessons.confirm_winner(rounds, search(), "two")
    pick, batch = conclusion.verdicts
    assert pick.comparison.startswith("2 instances") and "pick" in pick.comparison
    assert [round(r, 2) for r in pick.ratios] == [0.63, 0.6, 0.66]
    assert (round(pick.median, 2), pick.word) == (0.63, "loss")
    assert (round(batch.median, 2), batch.word, batch.spread()) == (0.98, "tie", "x0.97 to x1.05")
    figures = conclusion.figures
    assert figures["verdicts"] == {"2 instances": "loss", "max batch size 8 -> 4": "tie"}
    assert str(figures["2 instances against the default"]) == "x0.63 infer/s"
    assert str(figures["max batch size 8 -> 4 against the default"]) == "x0.98 infer/s"
    assert figures["Model Analyzer's pick"] == "2 instances"
    assert str(figures["its lead over the default in the search"]) == "x0.78 infer/s"
    # w and d differ only in a max batch size that 4 clients never fill: the search's noise
    assert str(figures["spread between configurations that cannot differ"]) == "x1.07 infer/s"
    table = conclusion.table
    assert list(table["configuration"]) == ["d", "two", "w"]  # the reference, then the pick
    assert list(
        table.loc[1, ["requests per execution", "compute of each request's batch (ms)"]]
    ) == [
        1.6,
        700,
    ]
    assert table.loc[1, "infer/s, each round"] == "3.80, 3.50, 4.10"
    assert list(conclusion.verdict_table()["verdict"]) == ["loss", "tie"]
    shown = str(conclusion) + conclusion.table.to_string() + conclusion.verdict_table().to_string()
    assert "_vs_" not in shown and "Ratio(" not in shown


@pytest.mark.parametrize(
    ("winner_runs", "word", "median"),
    [([6.2, 6.1], "gain", "x1.23"), ([5.1, 4.8], "tie", "x0.99"), ([4.0, 4.1], "loss", "x0.81")],
    ids=["gain", "tie", "loss"],
)
def test_the_takeaway_names_the_pick_and_each_verdict_with_its_number(winner_runs, word, median):
    rounds = in_rounds({"d": [5.0, 5.0], "w": winner_runs, "two": [3.0, 3.1]})
    takeaway = lessons.confirm_winner(rounds, search(), "w").takeaway
    assert len(takeaway) == 3 and sentence_count(takeaway) == 3
    assert takeaway[0].startswith("Model Analyzer picked max batch size 8 -> 4")
    assert "x1.07 infer/s" in takeaway[0]  # its lead in the search, one measurement each
    assert (
        takeaway[1].startswith("Max batch size 8 -> 4")
        and f"{word}, median {median}" in takeaway[1]
    )
    assert takeaway[2].startswith("2 instances") and "loss, median x0.61" in takeaway[2]
    assert lessons.Takeaway.of(lessons.confirm_winner(rounds, search(), "w")).lines == takeaway


def test_a_gain_needs_every_round_and_the_median_beyond_the_bar():
    gain = lessons.confirm_winner(in_rounds({"d": [5.0, 5.0], "w": [6.2, 6.0]}), search(), "w")
    assert gain.figures["verdicts"] == {"max batch size 8 -> 4": "gain"}
    # faster in both rounds, but the median (x1.12) within x1.20: a tie
    tie = lessons.confirm_winner(in_rounds({"d": [5.0, 5.0], "w": [6.0, 5.2]}), search(), "w")
    assert tie.figures["verdicts"] == {"max batch size 8 -> 4": "tie"}
    # the median beyond x1.20, one round slower: not agreed, a tie
    split = in_rounds({"d": [5.0, 5.0, 5.0], "w": [6.5, 6.5, 4.9]})
    assert lessons.confirm_winner(split, search(), "w").figures["verdicts"] == {
        "max batch size 8 -> 4": "tie"
    }


def test_a_round_where_the_default_was_not_measured_is_left_out():
    rounds = in_rounds({"d": [5.0, 5.0, 5.0], "w": [6.2, 6.1, 6.3]})
    rounds = rounds[~((rounds["config"] == "d") & (rounds["round"] == 2))]
    (said,) = lessons.confirm_winner(rounds, search(), "w").verdicts
    assert said.measured == pytest.approx((1.24, 1.26)) and said.word == "gain"


def test_a_winner_with_the_defaults_own_settings_is_measured_by_the_default():
    rounds = in_rounds({"d": [6.0, 6.1], "w": [6.0, 5.9], "two": [3.5, 3.6]})
    conclusion = lessons.confirm_winner(rounds, search(twin=9.0), "twin")
    assert conclusion.figures["Model Analyzer's pick"] == "the default's own settings"
    assert "pick" not in " ".join(v.comparison for v in conclusion.verdicts)
    kept = lessons.confirm_winner(rounds, search(), "d")
    assert kept.figures["Model Analyzer's pick"] == "the default"
    assert kept.takeaway[0].startswith("Model Analyzer ranked the default first")


def test_the_rounds_must_measure_the_default_and_the_winner():
    with pytest.raises(ConfigError, match="they lack .'d'"):
        lessons.confirm_winner(in_rounds({"w": [6.0, 6.1]}), search(), "w")
    with pytest.raises(ConfigError, match="they lack .'w'"):
        lessons.confirm_winner(in_rounds({"d": [6.0, 6.1]}), search(), "w")
    with pytest.raises(ConfigError, match="analyzer.ranked"):
        lessons.search_figures(search().drop(columns="compute_infer_ms"))


def test_the_search_figures_give_the_pick_its_lead_and_the_noise():
    figures = lessons.search_figures(search())
    assert figures["Model Analyzer's pick"] == "max batch size 8 -> 4"
    assert str(figures["its lead over the default in the search"]) == "x1.07 infer/s"
    assert str(figures["spread between configurations that cannot differ"]) == "x1.07 infer/s"
    # a max batch size of 2 under 4 clients can matter: the noise is the default's twin alone
    twin = lessons.search_figures(search(winner_batch=2, twin=7.7))
    assert str(twin["spread between configurations that cannot differ"]) == "x1.01 infer/s"


def test_the_search_noise_is_none_where_nothing_measured_cannot_differ():
    one_size = search(winner_change="2 instances", winner_batch=8).assign(instances=[2, 1, 2])
    assert lessons.analyzer.search_noise(one_size) is None
    assert lessons.search_figures(one_size)["spread between configurations that cannot differ"] == (
        "none searched"
    )
    assert lessons.analyzer.search_noise(
        one_size.assign(change=["none", "none", "2 instances"], instances=[1, 1, 2])
    ) == pytest.approx(8.16 / 7.6)


def test_a_ratio_reads_the_same_in_words_in_figures_json_and_in_the_index(tmp_path):
    from labkit import lab
    from labkit.lessons import Ratio, figure_text

    gain = Ratio.between(36.4, 20.0, "infer/s")
    assert str(gain) == "x1.82 infer/s"
    recorded = lab.record(tmp_path, winner_vs_default=gain)
    assert recorded["winner_vs_default"] == {"ratio": 1.82, "of": "infer/s"}
    assert figure_text(recorded["winner_vs_default"]) == str(gain)
    assert figure_text(3) == "3"
    assert [figure_text(v) for v in (0.08351, 14.354, 3.576e-06)] == ["0.0835", "14.4", "3.58e-06"]
    assert [figure_text(v) for v in (1473.8, 39321.5)] == ["1474", "39322"]  # never 1.47e+03
    assert math.isnan(Ratio.between(1.0, 0.0, "infer/s").value)
