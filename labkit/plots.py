"""Plotly figures for the frames :mod:`labkit.profiling` (perf_analyzer, Model Analyzer) returns.

Each function takes one DataFrame (or several, which are concatenated) with a ``config`` column
naming the configuration each row was measured with, and returns a ``plotly.graph_objects.Figure``.
"""

from __future__ import annotations

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
    """Throughput against latency, one line per configuration, each point one concurrency."""
    import plotly.express as px  # noqa: PLC0415 (plotting loads when a chart is drawn)

    frame = _frame(data, ["throughput", latency, "concurrency"])
    fig = px.line(
        frame,
        x=latency,
        y="throughput",
        color="config",
        markers=True,
        text="concurrency",
        labels={
            latency: f"{latency.removesuffix('_ms')} latency (ms)",
            "throughput": "throughput (infer/s)",
        },
        title=title or "Throughput against latency (labels: concurrency)",
    )
    fig.update_traces(textposition="top center")
    return fig


def latency_breakdown(data: pd.DataFrame | Iterable[pd.DataFrame], title: str | None = None):
    """The server-side latency per concurrency, stacked by part; one panel per configuration."""
    import plotly.express as px  # noqa: PLC0415 (plotting loads when a chart is drawn)

    frame = _frame(data, ["concurrency", *BREAKDOWN])
    parts = list(BREAKDOWN)
    if "avg_latency_ms" in frame:
        frame = frame.assign(other_ms=(frame["avg_latency_ms"] - frame[parts].sum(axis=1)).clip(0))
        parts.append("other_ms")
    long = frame.melt(
        id_vars=["config", "concurrency"], value_vars=parts, var_name="part", value_name="ms"
    )
    long["part"] = long["part"].map({**BREAKDOWN, "other_ms": "client and network"})
    fig = px.bar(
        long,
        x=long["concurrency"].astype(str),
        y="ms",
        color="part",
        facet_col="config" if frame["config"].nunique() > 1 else None,
        labels={"x": "concurrency", "ms": "average latency (ms)"},
        title=title or "Where the time goes",
    )
    fig.update_layout(barmode="stack")
    return fig


def batching_comparison(
    off: pd.DataFrame, on: pd.DataFrame, latency: str = "p99_ms", title: str | None = None
):
    """Batching off against on: throughput (bars) and latency (lines) per concurrency."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for frame, name, colour in ((off, "batching off", "#8c8c8c"), (on, "batching on", "#76b900")):
        frame = _frame(frame, ["concurrency", "throughput", latency])
        x = frame["concurrency"].astype(str)
        fig.add_trace(
            go.Bar(x=x, y=frame["throughput"], name=f"{name}: throughput", marker_color=colour),
            secondary_y=False,
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=frame[latency],
                name=f"{name}: {latency[:-3]} latency",
                mode="lines+markers",
                line={"color": colour, "dash": "dot"},
            ),
            secondary_y=True,
        )
    fig.update_layout(barmode="group", title=title or "Dynamic batching off and on")
    fig.update_xaxes(title_text="concurrency")
    fig.update_yaxes(title_text="throughput (infer/s)", secondary_y=False)
    fig.update_yaxes(title_text=f"{latency[:-3]} latency (ms)", secondary_y=True)
    return fig


def batch_sizes(data: pd.DataFrame | Iterable[pd.DataFrame], title: str | None = None):
    """The average batch the server executed, per concurrency (perf_analyzer frames) or per model
    (:func:`labkit.profiling.metrics` frames)."""
    import plotly.express as px  # noqa: PLC0415 (plotting loads when a chart is drawn)

    frame = data if isinstance(data, pd.DataFrame) else pd.concat(list(data), ignore_index=True)
    if "concurrency" in frame:
        frame = _frame(frame, ["avg_batch_size"])
        x, colour = frame["concurrency"].astype(str), "config"
        xlabel = "concurrency"
    elif "model" in frame:
        x, colour, xlabel = "model", None, "model"
    else:
        raise ConfigError("batch_sizes needs a perf_analyzer frame or a metrics frame")
    fig = px.bar(
        frame,
        x=x,
        y="avg_batch_size",
        color=colour,
        barmode="group",
        labels={"x": xlabel, "avg_batch_size": "average batch size"},
        title=title or "Average batch size the server executed",
    )
    fig.add_hline(y=1, line_dash="dot", annotation_text="no batching")
    return fig
