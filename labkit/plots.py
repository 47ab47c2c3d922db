"""Plotly figures for the frames :mod:`labkit.profiling` (perf_analyzer, Model Analyzer) returns.

Each function takes one DataFrame (or several, which are concatenated) with a ``config`` column
naming the configuration each row was measured with, and returns a ``plotly.graph_objects.Figure``.
Three rules hold for every chart: a configuration has one colour in every chart and legend
(:func:`colours`), value axes have ticks at round numbers (two axes of one chart share their grid
lines), and a title fits the chart (a long one is broken onto a second line).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd

from labkit.errors import ConfigError

#: The server-side parts of a request's latency, in the order they happen.
BREAKDOWN = {
    "queue_ms": "queue",
    "compute_input_ms": "compute input",
    "compute_infer_ms": "compute infer",
    "compute_output_ms": "compute output",
}
#: One colour per part of the breakdown, in every chart.
PART_COLOURS = {
    "queue": "#e8a33d",
    "compute input": "#9ecae1",
    "compute infer": "#3182bd",
    "compute output": "#08519c",
    "client and network": "#bdbdbd",
    "other": "#d9d9d9",
}
#: The share of the time a part of the breakdown needs to be drawn on its own.
SMALL_PART = 0.02
#: The configurations every lesson names, each with its own colour.
KNOWN_COLOURS = {"batching off": "#8c8c8c", "batching on": "#76b900"}
#: The colours of any other configuration, handed out in sorted order of the names.
PALETTE = ("#1f77b4", "#d62728", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22")
#: The most characters a title line holds in a chart of plotly's default width.
TITLE_WIDTH = 60
#: How many intervals between round ticks a value axis may have (both axes of a chart alike).
INTERVALS = (4, 5, 6)
#: Room above the largest value, so that a marker or a label at the top is not cut.
HEADROOM = 1.04
#: What the x axis of a chart per concurrency level says.
CLIENTS = "concurrency (clients)"


def colours(names: Iterable[str]) -> dict[str, str]:
    """One colour per configuration name: the lessons' own names keep theirs, the others take
    :data:`PALETTE` in sorted order, so a name has the same colour in every chart of a notebook
    that shows the same names."""
    names = sorted({str(n) for n in names})
    others = [n for n in names if n not in KNOWN_COLOURS]
    given = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(others)}
    return {n: KNOWN_COLOURS.get(n) or given[n] for n in names}


def nice_step(top: float, intervals: int = 5) -> float:
    """The smallest round step (1, 2, 2.5 or 5 times a power of ten) with which ``intervals``
    steps from 0 reach ``top``."""
    if not top > 0 or math.isinf(top):
        return 1.0
    raw = top / intervals
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if factor * power >= raw * (1 - 1e-9):
            return factor * power
    return 10 * power  # unreachable: 10 * power > raw


def _top(fig, axis: str) -> float:
    """The largest value drawn on the value axis ``axis`` (1 when there is none)."""
    anchor = "y" + axis.removeprefix("yaxis")
    values = [
        float(v)
        for trace in fig.data
        if (getattr(trace, "yaxis", None) or "y") == anchor and trace.y is not None
        for v in trace.y
        if v is not None and not math.isnan(float(v))
    ]
    return max(values, default=1.0)


def round_ticks(fig, tops: dict[str, float | None] | None = None):
    """Give ``fig``'s value axes ticks at round numbers from 0, and one grid for all of them.

    ``tops`` maps each axis (``"yaxis"``, ``"yaxis2"``, ...) to the largest value it must show
    (None: the largest value drawn on it); by default the one axis ``"yaxis"``. Every axis gets
    the same number of intervals (:data:`INTERVALS`, whichever wastes least room), each of a
    :func:`nice_step`, so that two axes' ticks sit on the same grid lines."""
    tops = {a: _top(fig, a) if t is None else t for a, t in (tops or {"yaxis": None}).items()}
    tops = {a: t * HEADROOM if t > 0 and math.isfinite(t) else 1.0 for a, t in tops.items()}

    def waste(n: int) -> float:
        return max(nice_step(t, n) * n / t for t in tops.values())

    n = min(INTERVALS, key=waste)
    for axis, top in tops.items():
        step = nice_step(top, n)
        ticks = {"range": [0, step * n], "tick0": 0, "dtick": step, "tickmode": "linear"}
        anchor = "y" + axis.removeprefix("yaxis")
        # the facets' axes that share this one's range share its ticks too
        shared = [
            name
            for name in fig.layout
            if name.startswith("yaxis") and getattr(fig.layout[name], "matches", None) == anchor
        ]
        fig.update_layout({name: ticks for name in (axis, *shared)})
    return fig


