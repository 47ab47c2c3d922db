"""Notebook 04's lesson: does any configuration Model Analyzer tries serve faster than the default?

The search measures each configuration once. :func:`search_findings` says what it found, with the
mechanism that explains it: a max batch size at or above the number of clients cannot matter, and
an extra instance on a CPU gains only where the thread budget leaves a core idle
(:func:`~labkit.lessons.instances.predict_instances`, the explanation notebook 07 gives too) and
that core is really idle: the time of one execution, with more instances against one, says
whether each instance had a core of its own. :func:`confirm_winner` reads the rounds in which the default and the
search's best-ranked configuration of each instance count were measured again, in turns
(:func:`labkit.profiling.analyzer.measure_rounds`), and gives one verdict per configuration by
the lab's one rule (:data:`~labkit.lessons.conclusion.NOISE_RULE`). Its words
follow the settings the search varies, not which configuration Model Analyzer ranked first: on
2 shared cores that pick changes from run to run, while what each setting does does not.

Both read :func:`labkit.profiling.analyzer.ranked`'s table of the search: one row per
configuration (``config``, ``change``, ``instances``, ``max_batch_size``, ``concurrency``,
``throughput``, ``avg_batch_size``, ``compute_infer_ms``, ``is_default``), winner first.
"""

from __future__ import annotations

import os
import statistics

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio, judge
from labkit.lessons.instances import predict_instances

#: How much one execution's time, or the default's own figure, may move before the words say it
#: moved: a description of the rounds, not a verdict (verdicts follow
#: :data:`~labkit.lessons.conclusion.NOISE_RULE`).
NOISE_FLOOR = 0.10

#: How each verdict reads after a ratio (a gain or a loss is, by :func:`judge`, the same way in
#: every round).
VERDICT_WORDS = {
    "gain": "faster in every round",
    "tie": "a tie, within the noise",
    "loss": "slower in every round",
}


def _verdict_cell(result: str) -> str:
    """The table's verdict: the rule's word first (the one the run's index shows), then why."""
    return "tie: within the noise" if result == "tie" else f"{result}: {VERDICT_WORDS[result]}"


def verdict_words(result: str, ratios: list[float]) -> str:
    """:data:`VERDICT_WORDS` of ``result``; ``ratios`` are the rounds it was judged on."""
    del ratios  # the verdict already says every round went its way
    return VERDICT_WORDS[result]


#: Instance counts as a sentence starts them.
_COUNT = {2: "Two", 3: "Three", 4: "Four"}


def verdict(ratios: list[float]) -> str:
    """``gain``, ``tie`` or ``loss`` of per-round ratios (a configuration over the default), by
    the lab's one rule (:func:`~labkit.lessons.conclusion.judge`); it needs two rounds or more."""
    ratios = [r for r in ratios if r == r]  # NaN: a side was not measured that round
    if len(ratios) < 2:
        raise ConfigError(
            f"a verdict needs two or more rounds that measured both sides, got {len(ratios)}"
        )
    return judge(ratios)


def search_findings(
    search: pd.DataFrame, *, threads: int | None = None, cores: int | None = None
) -> str:
    """What the search found, in a learner's words: the throughput of each instance count, why
    the max batch size cannot matter (when it cannot) and how far apart the search measured
    configurations that cannot differ (its noise), what the thread budget predicts for more
    instances, and Model Analyzer's own pick with how far it led the default."""
    _check_search(search)
    default = search[search["is_default"]].iloc[0]
    groups = [
        f"{_range(rows['throughput'])} infer/s with {k} instance{'s' if k > 1 else ''} "
        f"({', '.join(rows['config'])})"
        for k, rows in search.groupby("instances", sort=True)
    ]
    said = [f"The search measured {', and '.join(groups)}."]
    twins = search[(search["change"] == "none") & ~search["is_default"]]["config"].tolist()
    if twins:
        said.append(
            f"{', '.join(twins)} {'has' if len(twins) == 1 else 'have'} the default's own "
            "settings: Model Analyzer's search reaches the default's point again as one of its "
            "configurations, and measures it as a configuration of its own."
        )
    clients = int(default["concurrency"])
    noise = search_noise(search)
    if _batch_cannot_matter(search):
        sizes = sorted(set(search["max_batch_size"]))
        said.append(
            f"A max batch size of {' or '.join(map(str, sizes))} makes no difference here: with "
            f"{clients} clients no execution can take more than {clients} requests. Yet "
            f"configurations that differ only in it, or not at all, measured up to x{noise:.2f} "
            "apart: that is "
            "the search's noise, with one measurement each."
        )
    elif noise is not None:
        said.append(
            f"The configuration with the default's own settings measured x{noise:.2f} apart from "
            "the default: that is the search's noise, with one measurement each."
        )
    most = int(search["instances"].max())
    if threads and most > 1 and default["avg_batch_size"] == default["avg_batch_size"]:
        said.append(
            predict_instances(
                instances=most,
                threads=threads,
                cores=cores or os.cpu_count() or 1,
                batch=max(float(default["avg_batch_size"]), 1.0),
            ).text
        )
    more = search[search["instances"] > int(default["instances"])]
    if not more.empty:
        best = more.iloc[0]  # the best-ranked: Model Analyzer's own order
        said.append(
            _cores_evidence(
                int(best["instances"]),
                int(default["instances"]),
                float(best["compute_infer_ms"]),
                float(default["compute_infer_ms"]),
                f"in the search ({best['config']})",
            )
        )
    winner = search.iloc[0]
    if winner["is_default"]:
        said.append("Model Analyzer ranked the default first: no configuration beat it.")
    else:
        lead = Ratio.between(winner["throughput"], default["throughput"], "infer/s")
        said.append(
            f"Model Analyzer ranked {winner['config']} ({_settings(winner['change'])}) first: "
            f"{winner['throughput']:.2f} infer/s against the default's "
            f"{default['throughput']:.2f} ({lead}), one measurement each."
        )
    return "\n".join(said)


