"""Notebook 06's table and charts of a :class:`~labkit.llm_serving.rounds.Comparison` (plotly loads
when a chart is drawn). Every way keeps one name (:func:`way_name`) and one colour
(:data:`COLOURS`) in the table, every panel and legend, and the lesson's words
(:mod:`labkit.lessons.inflight` reads them from here)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import pandas as pd

from labkit.profiling import request_records

if TYPE_CHECKING:
    from .rounds import Comparison

#: The plain names of the ways the lab serves its text model, in the order they are shown.
WAY_NAMES = {
    "none": "no batching",
    "dynamic": "dynamic batching",
    "inflight": "the lab's in-flight model",
    "vllm": "vLLM in Triton",
    "vllm-standalone": "vLLM's own server",
    "vllm_bf16": "vLLM in Triton (bfloat16)",
    "vllm_bf16-standalone": "vLLM's own server, bfloat16",
}


#: The table's columns: row key -> header a learner reads.
COLUMNS = {
    "output_tokens_per_s": "output tokens/s",
    "ttft_p50_ms": "first token, median (ms)",
    "itl_p50_ms": "between tokens, median (ms)",
}


def way_name(scheduler: str) -> str:
    """A way's plain name (``vllm`` -> ``vLLM in Triton``); an unknown one as itself."""
    return WAY_NAMES.get(scheduler, scheduler)


def medians(comparison: Comparison) -> dict[str, dict[str, float]]:
    """Each way's median over its rounds of every figure of :data:`COLUMNS`."""
    out = {}
    for way in comparison.ways:
        rows = comparison.way_rows(way)
        out[way] = {
            key: statistics.median(v)
            if (v := [r[key] for r in rows if r.get(key) is not None])
            else float("nan")
            for key in COLUMNS
        }
        out[way]["failed"] = sum(int(r.get("failed") or 0) for r in rows)
        out[way]["rounds"] = len(rows)
    return out


def results_frame(comparison: Comparison) -> pd.DataFrame:
    """One line per way: the medians of its rounds, each round's tokens/s, failed requests."""
    m = medians(comparison)
    lines = []
    for way in comparison.ways:
        tokens = [r["output_tokens_per_s"] for r in comparison.way_rows(way)]
        lines.append(
            {
                "way": way_name(way),
                # text with one decimal, so 52.0 does not show as "52" beside 33.1
                **{name: f"{m[way][key]:.1f}" for key, name in COLUMNS.items()},
                "output tokens/s, each round": ", ".join(f"{t:.1f}" for t in tokens),
                "failed requests": m[way]["failed"],
            }
        )
    return pd.DataFrame(lines)


#: One colour per way of serving, in every chart.
COLOURS = {
    "none": "#8c8c8c",
    "dynamic": "#8c564b",
    "inflight": "#76b900",
    "vllm": "#1f77b4",
    "vllm-standalone": "#ff7f0e",
    "vllm_bf16": "#9467bd",
    "vllm_bf16-standalone": "#d62728",
}
#: The dots of single rounds and first tokens: not a way, so not a way's colour.
MARK = "#222222"


def colour(way: str) -> str:
    return COLOURS.get(way, "#7f7f7f")