def fit_title(text: str, width: int = TITLE_WIDTH) -> str:
    """``text`` broken at spaces into lines of at most ``width`` characters (``<br>``)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def _finish(fig, title: str):
    """A chart's title (fitted, with room above the plot for a second line) and facet labels
    without the column name (``batching on``, not ``config=batching on``)."""
    fitted = fit_title(title)
    fig.update_layout(title={"text": fitted})
    if "<br>" in fitted:
        fig.update_layout(margin={"t": 100})
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig


def _levels_in_order(fig, frame: pd.DataFrame):
    """The concurrency levels on a categorical x axis in numeric order (1, 4, 8), whichever
    configuration measured which, not in the order the traces first show them (1, 8, 4)."""
    levels = [str(c) for c in sorted(frame["concurrency"].unique())]
    fig.update_xaxes(categoryorder="array", categoryarray=levels)
    return fig


def _frame(data: pd.DataFrame | Iterable[pd.DataFrame], needs: Iterable[str]) -> pd.DataFrame:
    frame = data if isinstance(data, pd.DataFrame) else pd.concat(list(data), ignore_index=True)
    if "config" not in frame:
        frame = frame.assign(config=frame.attrs.get("model", "model"))
    missing = [c for c in needs if c not in frame]
    if missing:
        raise ConfigError(
            f"the frame has no column {', '.join(map(repr, missing))} (it has "
            f"{', '.join(map(str, frame.columns))}); pass a frame from labkit.profiling.perf_analyzer"
        )
    return frame.sort_values(["config", "concurrency"] if "concurrency" in frame else ["config"])


def throughput_vs_latency(
    data: pd.DataFrame | Iterable[pd.DataFrame], latency: str = "p99_ms", title: str | None = None
):
    """Throughput against latency, one line per configuration, each point one concurrency
    (labelled with its clients where a configuration was measured at more than one)."""
    import plotly.express as px  # noqa: PLC0415 (plotting loads when a chart is drawn)

    frame = _frame(data, ["throughput", latency, "concurrency"])
    levels = frame.groupby("config")["concurrency"].nunique().max() > 1
    fig = px.line(
        frame,
        x=latency,
        y="throughput",
        color="config",
        markers=True,
        text="concurrency" if levels else None,
        color_discrete_map=colours(frame["config"]),
        labels={
            latency: f"{latency.removesuffix('_ms')} latency (ms)",
            "throughput": "throughput (infer/s)",
            "config": "configuration",
        },
    )
    fig.update_traces(textposition="top center")
    fig.update_xaxes(rangemode="tozero")
    round_ticks(fig)
    clients = " (labels: clients)" if levels else f" at {frame['concurrency'].iloc[0]} clients"
    return _finish(fig, title or "Throughput against latency" + clients)


def latency_breakdown(data: pd.DataFrame | Iterable[pd.DataFrame], title: str | None = None):
    """The server-side latency per concurrency, stacked by part; one panel per configuration."""
    import plotly.express as px  # noqa: PLC0415 (plotting loads when a chart is drawn)

    frame = _frame(data, ["concurrency", *BREAKDOWN])
    parts = list(BREAKDOWN)
    if "avg_latency_ms" in frame:
        frame = frame.assign(other_ms=(frame["avg_latency_ms"] - frame[parts].sum(axis=1)).clip(0))
        parts.append("other_ms")
    # A part under SMALL_PART of the time is too thin to see: the small ones become one "other",
    # left out (the title says so) when even together they are too thin.
    shares = frame[parts].sum() / frame[parts].sum().sum()
    small = [p for p in parts if shares[p] < SMALL_PART]
    if small:
        frame = frame.assign(small_ms=frame[small].sum(axis=1))
        parts = [p for p in parts if p not in small]
        if shares[small].sum() >= SMALL_PART:
            parts.append("small_ms")
        else:
            title = title or f"Where the time goes (parts under {SMALL_PART:.0%} left out)"
    long = frame.melt(
        id_vars=["config", "concurrency"], value_vars=parts, var_name="part", value_name="ms"
    )
    names = {**BREAKDOWN, "other_ms": "client and network", "small_ms": "other"}
    long["part"] = long["part"].map(names)
    fig = px.bar(
        long,
        x=long["concurrency"].astype(str),
        y="ms",
        color="part",
        color_discrete_map=PART_COLOURS,
        facet_col="config" if frame["config"].nunique() > 1 else None,
        labels={"x": CLIENTS, "ms": "average latency (ms)"},
    )
    fig.update_layout(barmode="stack")
    stacked = frame.groupby(["config", "concurrency"])[parts].sum().sum(axis=1).max()
    round_ticks(fig, {"yaxis": stacked})
    _levels_in_order(fig, frame)
    _each_panel_its_own_levels(fig)
    return _finish(fig, title or "Where the time goes")


def _each_panel_its_own_levels(fig):
    """Each panel of a faceted chart lists only the levels its own bars measured: facets share
    one category list by default, which left batching off's panel an empty slot at 4 clients."""
    levels: dict[str, set[str]] = {}
    for trace in fig.data:
        axis = "xaxis" + (trace.xaxis or "x")[1:]
        levels.setdefault(axis, set()).update(str(x) for x in trace.x)
    if len(levels) < 2:
        return fig
    for axis, found in levels.items():
        fig.layout[axis].update(matches=None, categoryarray=sorted(found, key=float))
    return fig


