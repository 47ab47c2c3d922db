"""The verdict every judging notebook shows: its table and its one sentence."""

from __future__ import annotations

import math

from labkit import lessons


def test_a_verdict_reads_its_median_spread_and_word_from_the_rounds():
    verdict = lessons.Verdict("two instances against one", (1.7, 1.9, math.nan, 1.82), "infer/s")
    assert verdict.measured == (1.7, 1.9, 1.82)
    assert verdict.median == 1.82
    assert verdict.word == "gain"
    assert verdict.spread() == "x1.70 to x1.90"
    assert str(verdict.ratio) in verdict.sentence() and "gain" in verdict.sentence()
    assert "3 rounds" in verdict.sentence()


def test_a_round_the_other_way_makes_a_tie_and_the_table_shows_every_round():
    verdicts = [
        lessons.Verdict("on against off", (1.5, 0.9, 1.6), "infer/s"),
        lessons.Verdict("cache against none", (0.5, 0.6, 0.55), "p50 latency"),
    ]
    table = lessons.verdict_table(verdicts)
    assert list(table["verdict"]) == ["tie", "loss"]
    assert list(table["median"]) == [1.5, 0.55]
    assert table["each round"][0] == "x1.50, x0.90, x1.60"
    assert list(table.columns) == ["comparison", "of", "each round", "median", "spread", "verdict"]


def test_a_verdict_with_no_measured_round_says_so():
    verdict = lessons.Verdict("replicas against one", (math.nan,), "infer/s")
    assert verdict.word == "tie"
    assert verdict.sentence().endswith("not measured.")
    assert math.isnan(lessons.verdict_table([verdict])["median"][0])


def test_the_noise_a_run_measured_raises_the_bar():
    assert lessons.Verdict("a against b", (1.25, 1.3), "infer/s").word == "gain"
    assert lessons.Verdict("a against b", (1.25, 1.3), "infer/s", noise=1.4).word == "tie"
