"""The lab's charts: round ticks (two axes of a chart on one grid), one colour per configuration
in every chart and legend, titles that fit, and facet labels without column names."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import plots
from labkit.errors import ConfigError


def frame(config: str, rates: list[float], p99: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "config": config,
            "concurrency": [1, 4, 8],
            "throughput": rates,
            "p99_ms": p99,
            "queue_ms": [0.0, 300.0, 500.0],
            "compute_input_ms": [0.1, 0.1, 0.1],
            "compute_infer_ms": [650.0, 700.0, 1000.0],
            "compute_output_ms": [0.2, 0.2, 0.2],
            "avg_batch_size": [1.0, 2.7, 4.83],
        }
    )


OFF = frame("batching off", [0.98, 0.96, 1.33], [1354.0, 5780.0, 9209.0])
ON = frame("batching on", [1.51, 4.48, 5.27], [1445.0, 1444.0, 2096.0])


@pytest.mark.parametrize(
    ("top", "intervals", "step"),
    [(6.8, 5, 2), (1538, 5, 500), (0.9, 5, 0.2), (10, 5, 2), (5.27, 6, 1), (9209, 4, 2500)],
)
def test_a_step_is_one_two_two_and_a_half_or_five_times_a_power_of_ten(top, intervals, step):
    assert plots.nice_step(top, intervals) == pytest.approx(step)


def is_round(value: float) -> bool:
    mantissa = f"{value:e}".split("e")[0].rstrip("0").rstrip(".")
    return mantissa in {"1", "2", "2.5", "5"}


def test_both_axes_of_the_batching_chart_tick_at_round_numbers_on_one_grid():
    fig = plots.batching_comparison(OFF, ON)
    left, right = fig.layout.yaxis, fig.layout.yaxis2
    for axis in (left, right):
        assert axis.tickmode == "linear" and axis.tick0 == 0 and is_round(axis.dtick)
        assert axis.range[0] == 0
    # the same number of intervals: every tick of one axis sits on a grid line of the other
    assert left.range[1] / left.dtick == right.range[1] / right.dtick
    assert left.range[1] >= 5.27 and right.range[1] >= 9209
    assert left.range[1] < 2 * 5.27 and right.range[1] < 2 * 9209  # no half-empty chart


def test_the_batching_chart_draws_latency_in_a_panel_of_its_own_never_over_the_bars():
    fig = plots.batching_comparison(OFF, ON)
    panels = {(t.type, t.xaxis, t.yaxis) for t in fig.data}
    assert panels == {("bar", "x", "y"), ("scatter", "x2", "y2")}
    assert fig.layout.yaxis2.overlaying is None  # side by side, not one over the other
    assert {a.text for a in fig.layout.annotations} == {
        "throughput: more is better",
        "p99 latency: less is better",
    }


def test_a_configuration_keeps_its_colour_in_every_chart_and_legend():
    comparison = plots.batching_comparison(OFF, ON)
    lines = plots.throughput_vs_latency([OFF, ON])
    batches = plots.batch_sizes([OFF, ON])

    def colour_of(fig, name):
        for trace in fig.data:
            if trace.name.startswith(name):
                return getattr(trace.marker, "color", None) or trace.line.color
        raise AssertionError(f"no trace named {name}")

    for name in ("batching off", "batching on"):
        seen = {colour_of(fig, name) for fig in (comparison, lines, batches)}
        assert seen == {plots.KNOWN_COLOURS[name]}
    assert plots.colours(["b", "a", "batching on"]) == {
        "a": plots.PALETTE[0],
        "b": plots.PALETTE[1],
        "batching on": plots.KNOWN_COLOURS["batching on"],
    }


def test_a_long_title_is_broken_onto_lines_that_fit():
    title = "Throughput against p99 latency for every configuration Model Analyzer searched"
    fig = plots.throughput_vs_latency([OFF, ON], title=title)
    lines = fig.layout.title.text.split("<br>")
    assert len(lines) == 2 and all(len(line) <= plots.TITLE_WIDTH for line in lines)
    assert " ".join(lines) == title
    assert fig.layout.margin.t >= 100  # room above the plot for the second line
    assert plots.fit_title("Short") == "Short"


def test_facets_are_labelled_by_configuration_alone():
    fig = plots.latency_breakdown([OFF, ON])
    labels = {a.text for a in fig.layout.annotations}
    assert labels == {"batching off", "batching on"}
    assert fig.layout.yaxis.dtick and is_round(fig.layout.yaxis.dtick)
    assert fig.layout.yaxis2.dtick == fig.layout.yaxis.dtick  # the second panel on the same grid
    parts = {t.name: t.marker.color for t in fig.data}
    assert parts["queue"] == plots.PART_COLOURS["queue"]


def test_the_queue_delay_chart_stacks_the_wait_on_the_compute_and_says_the_batch():
    rows = pd.DataFrame(
        {
            "setting": ["paced, no delay", "paced, queue delay"] * 2 + ["1 client, queue delay"],
            "queue_ms": [0.0, 1900.0, 0.0, 2000.0, 3250.0],
            "compute_ms": [450.0, 800.0, 470.0, 820.0, 650.0],
            "batch": [1.0, 3.0, 1.0, 3.0, 1.0],
        }
    )
    fig = plots.queue_delay(rows)
    queue, compute, labels = fig.data
    assert list(queue.x) == ["paced, no delay", "paced, queue delay", "1 client, queue delay"]
    assert list(queue.y) == [0.0, 1950.0, 3250.0] and list(compute.y) == [460.0, 810.0, 650.0]
    assert list(labels.text) == [
        "1.0 per execution,<br>460 ms of the model's time each",
        "3.0 per execution,<br>270 ms of the model's time each",
        "1.0 per execution,<br>650 ms of the model's time each",
    ]
    assert is_round(fig.layout.yaxis.dtick) and fig.layout.yaxis.range[1] >= 3900
    with pytest.raises(ConfigError, match="'batch'"):
        plots.queue_delay(rows.drop(columns="batch"))


def test_levels_read_in_numeric_order_whichever_configuration_measured_them():
    fewer = OFF[OFF["concurrency"] != 4]  # batching off measured at 1 and 8 only
    for fig in (
        plots.batching_comparison(fewer, ON),
        plots.latency_breakdown([fewer, ON]),
        plots.batch_sizes([fewer, ON]),
    ):
        axes = [fig.layout[name] for name in ("xaxis", "xaxis2") if name in fig.layout]
        assert list(axes[-1].categoryarray) == ["1", "4", "8"]  # batching on's, in the breakdown
        assert fig.layout.xaxis.title.text == plots.CLIENTS


def test_a_breakdown_panel_shows_only_the_levels_its_configuration_measured():
    fewer = OFF[OFF["concurrency"] != 4]  # no empty slot at 4 in batching off's panel
    fig = plots.latency_breakdown([fewer, ON])
    panels = {
        a.text: fig.layout["xaxis" + ("2" if a.x > 0.5 else "")].categoryarray
        for a in fig.layout.annotations
    }
    assert panels == {"batching off": ("1", "8"), "batching on": ("1", "4", "8")}
    assert fig.layout.xaxis2.matches is None


def test_a_level_batching_off_did_not_measure_breaks_its_line_instead_of_bridging_it():
    import math

    import pandas as pd

    from labkit import plots

    off = pd.DataFrame({"concurrency": [1, 8], "throughput": [1.0, 1.0], "p99_ms": [900, 7000]})
    on = pd.DataFrame(
        {"concurrency": [1, 4, 8], "throughput": [1, 3, 6], "p99_ms": [900, 1300, 1400]}
    )
    fig = plots.batching_comparison(off, on)
    line = next(t for t in fig.data if t.name == "batching off: p99 latency")
    assert list(line.x) == ["1", "4", "8"]
    assert line.y[0] == 900 and math.isnan(line.y[1]) and line.y[2] == 7000


def test_every_chart_names_both_its_axes():
    rows = pd.DataFrame(
        {"setting": ["paced, no delay", "paced, queue delay"], "queue_ms": [0.0, 1900.0],
         "compute_ms": [450.0, 800.0], "batch": [1.0, 3.0]}
    )  # fmt: skip
    charts = {
        "throughput_vs_latency": plots.throughput_vs_latency([OFF, ON]),
        "latency_breakdown": plots.latency_breakdown([OFF, ON]),
        "batching_comparison": plots.batching_comparison(OFF, ON),
        "batch_sizes": plots.batch_sizes([OFF, ON]),
        "queue_delay": plots.queue_delay(rows),
    }
    untitled = [
        f"{name}: {axis}"
        for name, fig in charts.items()
        for axis in ("xaxis", "yaxis")
        if not fig.layout[axis].title.text
    ]
    assert untitled == []


def test_parts_too_thin_to_see_leave_the_breakdown_and_its_title_says_so():
    fig = plots.latency_breakdown([OFF, ON])
    assert {trace.name for trace in fig.data} == {"queue", "compute infer"}
    assert "parts under 2% left out" in fig.layout.title.text


def test_thin_parts_that_add_up_to_a_visible_share_are_drawn_together_as_other():
    thick = OFF.assign(compute_input_ms=[20.0, 20.0, 20.0], compute_output_ms=[20.0, 20.0, 20.0])
    fig = plots.latency_breakdown([thick])
    assert {trace.name for trace in fig.data} == {"queue", "compute infer", "other"}


def test_points_carry_their_clients_only_where_a_line_has_more_than_one():
    assert all(trace.text is not None for trace in plots.throughput_vs_latency([OFF, ON]).data)
    one_level = [f[f["concurrency"] == 4] for f in (OFF, ON)]
    fig = plots.throughput_vs_latency(one_level)
    assert all(trace.text is None for trace in fig.data)
    assert "at 4 clients" in fig.layout.title.text