def batching_comparison(
    off: pd.DataFrame, on: pd.DataFrame, latency: str = "p99_ms", title: str | None = None
):
    """Batching off against on, per concurrency: throughput (bars, left panel) and latency
    (lines, right panel). Two panels, not two y axes on one: a line drawn over bars of its own
    colour vanished where it crossed them (the p99 at 1 client did not show at all)."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    shown = latency[:-3]
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("throughput: more is better", f"{shown} latency: less is better"),
        horizontal_spacing=0.12,
    )
    tops = {"throughput": 0.0, latency: 0.0}
    levels = sorted(set(off["concurrency"]) | set(on["concurrency"]))
    for frame, name in ((off, "batching off"), (on, "batching on")):
        colour = KNOWN_COLOURS[name]
        frame = _frame(frame, ["concurrency", "throughput", latency])
        tops = {k: max(v, float(frame[k].max())) for k, v in tops.items()}
        # A level one side did not measure stays empty: its line breaks there rather than
        # drawing a value nobody measured.
        frame = frame.set_index("concurrency").reindex(levels).reset_index()
        x = frame["concurrency"].astype(str)
        fig.add_trace(
            go.Bar(x=x, y=frame["throughput"], name=f"{name}: throughput", marker_color=colour,
                   legendgroup=name),
            row=1,
            col=1,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(
                x=x,
                y=frame[latency],
                name=f"{name}: {shown} latency",
                mode="lines+markers",
                line={"color": colour},
                marker={"size": 10},
                legendgroup=name,
            ),
            row=1,
            col=2,
        )
    _levels_in_order(fig, pd.concat([off, on]))
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": -0.2})
    fig.update_xaxes(title_text=CLIENTS)
    fig.update_yaxes(title_text="throughput (infer/s)", row=1, col=1)
    fig.update_yaxes(title_text=f"{shown} latency (ms)", row=1, col=2)
    round_ticks(fig, {"yaxis": tops["throughput"], "yaxis2": tops[latency]})
    return _finish(fig, title or "Dynamic batching off and on")


def batch_sizes(data: pd.DataFrame | Iterable[pd.DataFrame], title: str | None = None):
    """The average batch the server executed, per concurrency (perf_analyzer frames) or per model
    (:func:`labkit.profiling.metrics` frames)."""
    import plotly.express as px  # noqa: PLC0415 (plotting loads when a chart is drawn)

    frame = data if isinstance(data, pd.DataFrame) else pd.concat(list(data), ignore_index=True)
    if "concurrency" in frame:
        frame = _frame(frame, ["avg_batch_size"])
        x, colour = frame["concurrency"].astype(str), "config"
        xlabel, names = CLIENTS, frame["config"]
    elif "model" in frame:
        x, colour, xlabel, names = "model", None, "model", []
    else:
        raise ConfigError("batch_sizes needs a perf_analyzer frame or a metrics frame")
    fig = px.bar(
        frame,
        x=x,
        y="avg_batch_size",
        color=colour,
        color_discrete_map=colours(names),
        barmode="group",
        labels={"x": xlabel, "avg_batch_size": "average batch size", "config": "configuration"},
    )
    fig.add_hline(y=1, line_dash="dot", annotation_text="no batching")
    round_ticks(fig, {"yaxis": max(float(frame["avg_batch_size"].max()), 1.0)})
    if "concurrency" in frame:
        _levels_in_order(fig, frame)
    return _finish(fig, title or "Average batch size the server executed")


def queue_delay(data: pd.DataFrame, title: str | None = None):
    """Where a request's time went in each setting of a queue-delay experiment, stacked (queue
    wait, then its batch's execution), with the requests per execution above each bar.

    ``data`` has one row per round and setting (:func:`labkit.profiling.arrivals.delay_rounds`):
    ``setting``, ``queue_ms``, ``compute_ms`` and ``batch``; rounds are averaged, settings keep
    their order."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)

    missing = [c for c in ("setting", "queue_ms", "compute_ms", "batch") if c not in data]
    if missing:
        raise ConfigError(
            f"the frame has no column {', '.join(map(repr, missing))}; pass the rows of "
            "labkit.profiling.arrivals.delay_rounds"
        )
    mean = data.groupby("setting", sort=False)[["queue_ms", "compute_ms", "batch"]].mean()
    # the batch's run is shared by its requests: what each costs the model is the run over the
    # batch, the saving a queue delay buys (the longer run alone reads as a pure cost)
    each = mean["compute_ms"] / mean["batch"]
    fig = go.Figure()
    parts = (
        ("queue_ms", "queue", "queue wait"),
        ("compute_ms", "compute infer", "its batch's run, shared by the batch"),
    )
    for column, part, name in parts:
        fig.add_trace(
            go.Bar(x=list(mean.index), y=mean[column], name=name, marker_color=PART_COLOURS[part])
        )
    tops = mean["queue_ms"] + mean["compute_ms"]
    fig.add_trace(
        go.Scatter(
            x=list(mean.index),
            y=tops,
            mode="text",
            text=[
                f"{b:.1f} per execution,<br>{m:.0f} ms of the model's time each"
                for b, m in zip(mean["batch"], each, strict=True)
            ],
            textposition="top center",
            showlegend=False,
        )
    )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="how requests arrived, and the queue delay")
    fig.update_yaxes(title_text="average time per request (ms)")
    round_ticks(fig, {"yaxis": float(tops.max()) * 1.2})  # and room for the two-line labels
    return _finish(fig, title or "Where a request's time went, and the batch it ran in")
