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


def search(winner_change="none", winner_batch=8, default_batch=2.4, default_tput=7.6):
    """:func:`labkit.profiling.analyzer.ranked`'s table of a search: the winner, the default and
    a configuration with 2 instances, measured once each at 4 clients."""
    rows = [
        ("w", winner_change, 1, winner_batch, 8.16, 2.5, 330.0, False),
        ("d", "none", 1, 8, default_tput, default_batch, 340.0, True),
        ("two", "2 instances", 2, 8, 5.9, 1.6, 700.0, False),
    ]
    columns = ["config", "change", "instances", "max_batch_size", "throughput"]
    columns += ["avg_batch_size", "compute_infer_ms", "is_default"]
    return pd.DataFrame(rows, columns=columns).assign(concurrency=4)


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


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [([1.2, 1.15, 1.3], "gain"), ([1.2, 1.05, 1.3], "tie"), ([0.6, 0.7, 0.85], "loss"),
     ([0.6, 0.95, 0.6], "tie"), ([1.0, 1.0], "tie")],
)  # fmt: skip
def test_a_gain_or_a_loss_needs_every_round_beyond_the_noise_floor(ratios, expected):
    assert lessons.analyzer.verdict(ratios) == expected


def test_one_round_gives_no_verdict():
    with pytest.raises(ConfigError, match="two or more rounds"):
        lessons.analyzer.verdict([1.5])


def test_a_winner_with_the_defaults_settings_ties_and_two_instances_lose_with_the_reason():
    rounds = in_rounds(
        {"d": [6.0, 5.8, 6.2], "w": [5.9, 6.1, 6.0], "two": [3.8, 3.5, 4.1]},
        batch={"two": 1.6},
        ms={"two": 700.0},
    )
    conclusion = lessons.confirm_winner(rounds, search(), "w", threads=1, cores=2)
    said = conclusion.text
    assert (
        "winner w gave x0.98 infer/s against the default (x0.97 to x1.05 over 3 rounds): a tie"
        in said
    )
    assert "the default's own settings" in said
    assert "two (2 instances) gave x0.63 infer/s (x0.60 to x0.66 over 3 rounds): slower in" in said
    # the shared explanation of instances, from the default's requests per execution
    assert "keeps 1 of the 2 cores busy" in said and "2.4 requests per execution" in said
    assert "took 700 ms with 2 instances against 340 ms with 1" in said
    assert "shared the cores" in said
    figures = conclusion.figures
    assert (figures["winner"], figures["winner_verdict"], figures["2_instances_verdict"]) == (
        "w",
        "tie",
        "loss",
    )
    assert str(figures["2_instances_against_default"]) == "x0.63 infer/s"
    assert len(figures) <= 6
    assert sentence_count(conclusion.takeaway) <= 3
    assert conclusion.takeaway[1].startswith("Two instances lost (x0.63 infer/s)")
    assert conclusion.takeaway[2] == (
        "Model Analyzer measures each configuration once (the default's own settings gave 7.6 "
        "and 8.2 infer/s in the same search), so measure its winner again beside the default, "
        "in turns, before you deploy it."
    )
    shown = said + conclusion.table.to_string() + " ".join(conclusion.table.columns)
    assert "_vs_" not in shown and "Ratio(" not in shown


def test_a_winner_that_changes_only_a_max_batch_size_the_clients_never_reach_ties_and_says_so():
    rounds = in_rounds({"d": [6.0, 5.8], "w": [6.1, 5.7]})
    conclusion = lessons.confirm_winner(
        rounds, search("max batch size 8 -> 4", winner_batch=4), "w", threads=1, cores=2
    )
    assert "changes only the max batch size (8 -> 4)" in conclusion.text
    assert "4 clients never send more requests at once than either allows" in conclusion.text
    assert "tied the default" in conclusion.takeaway[0]


def test_a_winner_faster_in_every_round_is_a_gain_and_one_round_within_the_floor_a_tie():
    gain = lessons.confirm_winner(in_rounds({"d": [5.0, 5.0], "w": [6.0, 5.8]}), search(), "w")
    assert gain.figures["winner_verdict"] == "gain"
    assert "faster in every round" in gain.text and "tied" not in gain.takeaway[0]
    tie = lessons.confirm_winner(in_rounds({"d": [5.0, 5.0], "w": [6.0, 5.2]}), search(), "w")
    assert tie.figures["winner_verdict"] == "tie"


def test_the_search_and_the_rounds_are_set_side_by_side_with_the_time_of_one_execution():
    drifted = lessons.confirm_winner(
        in_rounds({"d": [5.7, 5.9], "w": [5.8, 5.8]}), search(default_tput=7.6), "w"
    )
    assert "The search measured the default at 7.60 infer/s, the rounds at 5.80" in drifted.text
    assert "one execution took 340 ms in the search against 340 ms" in drifted.text
    agreed = lessons.confirm_winner(
        in_rounds({"d": [7.5, 7.7], "w": [7.4, 7.8]}), search(default_tput=7.6), "w"
    )
    assert "agrees with the rounds'" in agreed.text


def test_a_search_that_kept_the_default_says_it_found_nothing_faster():
    table = search().assign(is_default=[True, False, False])  # the winner is the default
    rounds = in_rounds({"w": [6.0, 6.1], "two": [3.5, 3.6]})
    conclusion = lessons.confirm_winner(rounds, table, "w", threads=1, cores=2)
    assert (
        conclusion.takeaway[0] == "Model Analyzer's search found nothing faster than the default."
    )
    assert "winner_verdict" not in conclusion.figures


def test_the_rounds_must_measure_the_default_and_the_winner():
    with pytest.raises(ConfigError, match="must measure the default"):
        lessons.confirm_winner(in_rounds({"w": [6.0, 6.1]}), search(), "w")


def test_the_search_findings_give_each_instance_count_the_mechanism_and_the_pick():
    said = lessons.search_findings(search(), threads=1, cores=2)
    assert "measured 7.60 to 8.16 infer/s with 1 instance (w, d), and 5.90 infer/s with 2" in said
    # 4 clients cannot fill a max batch size of 8: no limit on the list can differ
    assert "with 4 clients no execution can take more than 4 requests" not in said
    assert "2.4 requests per execution" in said and "expect no gain, or a loss" in said
    assert "ranked w first: 8.16 infer/s against the default's 7.60 (x1.07 infer/s)" in said
    # w has the default's own settings: two measurements of one configuration, the search's noise
    assert "measured twice in one search, gave 8.16 and 7.60 infer/s" in said
    batch_sizes = search("max batch size 8 -> 4", winner_batch=4)
    assert "A max batch size of 4 or 8 makes no difference here" in lessons.search_findings(
        batch_sizes, threads=1, cores=2
    )


def test_a_ratio_reads_the_same_in_words_in_figures_json_and_in_the_index(tmp_path):
    from labkit import lab
    from labkit.lessons import Ratio, figure_text

    gain = Ratio.between(36.4, 20.0, "infer/s")
    assert str(gain) == "x1.82 infer/s"
    recorded = lab.record(tmp_path, winner_vs_default=gain)
    assert recorded["winner_vs_default"] == {"ratio": 1.82, "of": "infer/s"}
    assert figure_text(recorded["winner_vs_default"]) == str(gain)
    assert figure_text(3) == "3"
    assert math.isnan(Ratio.between(1.0, 0.0, "infer/s").value)