def search_noise(search: pd.DataFrame) -> float | None:
    """How far apart (max over min, in infer/s) the search measured configurations that cannot
    differ here: those that differ only in a max batch size the clients never fill, or a
    configuration with the default's own settings against the default. None when it has none."""
    if _batch_cannot_matter(search):
        spreads = [
            rows["throughput"].max() / rows["throughput"].min()
            for _, rows in search.groupby("instances")
            if len(rows) > 1
        ]
        return float(max(spreads)) if spreads else None
    twin = search[(search["change"] == "none") & ~search["is_default"]]
    if twin.empty:
        return None
    pair = [
        float(twin["throughput"].iloc[0]),
        float(search.loc[search["is_default"], "throughput"].iloc[0]),
    ]
    return max(pair) / min(pair)


def confirm_winner(
    rounds: pd.DataFrame,
    search: pd.DataFrame,
    winner: str,
    *,
    threads: int | None = None,
    cores: int | None = None,
) -> Conclusion:
    """Every configuration of ``rounds`` against the default, round by round, and where Model
    Analyzer's ``winner`` stands among them.

    ``rounds`` is :func:`~labkit.profiling.analyzer.measure_rounds`'s table of the configurations
    :func:`~labkit.profiling.analyzer.contenders` picks (the default, and the best-ranked
    configuration of each instance count that changes something): one measurement of each a
    round (``round``, ``config``, ``throughput``, ``avg_batch_size``, ``compute_infer_ms``). Each
    ratio to the default is taken within a round, so a host that drifts between rounds weighs on
    both sides alike; :func:`verdict` judges them. The words and the takeaway follow the
    settings the search varies (the max batch size, the instance count), so they say the same
    thing whichever configuration Model Analyzer happened to rank first. ``threads`` (torch
    threads per instance) and ``cores`` (this machine's, by default) let the words say what the
    thread budget predicts for another instance count.
    """
    _check_search(search)
    by = search.set_index("config")
    default = str(search.loc[search["is_default"], "config"].iloc[0])
    measured = list(dict.fromkeys([default, *rounds["config"]]))
    needed = [default] + ([winner] if by.loc[winner, "change"] != "none" else [])
    if missing := [n for n in needed if n not in set(rounds["config"])]:
        raise ConfigError(
            f"the rounds must measure the default ({default}) and the winner ({winner}); "
            f"they lack {', '.join(missing)}"
        )
    base = _per_round(rounds, default)
    judged, rows = {}, []
    for name in measured:
        mine = _per_round(rounds, name)
        ratios = [mine[r] / base[r] for r in sorted(mine) if r in base and base[r]]
        judged[name] = (statistics.median(ratios), verdict(ratios), ratios)
        rows.append(
            {
                "configuration": name,
                "rank in the search": int(by.loc[name, "rank"]) if "rank" in by else "",
                "change from the default": by.loc[name, "change"],
                "infer/s, each round": ", ".join(f"{mine[r]:.2f}" for r in sorted(mine)),
                "requests per execution": f"{_median(rounds, name, 'avg_batch_size'):.1f}",
                "compute of each request's batch (ms)": f"{_median(rounds, name, 'compute_infer_ms'):.0f}",
                "against the default, each round": ", ".join(f"x{q:.2f}" for q in ratios),
                "verdict": _verdict_cell(judged[name][1]) if name != default else "the reference",
            }
        )
    batch = _median(rounds, default, "avg_batch_size")
    text, takeaway = [], []
    change = by.loc[winner, "change"]
    figures: dict = {
        "Model Analyzer's pick": "the default's settings" if change == "none" else str(change)
    }
    verdicts = {}
    for name in measured:
        if name == default:
            continue
        said, short, label = _contender_words(
            name, winner, default, by, rounds, judged[name], batch, threads, cores
        )
        text.append(said)
        takeaway.append(short)
        figures[f"{label.replace(' ', '_')}_against_default"] = Ratio(judged[name][0], "infer/s")
        verdicts[label] = judged[name][1]
    figures["verdicts"] = verdicts
    figures["the default's requests per execution, in the rounds"] = round(batch, 1)
    noise = search_noise(search)
    if noise is not None:
        figures["spread between configurations that cannot differ"] = Ratio(noise, "infer/s")
    text.append(_drift(base))
    text.append(_search_against_rounds(rounds, by, default, cores))
    last = _pick_words(winner, by, noise)
    text.append(last)
    return Conclusion(
        pd.DataFrame(rows), figures, "\n".join(text), (*takeaway[: MAX_TAKEAWAY - 1], last)
    )


