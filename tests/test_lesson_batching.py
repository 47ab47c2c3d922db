"""Notebook 03's verdicts, figures, tables and takeaway: batching is judged beyond the drift its two
sweeps show at 1 client, the queue delay round by round, and its price is the whole p50 change
split into the parts Triton measured."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.errors import ConfigError
from labkit.lessons import Takeaway, batching
from labkit.lessons.takeaway import sentence_count
from labkit.profiling.arrivals import DELAY, LONE, NO_DELAY, Served


def sweep(
    rates: dict[int, float], batch: dict[int, float] | None = None, **columns
) -> pd.DataFrame:
    """A perf_analyzer sweep: one row per number of clients."""
    rows = []
    for c, rate in rates.items():
        row = {
            "concurrency": c,
            "throughput": rate,
            "p50_ms": 1000.0 * c / rate,
            "p95_ms": 1100.0 * c / rate,
            "p99_ms": 1200.0 * c / rate,
            "queue_ms": 0.0 if c == 1 else 400.0,
            "compute_infer_ms": 700.0,
            "avg_batch_size": (batch or {}).get(c, 1.0),
            "request_count": 48,
            "stable": True,
        }
        row.update({k: v[c] for k, v in columns.items()})
        rows.append(row)
    return pd.DataFrame(rows)


OFF = sweep({1: 1.0, 8: 1.3})
ON = sweep({1: 1.5, 4: 4.5, 8: 5.3}, {1: 1.0, 4: 2.7, 8: 4.8})


def arrivals(
    plain: tuple[float, float] = (1.0, 1.0),
    delayed: tuple[float, float] = (3.0, 3.0),
    plain_ms: tuple[float, float] = (430.0, 470.0),
    delayed_ms: tuple[float, float] = (240.0, 250.0),
    lone: bool = True,
) -> pd.DataFrame:
    """delay_rounds' rows: two alternating rounds, then a lone client."""
    rows = []
    for r in (0, 1):
        rows.append(
            {"round": r + 1, "setting": NO_DELAY, "requests": 9, "batch": plain[r],
             "queue_ms": 10.0, "run_ms": 450.0, "compute_ms": plain_ms[r] * plain[r],
             "model_ms_per_request": plain_ms[r], "mean_ms": 480.0, "p50_ms": 470.0,
             "seconds": 11.7}
        )  # fmt: skip
        rows.append(
            {"round": r + 1, "setting": DELAY, "requests": 9, "batch": delayed[r],
             "queue_ms": 1950.0, "run_ms": 750.0, "compute_ms": delayed_ms[r] * delayed[r],
             "model_ms_per_request": delayed_ms[r], "mean_ms": 2740.0, "p50_ms": 2700.0,
             "seconds": 11.7}
        )  # fmt: skip
    if lone:
        rows.append(
            {"round": 1, "setting": LONE, "requests": 3, "batch": 1.0, "queue_ms": 3250.0,
             "run_ms": 650.0, "compute_ms": 650.0, "model_ms_per_request": 650.0,
             "mean_ms": 3920.0, "p50_ms": 3900.0, "seconds": 11.7}
        )  # fmt: skip
    return pd.DataFrame(rows)


def verdicts(conclusion) -> dict[tuple[str, str], str]:
    return {(v.comparison, v.of): v.word for v in conclusion.verdicts}


def test_a_gain_beyond_the_drift_at_one_client_is_a_gain_and_the_takeaway_says_so():
    conclusion = batching.batching_conclusion(OFF, ON)
    assert verdicts(conclusion) == {
        ("batching on against off, 1 client (nothing to group)", "requests/s"): "gain",
        ("batching on against off, 8 clients", "requests/s"): "gain",
    }
    gain = conclusion.verdicts[-1]
    assert gain.noise == 1.5 and round(gain.median, 2) == 4.08  # the drift is the bar: x1.50
    assert str(conclusion.figures["batching on against off, 8 clients"]) == "x4.08 requests/s"
    assert conclusion.figures["requests per execution, 8 clients"] == 4.8
    assert conclusion.takeaway == (
        "Dynamic batching against none at 8 clients: gain, x4.08 requests/s, in batches of 4.8.",
    )


@pytest.mark.parametrize(
    ("on_1", "on_8", "word"),
    [
        (1.9, 3.6, "tie"),  # x1.80 at 8 clients, inside a drift of x1.90 at 1
        (1.0, 2.5, "gain"),  # x1.25 beyond x1.20, no drift
        (1.0, 2.4, "gain"),  # x1.20: the edge counts, as the learner reads it
        (1.0, 2.38, "tie"),  # x1.19
        (1.0, 1.66, "loss"),  # x0.83
        (1.0, 1.68, "tie"),  # x0.84
    ],
)
def test_batching_is_judged_at_the_edges_of_the_rule_and_the_drift(on_1, on_8, word):
    conclusion = batching.batching_conclusion(sweep({1: 1.0, 8: 2.0}), sweep({1: on_1, 8: on_8}))
    assert conclusion.verdicts[-1].word == word
    said = Takeaway.of(conclusion).lines[0]
    assert f": {word}, x{on_8 / 2:.2f} requests/s" in said


def test_without_a_level_at_one_client_there_is_one_verdict_against_the_labs_bar():
    conclusion = batching.batching_conclusion(sweep({8: 2.0}), sweep({8: 2.3}, {8: 3.0}))
    assert [(v.comparison, v.noise, v.word) for v in conclusion.verdicts] == [
        ("batching on against off, 8 clients", 1.0, "tie")
    ]


