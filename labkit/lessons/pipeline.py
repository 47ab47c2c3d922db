"""Notebook 08's lesson: what an ensemble costs against one model, what a second encoder
instance buys, and what the response cache saves, in words computed from the figures.

The measurements are :mod:`labkit.pipeline`'s. A comparison counts as a gain or a loss by the
lab's one rule (:data:`~labkit.lessons.conclusion.NOISE_RULE`): the median of the rounds' ratios
beyond x1.20 either way, with no round the other way; otherwise it is said to be within the noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio, judge

#: How :func:`~labkit.lessons.conclusion.judge`'s verdicts read in this lesson.
_VERDICT = {"gain": "a gain", "tie": "within the noise", "loss": "a loss"}

_SERVED_AS = {"minilm": "one model", "minilm_pipeline": "ensemble"}


def rounds_table(frame: pd.DataFrame) -> pd.DataFrame:
    """perf_analyzer's rounds (:func:`labkit.pipeline.ensemble_rounds`) in words: one row per
    setting, way of serving and client count, medians over the rounds."""
    grouped = frame.groupby(["setting", "model", "concurrency"], sort=False)
    rows = []
    for (setting, model, clients), group in grouped:
        rows.append(
            {
                "served as": _SERVED_AS.get(model, model),
                "setting": setting if model != "minilm" else "(unchanged)",
                "clients": int(clients),
                "infer/s (median)": f"{group['throughput'].median():.1f}",
                "infer/s (each round)": ", ".join(f"{v:.1f}" for v in group["throughput"]),
                "p50 (ms)": f"{group['p50_ms'].median():.1f}",
                "p99 (ms)": f"{group['p99_ms'].median():.1f}",
            }
        )
    return pd.DataFrame(rows)


def hit_miss_table(rounds: pd.DataFrame, ensemble: pd.DataFrame | None = None) -> pd.DataFrame:
    """:func:`labkit.pipeline.hit_and_miss_rounds` in words: one row per round; with
    ``ensemble`` (the same rounds on the ensemble's cached twin), its rows follow, and a first
    column says which way each row served."""
    if ensemble is not None:
        both = [hit_miss_table(rounds), hit_miss_table(ensemble)]
        for table, way in zip(both, ("one model", "ensemble"), strict=True):
            table.insert(0, "served as", way)
        return pd.concat(both, ignore_index=True)
    rows = []
    for number, group in rounds.groupby("round", sort=True):
        by_kind = group.set_index("kind")
        rows.append(
            {
                "round": int(number),
                "requests": int(by_kind.loc["miss", "requests"]),
                "new text p50 (ms)": f"{by_kind.loc['miss', 'p50_ms']:.2f}",
                "repeated p50 (ms)": f"{by_kind.loc['hit', 'p50_ms']:.2f}",
                "new text p99 (ms)": f"{by_kind.loc['miss', 'p99_ms']:.2f}",
                "repeated p99 (ms)": f"{by_kind.loc['hit', 'p99_ms']:.2f}",
                "misses counted": int(by_kind.loc["miss", "server_misses"]),
                "hits counted": int(by_kind.loc["hit", "server_hits"]),
            }
        )
    return pd.DataFrame(rows)


def compare_rounds(
    frame: pd.DataFrame, new: str, old: str, concurrency: int, *, by: str = "model"
) -> tuple[Ratio, str]:
    """The throughput of ``new`` over ``old`` (values of column ``by``) at ``concurrency``: the
    median of the per-round ratios, and the verdict ("a gain", "a loss" or "within the noise").

    The two were measured in turns, so each round's ratio compares neighbours in time; the
    verdict is the lab's one rule on those ratios (:func:`~labkit.lessons.conclusion.judge`)."""
    level = frame[frame["concurrency"] == concurrency]
    new_rows = level[level[by] == new].sort_values("round")["throughput"].to_list()
    old_rows = level[level[by] == old].sort_values("round")["throughput"].to_list()
    if not new_rows or len(new_rows) != len(old_rows):
        raise ConfigError(
            f"no matching rounds of {new!r} and {old!r} at concurrency {concurrency}: "
            f"{len(new_rows)} against {len(old_rows)}"
        )
    ratios = [n / o if o > 0 else math.nan for n, o in zip(new_rows, old_rows, strict=True)]
    return Ratio(statistics.median(ratios), "infer/s"), _VERDICT[judge(ratios)]


def instance_shares(
    one_instance: pd.DataFrame, two_instances: pd.DataFrame, concurrency: int
) -> tuple[list[float], list[float]]:
    """The ensemble's share of the single model's throughput at ``concurrency``, round by round:
    in the block with one encoder instance, and in the block with two.

    The single model, measured in turns beside the ensemble in both blocks and unchanged
    between them, is the yardstick: the host's speed drifts between the blocks, and the shares
    carry less of that drift than the raw throughputs."""
    shares = []
    for frame in (one_instance, two_instances):
        level = frame[frame["concurrency"] == concurrency]
        ensemble = level[level["model"] == "minilm_pipeline"].sort_values("round")["throughput"]
        single = level[level["model"] == "minilm"].sort_values("round")["throughput"]
        if ensemble.empty or len(ensemble) != len(single):
            raise ConfigError(f"no matching rounds of both models at concurrency {concurrency}")
        shares.append([e / s for e, s in zip(ensemble, single, strict=True) if s > 0])
    return shares[0], shares[1]


def compare_instances(
    one_instance: pd.DataFrame, two_instances: pd.DataFrame, concurrency: int
) -> tuple[Ratio, str]:
    """What the second encoder instance changed: the ensemble's share of the single model's
    throughput with two encoder instances over that share with one (:func:`instance_shares`),
    at ``concurrency``. Round ``i`` of one block is paired with round ``i`` of the other, and the
    lab's one rule judges those per-round changes."""
    one, two = instance_shares(one_instance, two_instances, concurrency)
    paired = [b / a for a, b in zip(one, two, strict=False) if a > 0]
    # the figure shown is the one the rule judged: the median of the per-round changes
    return Ratio(statistics.median(paired), "infer/s"), _VERDICT[judge(paired)]


def ask_table(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`labkit.pipeline.ask_rounds` in words: one row per answer."""
    return pd.DataFrame(
        {
            "round": frame["round"].astype(int),
            "way": frame["way"],
            "first piece after (s)": frame["ttft_s"].map("{:.2f}".format),
            "whole answer (s)": frame["total_s"].map("{:.2f}".format),
        }
    )


def ask_summary(frame: pd.DataFrame) -> str:
    """Whether both ways gave one answer, and what each took (medians over the rounds)."""
    ways = list(dict.fromkeys(frame["way"]))
    texts = set(frame["text"])
    same = (
        f"All {len(frame)} answers were the same greedy text: {next(iter(texts)).strip()!r}. "
        "Whether it is right is another matter: SmolLM2-135M is a small model, and it can say "
        "what the passages do not; the pipeline is judged here on giving one answer both ways."
        if len(texts) == 1
        else f"The answers differed ({len(texts)} texts): greedy decoding should give one."
    )
    medians = frame.groupby("way", sort=False)[["ttft_s", "total_s"]].median()
    inside, outside = medians.loc[ways[0]], medians.loc[ways[1]]
    per_round = frame.pivot_table(index="round", columns="way", values="ttft_s")
    # the client's time over ask's, round by round: more is ask's gain
    verdict = _VERDICT[judge(list(per_round[ways[1]] / per_round[ways[0]]))]
    return (
        f"{same} The first piece came after {inside['ttft_s']:.2f} s through ask and "
        f"{outside['ttft_s']:.2f} s from the client ({verdict}); the whole answer took "
        f"{inside['total_s']:.2f} s and {outside['total_s']:.2f} s (each a median of the rounds "
        "in the table). Both ran the same models on the same cores: what ask saves is the "
        "client's round trip to embed the question, well under a millisecond on this machine's "
        "loopback (a cache hit's whole round trip above took less than one), far "
        "less than generating the answer. Across a network each round trip costs the network's "
        "latency, and ask saves it."
    )


def pipeline_conclusion(
    agreement,
    one_instance: pd.DataFrame,
    two_instances: pd.DataFrame,
    hits: pd.DataFrame,
    eviction,
    *,
    concurrency: Sequence[int] = (1, 8),
    asked: pd.DataFrame | None = None,
    pipeline_hits: pd.DataFrame | None = None,
) -> Conclusion:
    """The lesson's words, figures (six at most) and three-sentence takeaway.

    ``agreement``: :func:`labkit.pipeline.compare_embeddings`; ``one_instance`` and
    ``two_instances``: :func:`labkit.pipeline.ensemble_rounds` with one and two encoder
    instances; ``hits``: :func:`labkit.pipeline.hit_and_miss_rounds`; ``eviction``:
    :func:`labkit.pipeline.fill_cache`; ``asked``, if given: :func:`labkit.pipeline.ask_rounds`;
    ``pipeline_hits``, if given: :func:`labkit.pipeline.hit_and_miss_rounds` on the ensemble's
    cached twin."""
    low, high = min(concurrency), max(concurrency)
    cost = {c: compare_rounds(one_instance, "minilm_pipeline", "minilm", c) for c in (low, high)}
    # slower within the noise is what the prediction said, not a verdict the run could make
    said_cost = {c: _cost_words(*cost[c]) for c in cost}
    instances = compare_instances(one_instance, two_instances, high)
    shares = instance_shares(one_instance, two_instances, high)
    moved = (
        f"the ensemble went from x{statistics.median(shares[0]):.2f} of the single model's "
        f"infer/s to x{statistics.median(shares[1]):.2f}, round by round a change of "
        f"{instances[0]}"
    )
    # the takeaway's short form: one figure, the one the rule judged
    per_block = (
        f"{instances[0]} for the ensemble, each block of rounds read against the single model "
        "measured beside it"
    )
    hit_p50 = float(hits.loc[hits["kind"] == "hit", "p50_ms"].median())
    miss_p50 = float(hits.loc[hits["kind"] == "miss", "p50_ms"].median())
    share = hit_p50 / miss_p50 if miss_p50 else math.nan
    level = one_instance[one_instance["concurrency"] == low].groupby("model")["p50_ms"].median()
    single_p50, ensemble_p50 = float(level.get("minilm")), float(level.get("minilm_pipeline"))
    difference = _difference(agreement.max_abs_diff)
    table = pd.DataFrame(
        [
            _row("largest difference, ensemble against one model", difference, "float32 rounding at most"),
            _row(f"ensemble against one model, {low} client", f"{cost[low][0]} ({said_cost[low]})", "within the noise: two hops and a queue of up to 2 ms"),
            _row(f"ensemble against one model, {high} clients", f"{cost[high][0]} ({said_cost[high]})", "within the noise: two hops and a queue of up to 2 ms"),
            _row(f"2 encoder instances against 1, {high} clients (each block against the single model beside it)", _said(*instances), "a gain, up to about x2: one instance leaves a core idle"),
            _row("repeated text p50, cached (ms)", f"{hit_p50:.2f} against {miss_p50:.1f} for a new text", "a small fraction of a new text's"),
            *([_row("repeated text p50 through the ensemble, cached (ms)", _hit_miss(pipeline_hits), "a small fraction of a new text's")] if pipeline_hits is not None else []),
            _row("answers held after twice the cache's size was offered", _held(eviction), "what fits, the least recently used gone"),
            *([_row("ask's answer against the client's steps", _agree(asked), "the same greedy answer")] if asked is not None else []),
        ]
    )  # fmt: skip
    served = [
        float(
            frame[(frame["concurrency"] == high) & (frame["model"] == "minilm_pipeline")][
                "throughput"
            ].median()
        )
        for frame in (one_instance, two_instances)
    ]
    load = float(two_instances.get("load_average", pd.Series(dtype=float)).max())
    why_instances = {
        "a gain": "each encoder instance runs one torch thread, so one kept one core busy and "
        "left the other to the tokenizer, the server and the load generator, which wait most of "
        "the time while a long text is encoded; a second instance put that idle time to work, "
        "as a second instance did in notebook 07.",
        "within the noise": "a second instance gains only the time the other core is idle, and "
        "here the tokenizer, the server, the load generator"
        + (
            f" and whatever else ran (load average up to {load:.1f} on 2 cores during the rounds)"
            if load == load
            else ""
        )
        + " left it too little to show beyond this host's noise.",
        "a loss": "the two instances took turns on cores that were already busy: there was no "
        "idle time for a second instance to use.",
    }[instances[1]]
    text = "\n".join(
        [
            f"Same answers: {agreement}.",
            (
                f"The ensemble's cost: at {low} client it served {cost[low][0]} of the single "
                f"model's and at {high} clients {cost[high][0]}, both {said_cost[low]}. "
                if said_cost[low] == said_cost[high]
                else f"The ensemble's cost: at {low} client it served {cost[low][0]} of the "
                f"single model's ({said_cost[low]}), at {high} clients {cost[high][0]} "
                f"({said_cost[high]}). "
            )
            + "(Each is the median of the rounds' own ratios, the single model measured beside "
            "the ensemble in the same round, so it need not equal the ratio of the medians in the "
            "rounds' table.) "
            + f"At {low} client the median request took {ensemble_p50:.1f} ms through the ensemble "
            f"and {single_p50:.1f} ms through the single model: {_why_cost(cost[low][1])}",
            f"With a second encoder instance the ensemble served {served[1]:.1f} infer/s at "
            f"{high} clients against {served[0]:.1f} with one, but the two blocks ran minutes "
            "apart, and this host drifts between them. So each block is read against the single "
            f"model, unchanged and measured in turns beside the ensemble: {moved} (the median "
            "of the rounds' changes, which need not equal the ratio of the two medians before "
            f"it, and is what the rule judges: {instances[1]}): "
            f"{why_instances}",
            f"The response cache: a repeated text took {hit_p50:.2f} ms (p50) against "
            f"{miss_p50:.1f} ms for a new one, {share:.3f} of it, because a hit never reaches the "
            "model. Offered about twice its size in new answers, the cache kept what fits, "
            f"{eviction.entries} answers filling {eviction.util:.0%} (by its own gauge) of its "
            f"{eviction.cache_bytes // 1024} KiB, and evicted the rest"
            + (
                ", the first request's included: sent again, it was a miss."
                if eviction.first_evicted
                else "."
            ),
            *([_pipeline_cache(pipeline_hits)] if pipeline_hits is not None else []),
            *([_ask_brief(asked)] if asked is not None else []),
        ]
    )
    takeaway = (
        f"A repeated request came from Triton's response cache in {hit_p50:.2f} ms against "
        f"{miss_p50:.0f} ms for a new one, and the cache stayed within its size by evicting "
        "the least recently used answers.",
        "The ensemble of a tokenizer step and an encoder step gave the single model's "
        f"embeddings, and with {high} clients served {cost[high][0]} against it "
        f"({said_cost[high]}).",
        f"A second encoder instance was {instances[1]} on 2 cores ({per_block}), because each "
        "instance runs one torch thread and a second one uses the core the first leaves idle."
        if instances[1] == "a gain"
        else f"A second encoder instance was {instances[1]} on 2 cores ({per_block}): it gains "
        "only the time a core is idle.",
    )
    figures = {
        "largest difference between the ensemble's and one model's vectors": agreement.max_abs_diff,
        f"ensemble_against_single_model_c{low}": cost[low][0],
        f"ensemble_against_single_model_c{high}": cost[high][0],
        "ensemble with 2 encoder instances against 1, each read against the single model "
        f"beside it_c{high}": instances[0],
        "cache_hit_p50_ms": hit_p50,
        "cache_miss_p50_ms": miss_p50,
    }
    return Conclusion(table=table, figures=figures, text=text, takeaway=takeaway)


def _p50s(hits: pd.DataFrame) -> tuple[float, float]:
    """The median over the rounds of the hits' p50 and of the misses' p50 (ms)."""
    hit = float(hits.loc[hits["kind"] == "hit", "p50_ms"].median())
    return hit, float(hits.loc[hits["kind"] == "miss", "p50_ms"].median())


def _hit_miss(hits: pd.DataFrame) -> str:
    hit, miss = _p50s(hits)
    return f"{hit:.2f} against {miss:.1f} for a new text"


def _pipeline_cache(hits: pd.DataFrame) -> str:
    hit, miss = _p50s(hits)
    return (
        f"Through the ensemble, whose cache sits at its door, a repeated text took {hit:.2f} ms "
        f"against {miss:.1f} ms for a new one: a hit runs neither step."
    )


def _agree(asked: pd.DataFrame) -> str:
    return "the same" if asked["text"].nunique() == 1 else "different"


def _ask_brief(asked: pd.DataFrame) -> str:
    medians = asked.groupby("way", sort=False)["ttft_s"].median()
    inside, outside = medians.iloc[0], medians.iloc[1]
    return (
        f"Retrieve, then generate: ask (one request, BLS) and the same steps from the client gave "
        f"{'the same' if _agree(asked) == 'the same' else 'different'} greedy answers, the first "
        f"piece after {inside:.2f} s and {outside:.2f} s."
    )


def _cost_words(ratio: Ratio, verdict: str) -> str:
    """The ensemble's cost in words: within the noise is what the prediction said (two hops and
    a queue of up to 2 ms, against tens of milliseconds of encoding)."""
    del ratio  # the verdict is the rule's, read from the rounds
    return "within the noise, as predicted" if verdict == "within the noise" else verdict


def _why_cost(verdict: str) -> str:
    """Why the ensemble at one client came out as it did: its extra hops, or the host."""
    hops = "the two extra process hops (the tokenizer's ids cross shared memory to the encoder)"
    if verdict == "a loss":
        return f"that difference is what {hops} and a second queue cost."
    if verdict == "a gain":
        return (
            f"{hops} cannot make a request faster, so the difference lies elsewhere: in the "
            "steps' own code (the tokenizer step calls the Rust tokenizer directly, the single "
            "model goes through transformers' wrapper) or in this host's drift between turns. "
            "This measurement does not tell which."
        )
    return f"{hops} cost less than this host's drift between rounds."


def _difference(value: float) -> str:
    return "0 (the same float32 numbers)" if value == 0 else f"{value:.1e}"


def _row(what: str, measured: str, predicted: str) -> dict:
    return {"figure": what, "measured": measured, "the mechanism predicts": predicted}


def _held(eviction) -> str:
    return (
        f"{eviction.entries} of the {eviction.requests} offered "
        f"({eviction.util:.0%} of {eviction.cache_bytes // 1024} KiB)"
    )


def _said(ratio: Ratio, verdict: str) -> str:
    return f"{ratio} ({verdict})"