#: A takeaway's lines: one per setting the search varies (two), and Model Analyzer's pick.
MAX_TAKEAWAY = 3


def _label(name: str, default: str, by: pd.DataFrame) -> str:
    """What a contender stands for, as its figures are named: ``max batch size 4`` for a change
    of the max batch size alone, ``2 instances`` for another instance count, else its change."""
    k, k_default = int(by.loc[name, "instances"]), int(by.loc[default, "instances"])
    if k != k_default:
        return f"{k} instances"
    change = str(by.loc[name, "change"])
    if change.startswith("max batch size") and "," not in change:
        return f"max batch size {int(by.loc[name, 'max_batch_size'])}"
    return "same settings" if change == "none" else change


def _contender_words(name, winner, default, by, rounds, judged, batch, threads, cores):
    """One configuration against the default: its words, the takeaway's sentence, its label."""
    ratio, result, ratios = Ratio(judged[0], "infer/s"), judged[1], judged[2]
    change, label = str(by.loc[name, "change"]), _label(name, default, by)
    k, k_default = int(by.loc[name, "instances"]), int(by.loc[default, "instances"])
    who = f"{name} ({change})" + (", Model Analyzer's winner," if name == winner else "")
    said = f"{who} gave {ratio} against the default ({_spread(ratios)}): "
    said += verdict_words(result, ratios)
    if k == k_default:
        sizes = (int(by.loc[name, "max_batch_size"]), int(by.loc[default, "max_batch_size"]))
        clients = int(by.loc[default, "concurrency"])
        if label.startswith("max batch size") and result == "tie" and min(sizes) >= clients:
            said += (
                f", because {clients} clients never send more requests at once than either max "
                f"batch size allows (one execution of the default carried {batch:.1f})."
            )
            short = (
                f"A max batch size of {sizes[0]} tied with the default's {sizes[1]} "
                f"({_spread(ratios)}): {clients} clients never exceed either."
            )
        elif label.startswith("max batch size") and min(sizes) >= clients:
            mine = _median(rounds, name, "avg_batch_size")
            grouped = (
                f"its executions carried {mine:.1f} requests each against the default's "
                f"{batch:.1f}: the {clients} closed-loop clients fell into other groups on the "
                "two servers (notebook 03), which no max batch size set"
                if abs(mine - batch) > NOISE_FLOOR * batch
                else "its executions carried as many requests as the default's, so this run "
                "does not show where the difference came from: measure it again"
            )
            said += (
                f", where {clients} clients never send more requests at once than either max "
                f"batch size allows, so the limit did not cause it: {grouped}."
            )
            short = (
                f"A max batch size of {sizes[0]} was {verdict_words(result, ratios)} against the "
                f"default's {sizes[1]} ({ratio}), though {clients} clients never exceed either: "
                f"its executions carried {mine:.1f} requests against {batch:.1f}."
            )
        elif label.startswith("max batch size"):
            said += "."
            short = (
                f"A max batch size of {sizes[0]} tied with the default's {sizes[1]} "
                f"({_spread(ratios)})."
                if result == "tie"
                else f"A max batch size of {sizes[0]} was {verdict_words(result, ratios)} against the "
                f"default's {sizes[1]} ({ratio})."
            )
        else:
            said += "."
            short = (
                f"{name} ({change}) gave {ratio} against the default: "
                f"{verdict_words(result, ratios)}."
            )
        return said, short, label
    said += "."
    if threads and k_default == 1 and k > 1:
        predicted = predict_instances(
            instances=k, threads=threads, cores=cores or os.cpu_count() or 1, batch=max(batch, 1.0)
        )
        said += f" {predicted.text}"
    mine_ms, base_ms = (_median(rounds, n, "compute_infer_ms") for n in (name, default))
    said += " " + _cores_evidence(k, k_default, mine_ms, base_ms, "in the rounds")
    searched = [float(by.loc[n, "compute_infer_ms"]) for n in (name, default)]
    shared_now = mine_ms > base_ms * (1 + NOISE_FLOOR)
    shared_then = searched[0] > searched[1] * (1 + NOISE_FLOOR)
    if k > k_default and shared_now != shared_then:
        lead = Ratio.between(by.loc[name, "throughput"], by.loc[default, "throughput"], "infer/s")
        said += (
            f" In the search it was the other way ({searched[0]:.0f} against {searched[1]:.0f} "
            f"ms, {lead}): "
            + (
                "the search's server could use a second core, the rounds' had one"
                if shared_now and cores == 1
                else "the second core was free then and busy during the rounds"
                if shared_now
                else "the second core was busy then and free during the rounds"
            )
            + ", so more instances gain only where a core is really idle."
        )
    verb = {"gain": "gained", "tie": "tied", "loss": "lost"}[result]
    slower = mine_ms / base_ms if base_ms else float("nan")
    if k > k_default and slower > 1 + NOISE_FLOOR:
        why = (
            f": their executions took x{slower:.2f} as long as one instance's, so they shared the "
            "cores instead of each having one"
        )
    elif k > k_default and slower == slower:
        why = (
            ": each ran its executions about as fast as one instance, on a core of its own, "
            "with fewer requests in each"
        )
    else:
        why = ""
    # the best-ranked configuration of an instance count can change more than it (max batch size
    # 8 -> 4, 2 instances): the sentence names the rest, not 'two instances' alone
    others = ", ".join(part for part in change.split(", ") if "instance" not in part)
    count = f"{_COUNT.get(k, k)} instances" + (f" (with {others} too)" if "," in change else "")
    short = f"{count} {verb} ({ratio}){why}."
    if k > k_default and cores == 1:  # the rounds' server had one core, the search's them all
        searched_lead = Ratio.between(
            by.loc[name, "throughput"], by.loc[default, "throughput"], "infer/s"
        )
        noise = search_noise(by.reset_index())
        lead = max(searched_lead.value, 1 / searched_lead.value)
        searched = (
            f"made {searched_lead} against the default in the search, within its noise (x"
            f"{noise:.2f} between configurations that cannot differ)"
            if noise is not None and lead <= noise
            else f"made {searched_lead} against the default in the search, where the server "
            "could use every core"
        )
        short = (
            f"{count} {searched}, and {verb} ({ratio}) measured again with the server on one "
            "core: an instance gains only where a core is idle."
        )
    return said, short, label


