"""The conclusions notebooks 03 and 04 print: their figures come from the measurements given, and
their words follow those figures (a loss is never called a gain, a tie never a win)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from labkit import lessons
from labkit.errors import ConfigError


def sweep(
    throughputs: dict[int, float],
    p99: dict[int, float],
    batch: float = 1.0,
    compute_ms: float | None = None,
    **extra,
):
    rows = [
        {
            "concurrency": c,
            "throughput": t,
            "p95_ms": p99[c] * 0.9,
            "p99_ms": p99[c],
            "avg_batch_size": batch,
            "stable": True,
            **({"compute_infer_ms": compute_ms} if compute_ms is not None else {}),
            **extra,
        }
        for c, t in throughputs.items()
    ]
    return pd.DataFrame(rows)


def shown(figures: dict) -> dict:
    return {
        k: lessons.figure_text(v.as_figure() if hasattr(v, "as_figure") else v)
        for k, v in figures.items()
    }


def test_batching_figures_are_taken_at_the_highest_shared_level_and_say_their_window():
    off = sweep({1: 2.0, 8: 2.5}, {1: 500, 8: 3000}, compute_ms=350)
    on = sweep({1: 2.0, 8: 8.0}, {1: 520, 8: 1200}, batch=5.0, compute_ms=700)
    delayed = sweep({8: 10.0}, {8: 1000}, batch=8.0)
    conclusion = lessons.batching_conclusion(
        off, on, delayed, sweep_batch=1.9, queue_delay_us=700_000
    )
    assert shown(conclusion.figures) == {
        "throughput_ratio_c8": "x3.20 infer/s",
        "p99_ratio_c8": "x0.40 p99 latency",
        "avg_batch_size_c8": "5.0",
        "avg_batch_size_on_sweep": "1.9",
        "compute_per_request_ratio_c8": "x0.40 compute per request",
        "delayed_throughput_ratio_c8": "x4.00 infer/s",
        "delayed_avg_batch_size_c8": "8.0",
    }
    text = conclusion.text
    assert "At concurrency 8 (perf_analyzer's measurement at that level)" in text
    assert (
        ": x3.20 infer/s." in text
        and "5.00 requests per call on average in that measurement" in text
    )
    assert "Over the whole batching-on sweep (Triton's counters across concurrency 1, 8" in text
    assert "the average batch was 1.90" in text
    # 700 ms for a batch of 5 against 350 ms alone: twice one request, not "little more"
    assert "took 700 ms of compute against 350 ms for one request alone (x2.00)" in text
    assert "less than its requests one by one: x0.40 compute per request" in text
    assert "little more than one" not in text
    assert "Here too, at 8, batching multiplied throughput (x3.20 infer/s)" in text
    assert "With a queue delay of 700 ms (its own perf_analyzer run at concurrency 8)" in text
    assert "x4.00 infer/s against batching off at 8" in text
    assert list(conclusion.table["concurrency"]) == [1, 8]


def test_the_tutorials_unbatched_and_batched_figures_sit_in_separate_columns():
    off = sweep({1: 2.0, 4: 2.2, 8: 2.5}, {1: 500, 4: 1800, 8: 3000})
    on = sweep({1: 2.0, 4: 5.0, 8: 8.0}, {1: 520, 4: 900, 8: 1200}, batch=5.0)
    table = lessons.batching_conclusion(off, on).table.set_index("concurrency")
    assert "tutorial infer/s" not in table
    assert table.loc[1, "tutorial off infer/s"] == 21.38 and math.isnan(
        table.loc[1, "tutorial on infer/s"]
    )
    assert table.loc[8, "tutorial on infer/s"] == 46.21 and math.isnan(
        table.loc[8, "tutorial off infer/s"]
    )
    text = lessons.batching_conclusion(off, on).text
    assert (
        "21.4 infer/s without batching at concurrency 1 and 46.2 with it at concurrency 8" in text
    )


def test_a_batch_that_costs_little_more_than_one_request_is_called_so():
    off = sweep({8: 2.5}, {8: 3000}, compute_ms=400)
    on = sweep({8: 12.0}, {8: 900}, batch=6.0, compute_ms=440)
    text = lessons.batching_conclusion(off, on).text
    assert "(x1.10): a batch cost little more than one request, x0.18 compute per request" in text


def test_batching_within_the_noise_is_a_tie_not_the_tutorials_lesson():
    off = sweep({8: 4.0}, {8: 2000}, compute_ms=400)
    on = sweep({8: 4.2}, {8: 2100}, batch=1.3, compute_ms=520)
    conclusion = lessons.batching_conclusion(off, on)
    assert str(conclusion.figures["throughput_ratio_c8"]) == "x1.05 infer/s"
    assert "Here too" not in conclusion.text
    assert "batching gave x1.05 infer/s, within x1.20 either way of no change" in conclusion.text
    assert "a tie, not the tutorial's gain" in conclusion.text
    assert "a request cost about as much in a batch as alone (x1.00 compute per request)" in (
        conclusion.text
    )


def test_batching_that_lowered_throughput_is_called_a_loss():
    off = sweep({8: 4.0}, {8: 2000}, compute_ms=400)
    on = sweep({8: 2.0}, {8: 4000}, batch=2.0, compute_ms=1200)
    text = lessons.batching_conclusion(off, on).text
    assert "batching lowered throughput (x0.50 infer/s)" in text
    assert "a request cost more in a batch than alone (x1.50 compute per request)" in text
    assert "Here too" not in text and "tie" not in text


def test_batching_names_the_measurements_that_did_not_settle():
    off = sweep({8: 4.0}, {8: 2000})
    on = sweep({8: 12.0}, {8: 900}, batch=6.0).assign(stable=[False])
    assert "on at 8" in lessons.batching_conclusion(off, on).text


def test_sweeps_with_no_common_level_are_refused():
    with pytest.raises(ConfigError, match="share no concurrency"):
        lessons.batching_conclusion(sweep({1: 1.0}, {1: 1}), sweep({8: 1.0}, {8: 1}))


def repeats(name: str, per_level: dict[int, list[float]]) -> pd.DataFrame:
    rows = [
        {"config": name, "concurrency": c, "repeat": i, "throughput": t}
        for c, runs in per_level.items()
        for i, t in enumerate(runs)
    ]
    return pd.DataFrame(rows)


def test_a_winner_beyond_the_noise_is_better_and_the_words_count_busy_cores():
    default = repeats("default", {2: [4.0, 4.2], 4: [5.5, 5.6]})
    winner = repeats("w", {2: [7.7, 7.8], 4: [9.2, 9.3]})
    conclusion = lessons.confirm_winner(default, winner, "w", instances=(1, 2), threads=1, cores=2)
    assert conclusion.figures["verdict"] == "better"
    assert conclusion.figures["noise_band"] == pytest.approx(0.049, abs=0.001)
    # one way to state the gain: a ratio with its unit, per level and overall
    assert "at concurrency 2 x1.89 infer/s" in conclusion.text
    assert "at concurrency 4 x1.67 infer/s" in conclusion.text
    assert str(conclusion.figures["winner_vs_default"]) == "x1.78 infer/s"
    assert "%" not in conclusion.text.split("noise band")[0]
    assert "can keep 1 of the 2 cores busy, the winner's 2 can keep 2" in conclusion.text
    assert "put idle cores to work" in conclusion.text
    assert "compete" not in conclusion.text


def test_a_winner_within_the_noise_is_not_called_better():
    default = repeats("default", {4: [5.0, 6.0]})
    winner = repeats("w", {4: [5.4, 6.2]})
    conclusion = lessons.confirm_winner(default, winner, "w", instances=(2, 2), threads=1, cores=2)
    assert conclusion.figures["verdict"] == "not better beyond the noise"
    assert "instances alone cannot gain here" in conclusion.text


def test_a_winner_that_trails_beyond_the_noise_is_called_slower():
    default = repeats("default", {4: [6.0, 6.1]})
    winner = repeats("w", {4: [4.0, 4.1]})
    assert lessons.confirm_winner(default, winner, "w").figures["verdict"] == "slower"


def test_one_measurement_per_configuration_gives_no_noise_band():
    with pytest.raises(ConfigError, match="two or more"):
        lessons.confirm_winner(repeats("d", {4: [5.0]}), repeats("w", {4: [6.0]}), "w")


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
