"""The conclusions notebook 04 prints (03's are in test_lesson_batching.py): their figures come from
the measurements given, and their words follow those figures (a loss is never called a gain, a tie
never a win, and a verdict counts only when every round agrees)."""

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
    assert "no round pointing the other way" in lessons.NOISE_RULE


def test_a_max_batch_size_the_clients_never_fill_ties_and_two_instances_lose_with_the_reason():
    rounds = in_rounds(
        {"d": [6.0, 5.8, 6.2], "w": [5.9, 6.1, 6.0], "two": [3.8, 3.5, 4.1]},
        batch={"two": 1.6},
        ms={"two": 700.0},
    )
    conclusion = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=2)
    said = conclusion.text
    assert (
        "w (max batch size 8 -> 4), Model Analyzer's winner, gave x0.98 infer/s against the "
        "default (x0.97 to x1.05 over 3 rounds): a tie" in said
    )
    assert "4 clients never send more requests at once than either max batch size allows" in said
    assert "two (2 instances) gave x0.63 infer/s against the default (x0.60 to x0.66" in said
    assert "slower in every round" in said
    # the shared explanation of instances, from the default's requests per execution
    assert "keeps 1 of the 2 cores busy" in said and "2.4 requests per execution" in said
    assert "took 700 ms with 2 instances against 340 ms with 1" in said
    assert "shared the cores" in said
    figures = conclusion.figures
    assert figures["verdicts"] == {"max batch size 4": "tie", "2 instances": "loss"}
    assert str(figures["2_instances_against_default"]) == "x0.63 infer/s"
    assert str(figures["max_batch_size_4_against_default"]) == "x0.98 infer/s"
    assert (
        str(figures["spread between configurations that cannot differ"]) == "x1.07 infer/s"
    )  # w and d cannot differ here
    assert len(figures) <= 6
    assert conclusion.takeaway == (
        "A max batch size of 4 tied with the default's 8 (x0.97 to x1.05 over 3 rounds): 4 "
        "clients never exceed either.",
        "Two instances lost (x0.63 infer/s): their executions took x2.06 as long as one "
        "instance's, so they shared the cores instead of each having one.",
        "Model Analyzer picked max batch size 8 -> 4 from one measurement of each "
        "configuration (configurations that cannot differ here measured up to x1.07 apart): a "
        "search's pick holds for the cores and the load it was measured with, so measure it "
        "again, in turns, where you will deploy it.",
    )
    assert sentence_count(conclusion.takeaway) == 3
    # the rounds' server on one core, the search's on every core: the takeaway says both
    pinned = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=1)
    assert pinned.takeaway[1].startswith("Two instances made x0.")
    assert pinned.takeaway[1].endswith(
        "against the default in the search, where the server could use every core, and lost "
        "(x0.63 infer/s) measured again with the server on one core: an instance gains only "
        "where a core is idle."
    )
    assert sentence_count(pinned.takeaway) == 3
    # a search whose default measured low: two instances' lead there is within the search's noise
    noisy = lessons.confirm_winner(rounds, search(default_tput=5.0), "w", threads=1, cores=1)
    assert noisy.takeaway[1].startswith(
        "Two instances made x1.18 infer/s against the default in the search, within its noise "
        "(x1.63 between configurations that cannot differ), and lost"
    )
    shown = said + conclusion.table.to_string() + " ".join(conclusion.table.columns)
    assert "_vs_" not in shown and "Ratio(" not in shown
    assert list(conclusion.table["configuration"]) == ["d", "w", "two"]  # the reference first


def test_the_words_follow_the_settings_not_which_configuration_model_analyzer_ranked_first():
    rounds = in_rounds({"d": [6.0, 5.8], "w": [5.9, 6.1], "two": [3.8, 3.5]})
    first = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=2)
    # the same measurements, with the search's noise ranking the 2 instances first
    table = search().set_index("config").loc[["two", "w", "d"]].reset_index()
    second = lessons.confirm_winner(rounds, table.assign(rank=[1, 2, 3]), "two", threads=1, cores=2)
    assert first.takeaway[:2] == second.takeaway[:2]
    assert first.figures["verdicts"] == second.figures["verdicts"]
    assert second.takeaway[2].startswith("Model Analyzer picked 2 instances")
    assert "two (2 instances), Model Analyzer's winner, gave x0.62 infer/s" in second.text


def test_two_instances_that_change_the_max_batch_size_too_say_so_in_the_takeaway():
    both = search()
    both.loc[both["config"] == "two", ["change", "max_batch_size"]] = (
        "max batch size 8 -> 4, 2 instances",
        4,
    )
    rounds = in_rounds({"d": [6.0, 5.8, 6.2], "w": [5.9, 6.1, 6.0], "two": [3.8, 3.5, 4.1]})
    pinned = lessons.confirm_winner(rounds, both, "w", threads=1, cores=1)
    assert pinned.takeaway[1].startswith("Two instances (with max batch size 8 -> 4 too) made x0.")
    alone = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=1)
    assert alone.takeaway[1].startswith("Two instances made x0.")  # one change: nothing to add