def _cores_evidence(k: int, k_default: int, mine_ms: float, base_ms: float, where: str) -> str:
    """Whether more instances each had a core: the time of one execution, theirs against one
    instance's. As long as one instance's, each had a core of its own (and the throughput follows
    the executions they run side by side); much longer, their threads took turns on shared cores
    (other work on the host, the client, each other)."""
    shared = k > k_default and mine_ms > base_ms * (1 + NOISE_FLOOR)
    said = (
        f"Measured {where}: the execution a request ran in took {mine_ms:.0f} ms with {k} "
        f"instances against "
        f"{base_ms:.0f} ms with {k_default}"
    )
    if k <= k_default or mine_ms != mine_ms or base_ms != base_ms:
        return said + "."
    if shared:
        return said + ": the instances' threads shared the cores, not one core each."
    return (
        said + ": each instance had a core of its own, and ran its smaller batches about as fast "
        "as one instance ran its larger ones."
    )


def _pick_words(winner: str, by: pd.DataFrame, noise: float | None) -> str:
    """Model Analyzer's pick, and what to do with a search's winner: the takeaway's last line."""
    if bool(by.loc[winner, "is_default"]):
        named = "Model Analyzer ranked the default first"
    elif by.loc[winner, "change"] == "none":
        named = (
            "Model Analyzer picked a configuration with the default's own settings, that is: "
            "keep the default,"
        )
    else:
        named = f"Model Analyzer picked {by.loc[winner, 'change']}"
    lead = float(by.loc[winner, "throughput"]) / float(
        by.loc[by["is_default"]].iloc[0]["throughput"]
    )
    apart = (
        f" (configurations that cannot differ here measured up to x{noise:.2f} apart)"
        if noise is not None and lead <= noise
        else f", x{lead:.2f} ahead of the default, beyond the x{noise:.2f} between configurations "
        "that cannot differ here"
        if noise is not None
        else ""
    )
    return (
        f"{named} from one measurement of each configuration{apart}: a search's pick holds for "
        "the cores and the load it was measured with, so measure it again, in turns, where you "
        "will deploy it."
    )


