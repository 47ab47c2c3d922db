"""Notebook 08's figures and verdicts: the ensemble against one model served alike, a second
instance, what a batch costs, the response cache and ``ask``. Why each verdict comes out as it
does is the notebook's markdown."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from labkit.lessons.conclusion import Conclusion, Verdict
from labkit.pipeline import MATCHED, PIPELINE, SINGLE

_SERVED_AS = {
    SINGLE: "one model, 1 instance",
    MATCHED: "one model, 2 instances",
    PIPELINE: "ensemble, encoder step 2 instances",
}


def rounds_table(frame: pd.DataFrame) -> pd.DataFrame:
    """perf_analyzer's rounds (:func:`labkit.pipeline.ensemble_rounds`): one row per way of
    serving and client count, medians over the rounds. The ensemble's requests per execution and
    time per execution are left blank: it runs each request once, and its steps do the batching."""
    rows = []
    for (model, clients), group in frame.groupby(["model", "concurrency"], sort=False):
        median = group[["throughput", "p50_ms", "avg_batch_size", "compute_infer_ms"]].median()
        if model == PIPELINE:
            median[["avg_batch_size", "compute_infer_ms"]] = float("nan")
        rows.append(
            {
                "served as": _SERVED_AS.get(model, model),
                "clients": int(clients),
                "infer/s (median)": round(median["throughput"], 1),
                "infer/s (each round)": ", ".join(f"{v:.1f}" for v in group["throughput"]),
                "p50 (ms)": round(median["p50_ms"], 1),
                "requests per execution": round(median["avg_batch_size"], 1),
                "its batch's run, per request (ms)": round(median["compute_infer_ms"], 1),
            }
        )
    return pd.DataFrame(rows)


def rounds_verdict(frame: pd.DataFrame, new: str, old: str, clients: int, what: str) -> Verdict:
    """``what``: ``new``'s infer/s over ``old``'s at ``clients``, round by round (the two were
    measured in turns, so each round compares neighbours in time)."""
    level = frame[frame["concurrency"] == clients].set_index(["model", "round"])["throughput"]
    ratios = list((level[new] / level[old]).dropna())
    return Verdict(f"{what}, {clients} client{'s' * (clients > 1)}", ratios, "infer/s")


def batch_cost(frame: pd.DataFrame, clients: int) -> tuple[float, float]:
    """The single model's requests per execution at ``clients``, and its time per execution
    there over its time at one client: what that batch cost against one request."""
    single = frame[frame["model"] == SINGLE].groupby("concurrency")
    per_execution = single["compute_infer_ms"].median()
    return float(single["avg_batch_size"].median()[clients]), float(
        per_execution[clients] / per_execution[1]
    )


def hit_miss_table(single: pd.DataFrame, ensemble: pd.DataFrame) -> pd.DataFrame:
    """:func:`labkit.pipeline.hit_and_miss_rounds` on both cached models, a row per round."""
    rows = []
    for way, frame in (("one model", single), ("ensemble", ensemble)):
        for number, group in frame.groupby("round", sort=True):
            kind = group.set_index("kind")
            rows.append(
                {
                    "served as": way,
                    "round": int(number),
                    "new text p50 (ms)": round(kind.loc["miss", "p50_ms"], 2),
                    "repeated p50 (ms)": round(kind.loc["hit", "p50_ms"], 2),
                    "misses counted": int(kind.loc["miss", "server_misses"]),
                    "hits counted": int(kind.loc["hit", "server_hits"]),
                }
            )
    return pd.DataFrame(rows)


def ask_table(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`labkit.pipeline.ask_rounds`: one row per answer, with its text."""
    return pd.DataFrame(
        {
            "round": frame["round"].astype(int),
            "way": frame["way"],
            "first piece after (s)": frame["ttft_s"].round(2),
            "whole answer (s)": frame["total_s"].round(2),
            "answer": frame["text"].str.strip(),
        }
    )


def _p50(hits: pd.DataFrame) -> pd.DataFrame:
    """A round's p50 (ms) of its new texts (``miss``) and of the same texts again (``hit``)."""
    return hits.pivot_table(index="round", columns="kind", values="p50_ms")


def pipeline_conclusion(
    agreement,
    rounds: pd.DataFrame,
    hits: pd.DataFrame,
    eviction,
    *,
    pipeline_hits: pd.DataFrame,
    asked: pd.DataFrame,
    concurrency: Sequence[int] = (1, 8),
) -> Conclusion:
    """08's verdicts, its figures table and its three-sentence takeaway."""
    low, high = min(concurrency), max(concurrency)
    p50 = _p50(hits)
    ttft = asked.pivot_table(index="round", columns="way", values="ttft_s")
    inside, outside = list(dict.fromkeys(asked["way"]))
    alike = "ensemble against one model served alike"
    verdicts = (
        rounds_verdict(rounds, PIPELINE, MATCHED, low, alike),
        rounds_verdict(rounds, PIPELINE, MATCHED, high, alike),
        rounds_verdict(rounds, MATCHED, SINGLE, high, "2 instances of one model against 1"),
        rounds_verdict(rounds, MATCHED, SINGLE, low, "2 instances of one model against 1"),
        Verdict(
            "repeated text against a new one, cached",
            list(p50["miss"] / p50["hit"]),
            "speed (1/p50)",
        ),
        Verdict(
            "ask against the same steps from the client",
            list(ttft[outside] / ttft[inside]),
            "speed to the first piece",
        ),
    )
    hit, miss = p50.median()[["hit", "miss"]]
    piped = _p50(pipeline_hits).median()
    rows, cost = batch_cost(rounds, high)
    table = pd.DataFrame(
        {
            "largest difference, ensemble against one model": f"{agreement.max_abs_diff:.1e}"
            if agreement.max_abs_diff
            else "0",
            f"time of a batch of {rows:.1f} against 1 request (one model)": f"x{cost:.2f}",
            "repeated text p50 against new, one model (ms)": f"{hit:.2f} against {miss:.1f}",
            "repeated text p50 against new, ensemble (ms)": (
                f"{piped['hit']:.2f} against {piped['miss']:.1f}"
            ),
            "answers the full cache held": f"{eviction.entries} of {eviction.requests} offered",
            "first request, sent again": "a miss" if eviction.first_evicted else "a hit",
            "ask's answers and the client's": ("the same", "not the same")[
                asked.text.nunique() > 1
            ],
        }.items(),
        columns=["figure", "measured"],
    )
    split, second = verdicts[1], verdicts[2]
    takeaway = (
        f"The ensemble against one model served alike at {high} clients: {split.word}, "
        f"{split.ratio}.",
        f"A second instance of one model at {high} clients: {second.word}, {second.ratio}.",
        f"A repeated text came from the response cache in {hit:.2f} ms against {miss:.1f} ms "
        "for a new one (p50).",
    )
    figures = {
        "largest difference, ensemble against one model": agreement.max_abs_diff,
        **{v.comparison: v.ratio for v in verdicts[:3]},
        "cache hit p50 (ms)": float(hit),
        "cache miss p50 (ms)": float(miss),
    }
    return Conclusion(table=table, figures=figures, takeaway=takeaway, verdicts=verdicts)