def test_two_instances_that_each_had_a_core_gain_and_the_words_say_why():
    # an idle host: each instance ran its executions as fast as one instance did (measured
    # here: 11.3 infer/s against 7.3, executions of 254 ms against 265, 1.5 requests against 2.0)
    rounds = in_rounds(
        {"d": [7.3, 7.5], "two": [11.3, 11.0]}, batch={"d": 2.0, "two": 1.5}, ms={"two": 254.0}
    )
    conclusion = lessons.confirm_winner(rounds, search(), "d", threads=1, cores=2)
    assert conclusion.figures["verdicts"] == {"2 instances": "gain"}
    assert conclusion.takeaway[0] == (
        "Two instances gained (x1.51 infer/s): each ran its executions about as fast as one "
        "instance, on a core of its own, with fewer requests in each."
    )
    assert "254 ms with 2 instances against 340 ms with 1: each instance had a core" in (
        conclusion.text
    )


def test_two_instances_that_had_a_core_each_in_the_search_but_not_in_the_rounds_say_so():
    rounds = in_rounds({"d": [7.6, 7.8], "two": [6.1, 6.7]}, ms={"two": 470.0})
    table = search().assign(throughput=[7.4, 7.3, 11.3], compute_infer_ms=[270.0, 265.0, 254.0])
    said = lessons.confirm_winner(rounds, table, "d", threads=1, cores=2).text
    assert "470 ms with 2 instances against 340 ms with 1: the instances' threads shared" in said
    assert (
        "In the search it was the other way (254 against 265 ms, x1.55 infer/s): the second "
        "core was free then and busy during the rounds, so more instances gain only where a "
        "core is really idle." in said
    )
    pinned = lessons.confirm_winner(rounds, table, "d", threads=1, cores=1).text
    assert (
        "(254 against 265 ms, x1.55 infer/s): the search's server could use a second core, the "
        "rounds' had one, so more instances gain only where a core is really idle." in pinned
    )


def test_a_configuration_faster_in_every_round_beyond_the_bar_is_a_gain_and_within_it_a_tie():
    gain = lessons.confirm_winner(in_rounds({"d": [5.0, 5.0], "w": [6.2, 6.0]}), search(), "w")
    assert gain.figures["verdicts"] == {"max batch size 4": "gain"}
    assert "faster in every round" in gain.text
    assert "tied" not in gain.takeaway[0]
    # faster in both rounds, but the median (x1.12) within x1.20: a tie
    tie = lessons.confirm_winner(in_rounds({"d": [5.0, 5.0], "w": [6.0, 5.2]}), search(), "w")
    assert tie.figures["verdicts"] == {"max batch size 4": "tie"}
    # the median beyond x1.20, one round slower: not agreed, a tie
    split = in_rounds({"d": [5.0, 5.0, 5.0], "w": [6.5, 6.5, 4.9]})
    assert lessons.confirm_winner(split, search(), "w").figures["verdicts"] == {
        "max batch size 4": "tie"
    }


def test_the_search_and_the_rounds_are_set_side_by_side_with_the_time_of_one_execution():
    drifted = lessons.confirm_winner(
        in_rounds({"d": [5.7, 5.9], "w": [5.8, 5.8]}), search(default_tput=7.6), "w"
    )
    assert "The search measured the default at 7.60 infer/s, the rounds at 5.80" in drifted.text
    assert "took 340 ms against 340 ms, at another moment of a host whose speed drifts" in (
        drifted.text
    )
    on_one_core = lessons.confirm_winner(
        in_rounds({"d": [5.7, 5.9], "w": [5.8, 5.8]}), search(default_tput=7.6), "w", cores=1
    ).text
    assert "the search's server could use every core of this host and the rounds' 1" in on_one_core
    assert "this run cannot tell apart" in on_one_core and "another speed then" not in on_one_core
    agreed = lessons.confirm_winner(
        in_rounds({"d": [7.5, 7.7], "w": [7.4, 7.8]}), search(default_tput=7.6), "w"
    )
    assert "agrees with the rounds'" in agreed.text
    assert "stayed within 7.50 to 7.70 infer/s across the rounds." in agreed.text
    busy = lessons.confirm_winner(in_rounds({"d": [7.2, 4.1], "w": [8.0, 3.4]}), search(), "w")
    assert "ranged from 4.10 to 7.20 infer/s across the rounds (x1.76)" in busy.text


def test_a_winner_with_the_defaults_own_settings_is_measured_by_the_default():
    rounds = in_rounds({"d": [6.0, 6.1], "w": [6.0, 5.9], "two": [3.5, 3.6]})
    conclusion = lessons.confirm_winner(rounds, search(twin=9.0), "twin", threads=1, cores=2)
    assert conclusion.takeaway[2].startswith(
        "Model Analyzer picked a configuration with the default's own settings, that is: keep "
        "the default, from one measurement"
    )
    assert conclusion.figures["Model Analyzer's pick"] == "the default's settings"