def rounds_figure(comparison: Comparison, title: str | None = None):
    """Output tokens/s, first token and one step (ITL p50) of each way: a bar at the median of
    its rounds, a dot per round."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    panels = {"output_tokens_per_s": "output tokens/s", "ttft_p50_ms": "first token (ms)",
              "itl_p50_ms": "one step: ITL (ms)"}  # fmt: skip
    # the panel titles say how to read each panel; the axes say what is measured
    titles = ["served: more is better", "waited: less is better", "engine step: less is better"]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=titles)
    for col, key in enumerate(panels, start=1):
        for way in comparison.ways:
            values = [r[key] for r in comparison.way_rows(way) if r.get(key) is not None]
            name = way_name(way)
            fig.add_trace(
                go.Bar(x=[name], y=[statistics.median(values)] if values else [None], name=name,
                       marker_color=colour(way), legendgroup=way, showlegend=col == 1),
                row=1, col=col,
            )  # fmt: skip
            fig.add_trace(
                go.Scatter(x=[name] * len(values), y=values, mode="markers", name="one round",
                           marker={"color": MARK, "size": 6}, legendgroup="round",
                           showlegend=col == 1 and way == comparison.ways[0]),
                row=1, col=col,
            )  # fmt: skip
    fig.update_xaxes(showticklabels=False, title_text="each way, by its colour in the legend")
    for col, label in enumerate(panels.values(), start=1):
        fig.update_yaxes(title_text=label, row=1, col=col)
    fig.update_layout(
        title=title or "Each way, the same workload (bar: median of the rounds)",
        height=420,
        legend={"orientation": "h", "y": -0.08},
        margin={"t": 90},
    )
    return fig


def timeline_figure(
    comparison: Comparison,
    ways: tuple[str, ...] = ("inflight", "vllm"),
    round_number: int = 1,
    title: str | None = None,
):
    """One bar per request from when it was sent to its last token, a dot at its first token;
    one panel per way, from one round's AIPerf records."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    rows = {
        r["scheduler"]: r
        for r in comparison.rows
        if r["round"] == round_number and r["scheduler"] in ways
    }
    shown = [w for w in ways if w in rows]
    fig = make_subplots(
        rows=len(shown), cols=1, shared_xaxes=True, subplot_titles=[way_name(w) for w in shown]
    )
    for i, way in enumerate(shown, start=1):
        frame = request_records(rows[way]["artifact_dir"])
        fig.add_trace(
            go.Bar(base=frame["start_s"], x=frame["end_s"] - frame["start_s"], y=frame["request"],
                   orientation="h", name=way_name(way), marker_color=colour(way)),
            row=i, col=1,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=frame["first_token_s"], y=frame["request"], mode="markers",
                       marker={"color": MARK, "size": 5}, name="first token", showlegend=i == 1),
            row=i, col=1,
        )  # fmt: skip
        fig.update_yaxes(title_text="request", autorange="reversed", row=i, col=1)
    fig.update_xaxes(title_text="seconds since the round's first request", row=len(shown), col=1)
    fig.update_layout(
        title=title or f"Each request from arrival to last token (round {round_number})",
        height=260 * len(shown) + 60,
    )
    return fig


def precision_figure(comparison: Comparison, title: str | None = None):
    """vLLM in float32 and in bfloat16: output tokens/s (a bar at the median, a dot per round)
    and how many greedy answers equal the float32 answers alone."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    ways = [w for w in ("vllm", "vllm_bf16") if w in comparison.ways]
    total = max((comparison.answers.get(w) or {}).get("compared", 0) for w in ways)
    names = {"vllm": "float32", "vllm_bf16": "bfloat16"}
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=[
            "output tokens/s",
            f"same as plain float32 (of {total})",  # the plain model's float32 answers alone
        ],
    )
    for way in ways:
        values = [r["output_tokens_per_s"] for r in comparison.way_rows(way)]
        fig.add_trace(
            go.Bar(x=[names[way]], y=[statistics.median(values)], name=way_name(way),
                   marker_color=colour(way), legendgroup=way),
            row=1, col=1,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=[names[way]] * len(values), y=values, mode="markers", name="one round",
                       marker={"color": MARK, "size": 6}, showlegend=way == ways[0]),
            row=1, col=1,
        )  # fmt: skip
        equal = (comparison.answers.get(way) or {}).get("equal_streaming")
        fig.add_trace(
            go.Bar(x=[names[way]], y=[equal], marker_color=colour(way), legendgroup=way,
                   name=way_name(way), showlegend=False),
            row=1, col=2,
        )  # fmt: skip
    fig.update_yaxes(range=[0, max(total, 1)], row=1, col=2)
    fig.update_xaxes(title_text="vLLM's precision")
    fig.update_yaxes(title_text="output tokens/s", row=1, col=1)
    fig.update_yaxes(title_text="greedy answers alike", row=1, col=2)
    fig.update_layout(title=title or "vLLM's precision: speed against agreement", height=380)
    return fig
