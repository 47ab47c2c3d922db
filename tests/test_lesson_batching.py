"""Notebook 03's lesson: its words follow its figures (a gain within the measured drift is a tie,
a delay's effect within its rounds' spread is a tie), it keeps at most six headline figures and a
three-sentence takeaway, and its tables speak in words with units."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.errors import ConfigError, InferenceError
from labkit.lessons import batching
from labkit.lessons.takeaway import Takeaway, sentence_count


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


OFF = sweep({1: 1.0, 8: 1.3}, compute_infer_ms={1: 1000.0, 8: 760.0})
ON = sweep(
    {1: 1.5, 4: 4.5, 8: 5.3}, {1: 1.0, 4: 2.7, 8: 4.8}, compute_infer_ms={1: 660, 4: 650, 8: 1000}
)


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
            {"round": r + 1, "setting": batching.NO_DELAY, "requests": 9, "batch": plain[r],
             "queue_ms": 1.0, "compute_ms": plain_ms[r] * plain[r],
             "model_ms_per_request": plain_ms[r], "p50_ms": 450.0, "seconds": 12.0}
        )  # fmt: skip
        rows.append(
            {"round": r + 1, "setting": batching.DELAY, "requests": 9, "batch": delayed[r],
             "queue_ms": 1950.0, "compute_ms": delayed_ms[r] * delayed[r],
             "model_ms_per_request": delayed_ms[r], "p50_ms": 2700.0, "seconds": 13.0}
        )  # fmt: skip
    if lone:
        rows.append(
            {"round": 1, "setting": batching.LONE, "requests": 3, "batch": 1.0,
             "queue_ms": 3250.0, "compute_ms": 650.0, "model_ms_per_request": 650.0,
             "p50_ms": 3900.0, "seconds": 11.7}
        )  # fmt: skip
    return pd.DataFrame(rows)


def test_a_gain_beyond_the_drift_is_explained_by_the_batch_and_the_groups():
    conclusion = batching.batching_conclusion(OFF, ON)
    text = conclusion.text
    assert str(conclusion.figures["batching_gain_at_8_clients"]) == "x4.08 requests/s"
    assert conclusion.figures["requests_per_execution_at_8_clients"] == 4.8
    assert "With 8 clients, batching served 5.30 requests/s against 1.30 without it" in text
    assert (
        "the batch a request ran in, 4.8 requests on average, computed for 1000 ms against 760 ms "
        "for one request alone"
    ) in text
    # 4.8 per execution with 8 clients: closed-loop clients in groups that take turns
    assert "one group waits in the queue while another runs" in text
    # at 1 client the sweeps differ by x1.5: the host's drift, the bar for a verdict
    assert "differ by x1.50: that is this host's drift between them, wider than the lab's x1.20, " \
        "so by the rule above only a change beyond x1.50 counts." in text  # fmt: skip
    assert conclusion.takeaway == (
        "Dynamic batching served 4.1 times as many requests per second with 8 clients "
        "(5.30 against 1.30) by running 4.8 requests per execution.",
    )


def test_a_gain_within_the_drift_at_one_client_is_a_tie():
    off = sweep({1: 1.0, 8: 2.0})
    on = sweep({1: 1.9, 8: 3.6}, {8: 2.0})  # x1.8 at 8, but the sweeps drift x1.9 at 1
    conclusion = batching.batching_conclusion(off, on)
    assert "within x1.90 either way: a tie on this host" in conclusion.text
    assert "within this host's noise" in conclusion.takeaway[0]
    assert "times as many" not in conclusion.takeaway[0]


def test_a_drift_under_the_labs_floor_says_where_the_floor_comes_from():
    off = sweep({1: 1.0, 8: 2.0})
    on = sweep({1: 1.05, 8: 4.0}, {8: 3.0})
    text = batching.batching_conclusion(off, on).text
    assert (
        "differ by x1.05: that is this host's drift between them, within the lab's x1.20, so the "
        "rule above stands as it is." in text
    )


def test_without_a_level_at_one_client_the_bar_is_the_lab_s_gain():
    conclusion = batching.batching_conclusion(sweep({8: 2.0}), sweep({8: 2.3}, {8: 3.0}))
    assert "within x1.20 either way" in conclusion.text and "drift" not in conclusion.text


def test_batching_that_lowered_throughput_is_called_a_loss():
    conclusion = batching.batching_conclusion(sweep({8: 4.0}), sweep({8: 2.0}, {8: 2.0}))
    assert "batching served fewer requests: 2.00 a second against 4.00" in conclusion.text
    assert "fewer requests per second (2.00 against 4.00)" in conclusion.takeaway[0]


def test_clients_that_travel_as_one_group_fill_every_batch_at_once():
    on = sweep({8: 5.3}, {8: 8.0})
    text = batching.batching_conclusion(sweep({8: 1.3}), on).text
    assert "All 8 clients travelled as one group" in text
    assert "every batch was full the moment it formed" in text


def test_the_queue_delay_bought_bigger_batches_and_cost_waiting():
    conclusion = batching.batching_conclusion(OFF, ON, arrivals(), every_s=1.3, delay_us=3_250_000)
    text, figures = conclusion.text, conclusion.figures
    assert (
        "(one every 1.3 s), the 3.25 s queue delay made batches of 3.0 requests instead of 1.0"
        in (text)
    )
    assert "cut the model's time per request from 450 to 245 ms" in text
    assert "the price was 1.95 s more waiting in the queue per request" in text
    assert "each of its 3 requests waited 3.25 s in the queue, the whole delay" in text
    assert figures["requests_per_execution_with_queue_delay"] == 3.0
    assert figures["queue_wait_with_delay_ms"] == 1950
    assert figures["one lone client's queue wait (ms)"] == 3250
    assert str(figures["with queue delay against without"]) == "x0.54 model time per request"
    assert conclusion.takeaway[1] == (
        "With requests arriving apart, a queue delay made batches of 3.0 instead of 1.0 and cut "
        "the model's time per request from 450 to 245 ms, room for more traffic on the same "
        "model, at 1.95 s more waiting in the queue per request (p50 latency 0.45 s against 2.70 s): "
        "worth it where the model's time is scarce, not where latency is."
    )
    assert conclusion.takeaway[2] == (
        "At low load it is pure cost: every request of one client waited 3.25 s in the queue, "
        "the whole delay."
    )


def test_a_delay_effect_within_the_rounds_spread_is_a_tie():
    overlapping = arrivals(plain=(1.0, 2.6), delayed=(2.0, 2.5), delayed_ms=(400.0, 480.0))
    conclusion = batching.batching_conclusion(OFF, ON, overlapping, every_s=1.0)
    assert "within the spread of its 2 rounds" in conclusion.text
    assert "changed within the rounds' spread" in conclusion.text
    assert "bought no bigger batches here" in conclusion.takeaway[1]


def test_the_headline_is_six_figures_three_sentences_and_no_internal_text():
    conclusion = batching.batching_conclusion(
        OFF, ON.assign(stable=[True, True, False]), arrivals(), every_s=1.3, delay_us=3_250_000
    )
    assert len(conclusion.figures) <= 6
    assert not [k for k in conclusion.figures if "_vs_" in k]
    assert sentence_count(conclusion.takeaway) <= 3
    Takeaway.of(conclusion)  # accepted as it is
    shown = conclusion.text + conclusion.table.to_string() + conclusion.table.to_html()
    for internal in ("_vs_", "Ratio(", "Conclusion(", "met:", "not measured", "nan", "NaN"):
        assert internal not in shown
    assert "batching on at 8" in conclusion.text  # the measurement that did not settle
    assert all("_" not in str(column) for column in conclusion.table.columns)
    assert "tutorial's A6000, batching on, 8 clients" in conclusion.table.index
    assert conclusion.table.loc["batching on, 8 clients", "requests/s"] == 5.3


def test_the_tables_speak_in_words_with_units():
    served = pd.DataFrame(
        {"config": ["batching off", "batching on"], "inference_count": [96, 210],
         "execution_count": [96, 94], "avg_batch_size": [1.0, 2.234], "avg_queue_ms": [3436.2, 255.7],
         "avg_compute_infer_ms": [985.8, 808.1]}
    )  # fmt: skip
    served = served.rename_axis(columns="metric")  # as profiling.metrics() names its columns
    tables = [batching.sweep_table(ON), batching.served_table(served)]
    tables.append(batching.arrivals_table(arrivals()))
    for table in tables:
        names = [*table.columns, table.index.name or ""]
        assert all("_" not in name for name in names), names
    assert list(batching.sweep_table(ON)["windows agreed"]) == ["yes"] * 3
    assert batching.served_table(served).loc["batching on", "requests per execution"] == 2.23
    assert batching.served_table(served).columns.name is None  # no stray header over the columns


def test_paced_arrivals_leave_the_model_idle_and_the_delay_spans_two_and_a_half_gaps():
    assert batching.paced_interval_s(650.0) == 1.3
    assert batching.paced_interval_s(601.0) == 1.3  # rounded up: never closer than 2 computes
    assert batching.queue_delay_us(1.3) == 3_250_000
    with pytest.raises(ConfigError, match="> 0 ms"):
        batching.paced_interval_s(float("nan"))


def test_a_verdict_is_the_labs_one_rule_on_the_rounds_ratios():
    assert batching.verdict([3.0, 3.1], [1.0, 1.0]) == 1
    assert batching.verdict([1.0, 1.1], [3.0, 3.1]) == -1
    assert batching.verdict([2.0, 2.4], [1.0, 2.5]) == 0  # x2.0 then x0.96: one round against
    assert batching.verdict([1.1, 1.1], [1.0, 1.0]) == 0  # the same way, but under x1.20


def test_sweeps_with_no_common_level_and_arrivals_without_both_settings_are_refused():
    with pytest.raises(ConfigError, match="share no concurrency"):
        batching.batching_conclusion(sweep({1: 1.0}), sweep({8: 1.0}))
    only_delay = arrivals()[lambda f: f["setting"] != batching.NO_DELAY]
    with pytest.raises(ConfigError, match="both settings"):
        batching.batching_conclusion(OFF, ON, only_delay)


class FakeLoad:
    """Stands in for labkit.load.Load: no server here; what it was asked and what it says."""

    made: list[dict] = []

    def __init__(self, url, model, **options):
        FakeLoad.made.append({"url": url, "model": model, **options})
        self.failed = options.get("model") == "broken" or model == "broken"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def join(self, timeout_s):
        pass

    def summary(self):
        return {"answered": 6, "failed": 1 if self.failed else 0, "p50_ms": 2500.0,
                "seconds": 8.0, "failures_by_cause": {"HTTP 400": 1}}  # fmt: skip


class FakeServer:
    http_url = "127.0.0.1:1"


def test_measure_arrivals_paces_the_load_and_waits_for_triton_to_count_it(monkeypatch):
    counts = iter([0, 3, 6, 6])  # the counters catch up with the answers a moment later

    def metrics(server, since=None):
        n = next(counts) if since is not None else 0
        return pd.DataFrame(
            {"model": ["m"], "inference_count": [n], "avg_batch_size": [3.0],
             "avg_queue_ms": [1500.0], "avg_compute_infer_ms": [900.0]}
        )  # fmt: skip

    monkeypatch.setattr(batching, "Load", FakeLoad)
    monkeypatch.setattr(batching.profiling, "metrics", metrics)
    monkeypatch.setattr(batching.proc.time, "sleep", lambda s: None)  # proc.wait_until polls
    FakeLoad.made.clear()
    row = batching.measure_arrivals(FakeServer(), "m", every_s=0.5, requests=6, prompt="Hi")
    assert FakeLoad.made[0]["rate_per_s"] == 2.0 and FakeLoad.made[0]["max_requests"] == 6
    assert FakeLoad.made[0]["endpoint"] == "infer"
    assert row["batch"] == 3.0 and row["queue_ms"] == 1500.0
    assert row["model_ms_per_request"] == 300.0  # one execution of 900 ms served 3
    assert row["seconds"] == 8.0  # the last answer came after 6 gaps of 0.5 s: its own span
    FakeLoad.made.clear()
    row = batching.measure_arrivals(FakeServer(), "m", every_s=2.0, requests=6, prompt="Hi")
    # 6 requests paced 2 s apart, all answered 8 s after the first send: counted over their
    # 6 gaps (12 s, 0.5 a second, the pace), not the 5 gaps and an answer before the last
    assert row["seconds"] == 12.0
    with pytest.raises(InferenceError, match="1 of 6 requests to 'broken' failed"):
        batching.measure_arrivals(FakeServer(), "broken", every_s=None, requests=6, prompt="Hi")
    with pytest.raises(ConfigError, match="every_s=0"):
        batching.measure_arrivals(FakeServer(), "m", every_s=0, requests=6, prompt="Hi")


def test_each_delay_setting_has_one_name_in_every_table_and_the_paced_rate_is_the_pace():
    rows = arrivals().assign(seconds=lambda f: f["requests"] * 1.3)  # kept up with the pace
    rows.loc[rows["setting"] == batching.LONE, "seconds"] = 11.7
    conclusion = batching.batching_conclusion(OFF, ON, rows, every_s=1.3, delay_us=3_250_000)
    measured = batching.arrivals_table(rows).index
    assert set(measured) == {batching.NO_DELAY, batching.DELAY, batching.LONE}
    for setting in measured:  # the same words in the conclusion's table
        assert setting in conclusion.table.index
    assert conclusion.table.loc[batching.NO_DELAY, "requests/s"] == 0.77  # 1 / 1.3 s
    assert conclusion.table.loc[batching.DELAY, "requests/s"] == 0.77
    assert (
        "as many requests a second as arrived (0.77 and 0.77, at a pace of 0.77;" in conclusion.text
    )


def test_bigger_batches_that_cost_the_model_as_much_per_request_bought_nothing():
    same_cost = arrivals(delayed_ms=(440.0, 460.0))  # batches of 3, the model's time unchanged
    line = batching.batching_conclusion(OFF, ON, same_cost, every_s=1.0).takeaway[1]
    assert line.startswith("With requests arriving apart, a queue delay made batches of 3.0")
    assert "did not fall beyond the noise: it bought nothing here for 1.95 s more waiting" in line