def _drift(base: dict[int, float]) -> str:
    """How far the default itself moved between rounds: the host's own drift, which only a
    difference the rounds agree on outlasts."""
    low, high = min(base.values()), max(base.values())
    if high <= low * (1 + 2 * NOISE_FLOOR):
        return (
            f"The default itself stayed within {low:.2f} to {high:.2f} infer/s across the rounds."
        )
    return (
        f"The default itself ranged from {low:.2f} to {high:.2f} infer/s across the rounds "
        f"(x{high / low:.2f}): other work on this host's cores, so only a difference that the "
        "rounds agree on counts."
    )


def _search_against_rounds(rounds, by, default, cores: int | None = None) -> str:
    """Why the search's figure of the default differs from the rounds' (or that it agrees): the
    figures that differ between the two, said side by side, not guessed at."""
    searched = float(by.loc[default, "throughput"])
    again = _median(rounds, default, "throughput")
    ratio = Ratio.between(again, searched, "infer/s")
    if abs(ratio.value - 1) <= NOISE_FLOOR:
        return (
            f"The search's figure agrees with the rounds': the default gave {searched:.2f} infer/s "
            f"there and {again:.2f} here."
        )
    batch = (float(by.loc[default, "avg_batch_size"]), _median(rounds, default, "avg_batch_size"))
    ms = (float(by.loc[default, "compute_infer_ms"]), _median(rounds, default, "compute_infer_ms"))
    where = (
        f"the search's server could use every core of this host and the rounds' {cores}"
        if cores
        else "the two servers had other cores"
    )
    return (
        f"The search measured the default at {searched:.2f} infer/s, the rounds at {again:.2f} "
        f"({ratio}), with the same request from {int(by.loc[default, 'concurrency'])} clients: "
        f"{where}, its executions carried {batch[0]:.1f} requests against {batch[1]:.1f} and "
        f"took {ms[0]:.0f} ms against {ms[1]:.0f} ms, at another moment of a host whose speed "
        "drifts. Which of these made the difference this run cannot tell apart: only "
        "configurations measured in the same rounds compare."
    )


def _batch_cannot_matter(search: pd.DataFrame) -> bool:
    """Whether the search varies max batch sizes that its clients can never fill."""
    sizes = set(search["max_batch_size"])
    return len(sizes) > 1 and min(sizes) >= int(search["concurrency"].max())


def _settings(change: str) -> str:
    """A configuration's change from the default as a parenthesis reads it."""
    return "the default's own settings" if change == "none" else change


def _spread(ratios: list[float]) -> str:
    """The rounds' ratios as a range: ``x0.80 to x1.10 over 3 rounds``."""
    return f"x{min(ratios):.2f} to x{max(ratios):.2f} over {len(ratios)} rounds"


def _per_round(rounds: pd.DataFrame, name: str) -> dict[int, float]:
    rows = rounds[rounds["config"] == name]
    return {int(r): float(t) for r, t in zip(rows["round"], rows["throughput"], strict=True)}


def _median(rounds: pd.DataFrame, name: str, column: str) -> float:
    values = rounds.loc[rounds["config"] == name, column].dropna()
    return float(values.median()) if len(values) else float("nan")


def _range(values: pd.Series) -> str:
    low, high = float(values.min()), float(values.max())
    return f"{low:.2f}" if round(low, 2) == round(high, 2) else f"{low:.2f} to {high:.2f}"


def _check_search(search: pd.DataFrame) -> None:
    needed = {"config", "change", "instances", "max_batch_size", "concurrency", "throughput"}
    needed |= {"avg_batch_size", "compute_infer_ms", "is_default"}
    if missing := needed - set(search.columns):
        raise ConfigError(
            f"the search's table lacks {sorted(missing)}: pass analyzer.ranked(result)"
        )
    if not search["is_default"].any():
        raise ConfigError("the search's table has no default configuration (is_default)")
