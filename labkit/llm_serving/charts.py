"""Notebook 06's tables and charts of a study (pandas and plotly load when one is drawn)."""

from __future__ import annotations

from labkit.lessons.inflight import way_name
from labkit.profiling import request_records

#: The columns a learner reads, in plain words: row key -> header.
RESULT_COLUMNS = {
    "output_tokens_per_s": "output tokens/s",
    "ttft_p50_ms": "TTFT p50 (ms)",
    "ttft_p99_ms": "TTFT p99 (ms)",
    "itl_p50_ms": "ITL p50 (ms)",
    "failed": "failed",
    "aiperf_cpu_share": "AIPerf CPU share",
}


def results_frame(rows: list[dict]):
    """The measured rows as a table a learner reads: one line per way of serving, workload and
    clients (``4 streaming``), the figures of :data:`RESULT_COLUMNS` under plain headers. The
    full rows (every percentile, the CPU seconds) stay in ``inflight.json``."""
    import pandas as pd  # noqa: PLC0415 (tables load when a notebook asks)

    frame = pd.DataFrame(rows)
    clients = frame["concurrency"].astype(str) + frame["streaming"].map(
        {True: " streaming", False: " whole answers"}
    )
    return pd.concat(
        [
            pd.DataFrame(
                {
                    "way": frame["scheduler"].map(way_name),
                    "workload": frame["workload"],
                    "clients": clients,
                }
            ),
            frame[list(RESULT_COLUMNS)].rename(columns=RESULT_COLUMNS),
        ],
        axis=1,
    )


#: What each target of :data:`labkit.llm_serving.figures.TARGETS` measures, in plain words.
TARGET_WORDS = {
    "inflight_vs_dynamic_output_tokens_per_s": "output tokens/s, in-flight over dynamic batching",
    "inflight_ttft_p99_vs_dynamic": "TTFT p99, in-flight over dynamic batching",
    "inflight_ttft_p50_s": "TTFT p50 in seconds, in-flight batching",
    "inflight_served_vs_limit": "output tokens/s, in-flight served over the engine alone",
    "failed_requests": "failed requests",
}

#: The words of a target key's tail: workload and client kind.
TARGET_PLACES = {
    "mixed": "mixed lengths",
    "streaming": "streaming",
    "nonstreaming": "whole answers",
}


def target_label(name: str) -> str:
    """A target's key in plain words: ``inflight_ttft_p99_vs_dynamic_c4_mixed`` ->
    ``TTFT p99, in-flight over dynamic batching (4 clients, mixed lengths)``."""
    for key, words in TARGET_WORDS.items():
        if name.startswith(key):
            rest = name.removeprefix(key).strip("_").split("_")
            where = []
            if rest[0].startswith("c") and rest[0][1:].isdigit():
                where.append(f"{rest.pop(0)[1:]} clients")
            where += [TARGET_PLACES.get(part, part) for part in rest if part]
            return words + (f" ({', '.join(where)})" if where else "")
    return name


def targets_frame(targets: dict):
    """The benchmark's targets (:func:`labkit.llm_serving.figures.targets`) next to what was
    measured, one line each, in plain words."""
    import pandas as pd  # noqa: PLC0415 (tables load when a notebook asks)

    met = {True: "yes", False: "no", None: "not measured"}
    return pd.DataFrame(
        [
            {
                "figure": target_label(name),
                "target": t["target"],
                "measured": str(t["measured"]),
                "met": met[t["met"]],
            }
            for name, t in targets.items()
        ]
    ).set_index("figure")


def timeline_figure(rows: list[dict], title: str | None = None):
    """One bar per request from when it was sent to its last token, a dot at its first token;
    one panel per measured row's scheduler (AIPerf's per-request records of each row)."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    records = {row["scheduler"]: request_records(row["artifact_dir"]) for row in rows}
    fig = make_subplots(
        rows=len(records), cols=1, shared_xaxes=True, subplot_titles=[way_name(r) for r in records]
    )
    for i, (name, frame) in enumerate(records.items(), start=1):
        fig.add_trace(
            go.Bar(
                base=frame["start_s"],
                x=frame["end_s"] - frame["start_s"],
                y=frame["request"],
                orientation="h",
                name=f"{name}: waiting and generating",
                marker_color="#8c8c8c" if i < len(records) else "#76b900",
                showlegend=False,
            ),
            row=i,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=frame["first_token_s"],
                y=frame["request"],
                mode="markers",
                marker={"color": "black", "size": 5},
                name="first token",
                showlegend=i == 1,
            ),
            row=i,
            col=1,
        )
        fig.update_yaxes(title_text="request", autorange="reversed", row=i, col=1)
    fig.update_xaxes(title_text="seconds since the first request", row=len(records), col=1)
    fig.update_layout(
        title=title or "Each request from arrival to its last token (dot: first token)",
        height=260 * len(records),
    )
    return fig


def schedulers_figure(rows: list[dict], title: str | None = None):
    """Output tokens/s, TTFT p50 and p99 and ITL p50 of each scheduler, side by side."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    panels = [("output_tokens_per_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p50_ms", "ITL p50 (ms)")]  # fmt: skip
    import pandas as pd  # noqa: PLC0415 (tables load when a notebook asks)

    frame = pd.DataFrame(rows)
    frame = frame.assign(label=frame["workload"] + ", c" + frame["concurrency"].astype(str)
                         + frame["streaming"].map({True: "", False: " whole"}))  # fmt: skip
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for _, t in panels])
    colours = {"none": "#8c8c8c", "dynamic": "#1f77b4", "inflight": "#76b900"}
    for col, (key, _) in enumerate(panels, start=1):
        for scheduler, part in frame.groupby("scheduler", sort=False):
            fig.add_trace(
                go.Bar(
                    x=part["label"],
                    y=part[key],
                    name=way_name(scheduler),
                    showlegend=col == 1,
                    marker_color=colours.get(scheduler),
                ),  # fmt: skip
                row=1,
                col=col,
            )
    fig.update_layout(barmode="group", title=title or "The ways of serving, the same workload")
    return fig


def precision_figure(figures: dict, title: str | None = None):
    """Speed against agreement: tokens/s and greedy answers equal to float32's, per dtype."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    dtypes = ["float32", "bfloat16"]
    total = figures["compared"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["output tokens/s (in-process)",
                        f"greedy answers of {total} equal to ..."])  # fmt: skip
    fig.add_trace(
        go.Bar(
            x=dtypes,
            y=[figures[d]["output_tokens_per_s"] for d in dtypes],
            marker_color=["#1f77b4", "#ff7f0e"],
            showlegend=False,
        ),  # fmt: skip
        row=1,
        col=1,
    )
    for key, name in (("equal_alone", "the answer alone, same dtype"),
                      ("equal_float32", "float32's answer alone")):  # fmt: skip
        fig.add_trace(
            go.Bar(x=dtypes, y=[figures[d][key] for d in dtypes], name=name), row=1, col=2
        )
    fig.update_yaxes(range=[0, total], row=1, col=2)
    fig.update_layout(barmode="group", title=title or "Precision: speed against agreement")
    return fig