def test_the_queue_delay_is_judged_round_by_round_and_its_price_is_the_whole_p50_change():
    conclusion = batching.batching_conclusion(OFF, ON, arrivals())
    assert verdicts(conclusion) == {
        **verdicts(batching.batching_conclusion(OFF, ON)),
        ("queue delay against none, paced", "requests per execution"): "gain",
        ("queue delay against none, paced", "requests per second of model time"): "gain",
    }
    cheaper = conclusion.verdicts[-1]
    assert [round(r, 2) for r in cheaper.ratios] == [1.79, 1.88]  # 430/240, 470/250
    figures = conclusion.figures
    assert (
        str(figures["queue delay against none, paced"]) == "x1.84 requests per second of model time"
    )
    assert figures["requests per execution with the queue delay"] == 3.0
    assert figures["p50 latency the queue delay added (s)"] == pytest.approx(2.23)
    assert figures["one lone client's queue wait (s)"] == 3.25
    assert len(figures) <= 6
    price = batching.delay_price(arrivals())
    assert price.loc["change"].to_dict() == {
        "mean latency (ms)": 2260, "queue wait (ms)": 1940, "its batch's run (ms)": 300,
        "the rest (ms)": 20, "p50 latency (ms)": 2230,
    }  # fmt: skip
    parts = price[["queue wait (ms)", "its batch's run (ms)", "the rest (ms)"]].sum(axis=1)
    assert (parts == price["mean latency (ms)"]).all()  # the parts add up to the latency
    delay, price = conclusion.takeaway[1:]  # the verdict word, its number, the batches
    assert (
        ": gain, x1.84 requests per second of model time" in delay and "3.0 instead of 1.0" in delay
    )
    assert [word for word in price.split() if word.startswith("+")] == ["+2.23", "+1.94", "+0.30"]
    assert sentence_count(conclusion.takeaway) == 3
    assert str(conclusion).count("\n") == len(conclusion.verdicts) - 1  # one sentence a verdict


def test_a_delay_effect_one_round_contradicts_is_a_tie():
    overlapping = arrivals(plain=(1.0, 2.6), delayed=(2.0, 2.5), delayed_ms=(400.0, 480.0))
    conclusion = batching.batching_conclusion(OFF, ON, overlapping)
    assert [v.word for v in conclusion.verdicts[-2:]] == ["tie", "tie"]
    assert conclusion.takeaway[1].startswith("A queue delay with paced arrivals: tie, x1.03")


def test_the_verdict_and_headline_tables_have_their_rows_and_columns():
    conclusion = batching.batching_conclusion(OFF, ON, arrivals())
    shown = conclusion.verdict_table()
    assert list(shown.columns) == ["comparison", "of", "each round", "median", "spread", "verdict"]
    assert shown["each round"].iloc[-1] == "x1.79, x1.88"
    table = conclusion.table
    assert list(table.index) == [
        "batching off, 8 clients", "batching on, 8 clients", NO_DELAY, DELAY, LONE,
        "tutorial's A6000, batching off, 1 client", "tutorial's A6000, batching on, 8 clients",
    ]  # fmt: skip
    assert list(table.columns) == [
        "requests/s", "requests per execution", "queue wait (ms)", "p50 latency (ms)"
    ]  # fmt: skip
    assert table.loc["batching on, 8 clients", "requests/s"] == 5.3
    assert table.loc[NO_DELAY, "requests/s"] == 0.77  # 9 requests over 11.7 s: the pace
    assert table.loc["tutorial's A6000, batching on, 8 clients", "queue wait (ms)"] == "–"


def test_the_tables_speak_in_words_with_units():
    served = pd.DataFrame(
        {"config": ["batching off", "batching on"], "inference_count": [96, 210],
         "execution_count": [96, 94], "avg_batch_size": [1.0, 2.234], "avg_queue_ms": [3436.2, 255.7],
         "avg_compute_infer_ms": [985.8, 808.1]}
    ).rename_axis(columns="metric")  # fmt: skip
    costs = Served(10, 0.0, 0.0, {1: (2, 740.0), 4: (2, 1300.0)}, 10.0)
    tables = [
        batching.sweep_table(ON),
        batching.served_table(served),
        batching.arrivals_table(arrivals()),
        batching.batch_cost_table(costs),
        batching.delay_price(arrivals()),
    ]
    for table in tables:
        names = [*table.columns, table.index.name or ""]
        assert all("_" not in name for name in names), names
        assert table.columns.name is None
    assert list(tables[0]["windows agreed"]) == ["yes"] * 3
    assert tables[1].loc["batching on", "requests per execution"] == 2.23
    assert tables[2]["model time per request (ms)"].tolist() == [430, 240, 470, 250, 650]


def test_the_batch_cost_table_counts_each_execution_once():
    # 2 runs of 1 request (370 ms each) and 2 of 4 (650 ms each) in 10 s: 10 requests
    costs = Served(10, 0.0, 0.0, {1: (2, 740.0), 4: (2, 1300.0)}, 10.0)
    table = batching.batch_cost_table(costs)
    assert table.to_dict("index") == {
        "1": {"executions": 2, "one execution (ms)": 370, "model time per request (ms)": 370,
              "share of the time computing (%)": 7.4},
        "4": {"executions": 2, "one execution (ms)": 650, "model time per request (ms)": 162,
              "share of the time computing (%)": 13.0},
        "all": {"executions": 4, "one execution (ms)": 510, "model time per request (ms)": 204,
                "share of the time computing (%)": 20.4},
    }  # fmt: skip


def test_sweeps_with_no_common_level_and_arrivals_without_both_settings_are_refused():
    with pytest.raises(ConfigError, match="share no concurrency"):
        batching.batching_conclusion(sweep({1: 1.0}), sweep({8: 1.0}))
    only_delay = arrivals()[lambda f: f["setting"] != NO_DELAY]
    with pytest.raises(ConfigError, match="both settings"):
        batching.batching_conclusion(OFF, ON, only_delay)