def test_a_search_that_kept_the_default_says_so():
    rounds = in_rounds({"d": [6.0, 6.1], "w": [6.0, 5.9], "two": [3.5, 3.6]})
    conclusion = lessons.confirm_winner(rounds, search(), "d", threads=1, cores=2)
    assert conclusion.takeaway[2].startswith("Model Analyzer ranked the default first from one")


def test_the_rounds_must_measure_the_default_and_the_winner():
    with pytest.raises(ConfigError, match="they lack d"):
        lessons.confirm_winner(in_rounds({"w": [6.0, 6.1]}), search(), "w")
    with pytest.raises(ConfigError, match="they lack w"):
        lessons.confirm_winner(in_rounds({"d": [6.0, 6.1]}), search(), "w")


def test_the_search_findings_give_each_instance_count_the_mechanism_its_noise_and_the_pick():
    said = lessons.search_findings(search(), threads=1, cores=2)
    assert "measured 7.60 to 8.16 infer/s with 1 instance (w, d), and 5.90 infer/s with 2" in said
    assert "A max batch size of 4 or 8 makes no difference here" in said
    # w and d differ only in a max batch size the clients never fill: the search's noise
    assert "differ only in it, or not at all, measured up to x1.07 apart" in said
    assert "2.4 requests per execution" in said and "less than 2x" in said
    # what the search itself shows: did the 2 instances each have a core?
    assert (
        "Measured in the search (two): the execution a request ran in took 700 ms with 2 instances"
        in said
    )
    assert "shared the cores" in said
    assert (
        "ranked w (max batch size 8 -> 4) first: 8.16 infer/s against the default's 7.60 "
        "(x1.07 infer/s)" in said
    )


def test_the_search_noise_is_none_where_nothing_measured_cannot_differ():
    one_size = search(winner_change="2 instances", winner_batch=8).assign(instances=[2, 1, 2])
    assert lessons.analyzer.search_noise(one_size) is None
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


def test_a_pick_that_led_beyond_the_search_noise_is_not_called_noise():
    rounds = in_rounds({"d": [6.0, 6.1], "w": [6.4, 6.5], "two": [3.5, 3.6]})
    # a max batch size of 2 under 4 clients can matter: the noise is the default's twin alone
    said = lessons.confirm_winner(rounds, search(winner_batch=2, twin=7.7), "w", threads=1)
    assert said.takeaway[2].startswith(
        "Model Analyzer picked max batch size 8 -> 4 from one measurement of each configuration, "
        "x1.07 ahead of the default, beyond the x1.01 between configurations that cannot differ "
        "here: a search's pick holds"
    )


def test_the_rule_reads_the_median_as_the_learner_does_to_two_decimals():
    # 1.26, 1.198, 1.02: shown as x1.20, so judged as x1.20, not a tie beside it
    assert lessons.judge([1.26, 1.198, 1.02]) == "gain"
    assert lessons.judge([1.26, 1.194, 1.02]) == "tie"  # shown as x1.19
    assert lessons.judge([0.7, 0.834, 0.9]) == "loss"  # shown as x0.83


def test_a_max_batch_size_that_cannot_matter_yet_gains_is_explained_by_its_batches():
    rounds = in_rounds(
        {"d": [6.99, 6.82, 7.16], "w": [8.79, 8.18, 7.33]}, batch={"w": 2.6, "d": 2.0}
    )
    conclusion = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=1)
    assert conclusion.figures["verdicts"] == {"max batch size 4": "gain"}
    assert "so the limit did not cause it: its executions carried 2.6 requests each against the " \
        "default's 2.0" in conclusion.text  # fmt: skip
    assert conclusion.takeaway[0].endswith("its executions carried 2.6 requests against 2.0.")
    same = in_rounds({"d": [6.99, 6.82, 7.16], "w": [8.79, 8.18, 7.33]}, batch={"w": 2.0, "d": 2.0})
    assert "measure it again" in lessons.confirm_winner(same, search(), "w").text


def test_the_rounds_table_leads_each_verdict_with_the_word_the_index_shows():
    rounds = in_rounds({"d": [5.0, 5.0], "w": [5.1, 4.9], "two": [3.0, 3.1]})
    table = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=2).table
    verdicts = dict(zip(table["configuration"], table["verdict"], strict=True))
    assert verdicts == {"d": "the reference", "w": "tie: within the noise",
                        "two": "loss: slower in every round"}  # fmt: skip


def test_a_searched_configuration_with_the_defaults_settings_is_said_to_be_one():
    table = search()
    table.loc[table["config"] == "w", "change"] = "none"
    said = lessons.search_findings(table)
    assert "w has the default's own settings: Model Analyzer's search reaches" in said
    assert "has the default's own settings" not in lessons.search_findings(search())
