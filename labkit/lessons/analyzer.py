"""Notebook 04's lesson: does any configuration Model Analyzer tries serve faster than the default?

The search measures each configuration once. :func:`search_findings` says what it found, with the
mechanism that explains it: a max batch size at or above the number of clients cannot matter, and
an extra instance on a CPU gains only where the thread budget leaves a core idle and one instance
does not already batch (:func:`~labkit.lessons.instances.predict_instances`, the explanation
notebook 07 gives too). :func:`confirm_winner` reads the rounds in which the default, the search's
winner and its best configuration with another instance count were measured again, in turns
(:func:`labkit.profiling.analyzer.measure_rounds`), and gives one verdict per configuration: a
gain or a loss only when every round agrees beyond :data:`NOISE_FLOOR`, else a tie.

Both read :func:`labkit.profiling.analyzer.ranked`'s table of the search: one row per
configuration (``config``, ``change``, ``instances``, ``max_batch_size``, ``concurrency``,
``throughput``, ``avg_batch_size``, ``compute_infer_ms``, ``is_default``), winner first.
"""

from __future__ import annotations

import os
import statistics

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio
from labkit.lessons.instances import predict_instances

#: A ratio measured in rounds is a gain (or a loss) only when every round's ratio is beyond 1 by
#: more than this (notebook 06 uses the same rule): on this host a few percent is weather.
NOISE_FLOOR = 0.10

#: How each verdict reads after a ratio.
VERDICT_WORDS = {
    "gain": "faster in every round",
    "tie": "a tie, within the noise",
    "loss": "slower in every round",
}


#: Instance counts as a sentence starts them.
_COUNT = {2: "Two", 3: "Three", 4: "Four"}


def verdict(ratios: list[float]) -> str:
    """``gain``, ``tie`` or ``loss`` of per-round ratios (a configuration over the default):
    a gain when every round is above ``1 + NOISE_FLOOR``, a loss when every one is below
    ``1 - NOISE_FLOOR``, else a tie."""
    ratios = [r for r in ratios if r == r]  # NaN: a side was not measured that round
    if len(ratios) < 2:
        raise ConfigError(
            f"a verdict needs two or more rounds that measured both sides, got {len(ratios)}"
        )
    if min(ratios) >= 1 + NOISE_FLOOR:
        return "gain"
    if max(ratios) <= 1 - NOISE_FLOOR:
        return "loss"
    return "tie"


def search_findings(
    search: pd.DataFrame, *, threads: int | None = None, cores: int | None = None
) -> str:
    """What the search found, in a learner's words: the throughput of each instance count, why
    the max batch size cannot matter (when it cannot), what the thread budget predicts for more
    instances, and Model Analyzer's own pick with how far it led the default."""
    _check_search(search)
    default = search[search["is_default"]].iloc[0]
    clients = int(default["concurrency"])
    groups = [
        f"{_range(rows['throughput'])} infer/s with {k} instance{'s' if k > 1 else ''} "
        f"({', '.join(rows['config'])})"
        for k, rows in search.groupby("instances", sort=True)
    ]
    said = [f"The search measured {', and '.join(groups)}."]
    sizes = sorted(set(search["max_batch_size"]))
    if len(sizes) > 1 and min(sizes) >= clients:
        said.append(
            f"A max batch size of {' or '.join(map(str, sizes))} makes no difference here: with "
            f"{clients} clients no execution can take more than {clients} requests."
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
    winner = search.iloc[0]
    if winner["is_default"]:
        said.append("Model Analyzer ranked the default first: no configuration beat it.")
    else:
        lead = Ratio.between(winner["throughput"], default["throughput"], "infer/s")
        said.append(
            f"Model Analyzer ranked {winner['config']} first: {winner['throughput']:.2f} infer/s "
            f"against the default's {default['throughput']:.2f} ({lead}), one measurement each."
        )
    twin = _twin(search)
    if twin is not None:
        said.append(
            f"But {twin['config']} has the default's own settings: the same configuration, "
            f"measured twice in one search, gave {twin['throughput']:.2f} and "
            f"{default['throughput']:.2f} infer/s "
            f"({Ratio.between(twin['throughput'], default['throughput'], 'infer/s')}). That is "
            "the search's noise, and a lead within it names a winner by chance."
        )
    return "\n".join(said)


def confirm_winner(
    rounds: pd.DataFrame,
    search: pd.DataFrame,
    winner: str,
    *,
    threads: int | None = None,
    cores: int | None = None,
) -> Conclusion:
    """The winner (and any other configuration of ``rounds``) against the default, round by round.

    ``rounds`` is :func:`~labkit.profiling.analyzer.measure_rounds`'s table: one measurement of
    each configuration a round (``round``, ``config``, ``throughput``, ``avg_batch_size``,
    ``compute_infer_ms``). Each configuration's ratio to the default is taken within each round,
    so a host that drifts between rounds weighs on both sides alike; :func:`verdict` judges them.
    ``threads`` (torch threads per instance) and ``cores`` (this machine's, by default) let the
    words say what the thread budget predicts for a different instance count.
    """
    _check_search(search)
    default = str(search.loc[search["is_default"], "config"].iloc[0])
    measured = list(dict.fromkeys(rounds["config"]))
    if default not in measured or winner not in measured:
        raise ConfigError(
            f"the rounds must measure the default ({default}) and the winner ({winner}); "
            f"they measured {', '.join(measured)}"
        )
    by = search.set_index("config")
    base = _per_round(rounds, default)
    rows, judged = [], {}
    for name in measured:
        mine = _per_round(rounds, name)
        ratios = [mine[r] / base[r] for r in sorted(mine) if r in base and base[r]]
        judged[name] = (
            statistics.median(ratios),
            verdict(ratios) if name != default else "",
            ratios,
        )
        rows.append(
            {
                "configuration": name,
                "change from the default": by.loc[name, "change"],
                "infer/s, each round": ", ".join(f"{mine[r]:.2f}" for r in sorted(mine)),
                "requests per execution": f"{_median(rounds, name, 'avg_batch_size'):.1f}",
                "one execution (ms)": f"{_median(rounds, name, 'compute_infer_ms'):.0f}",
                "against the default, each round": ", ".join(f"x{q:.2f}" for q in ratios),
                "verdict": VERDICT_WORDS[judged[name][1]] if name != default else "the reference",
            }
        )
    batch = _median(rounds, default, "avg_batch_size")
    clients = int(by.loc[default, "concurrency"])
    first, short_first = _winner_words(winner, default, by, judged, clients, batch)
    text, takeaway = [first], [short_first]
    figures = {"winner": winner}
    if winner != default:
        figures["winner_against_default"] = Ratio(judged[winner][0], "infer/s")
        figures["winner_verdict"] = judged[winner][1]
    for name in measured:
        if name in (default, winner):
            continue
        said, short, key = _other_words(
            name, default, by, rounds, judged[name], batch, threads, cores
        )
        text.append(said)
        takeaway.append(short)
        figures[f"{key}_against_default"] = Ratio(judged[name][0], "infer/s")
        figures[f"{key}_verdict"] = judged[name][1]
    figures["requests_per_execution"] = round(batch, 2)
    text.append(_search_against_rounds(rounds, by, default, clients))
    if len(takeaway) < 3:
        takeaway.append(_once(by, default))
    return Conclusion(pd.DataFrame(rows), figures, "\n".join(text), tuple(takeaway[:3]))


def _winner_words(winner, default, by, judged, clients, batch) -> tuple[str, str]:
    """The winner's verdict with its reason: the long form and the takeaway's sentence."""
    if winner == default:
        said = (
            "Model Analyzer ranked the default first: the rounds measured no other "
            "configuration that beat it in the search."
        )
        return said, "Model Analyzer's search found nothing faster than the default."
    ratio, result = Ratio(judged[winner][0], "infer/s"), judged[winner][1]
    change = by.loc[winner, "change"]
    why = ""
    if result == "tie" and change == "none":
        why = "it has the default's own settings, so its lead in the search was chance"
    elif result == "tie" and change.startswith("max batch size") and "," not in change:
        sizes = (int(by.loc[winner, "max_batch_size"]), int(by.loc[default, "max_batch_size"]))
        if min(sizes) >= clients:
            why = (
                f"it changes only the max batch size ({change.removeprefix('max batch size ')}), "
                f"and {clients} clients never send more requests at once than either allows"
            )
    said = (
        f"Model Analyzer's winner {winner} gave {ratio} against the default "
        f"({_spread(judged[winner][2])}): {VERDICT_WORDS[result]}"
        + (f", because {why}" if why else "")
        + "."
    )
    if why and change != "none":
        said += f" One execution of the default carried {batch:.1f} requests on average."
    short = (
        f"Model Analyzer's winner, {winner}, tied the default ({_spread(judged[winner][2])})"
        + (f": {why}." if why else ".")
        if result == "tie"
        else f"Model Analyzer's winner, {winner} ({_settings(change)}), was {VERDICT_WORDS[result]} "
        f"against the default ({ratio})."
    )
    return said, short


def _other_words(name, default, by, rounds, judged, batch, threads, cores) -> tuple[str, str, str]:
    """Another configuration against the default: the words, the takeaway's sentence, and the
    key its figures are recorded under (``2_instances`` where it differs in instance count)."""
    ratio, result = Ratio(judged[0], "infer/s"), judged[1]
    change = by.loc[name, "change"]
    k, k_default = int(by.loc[name, "instances"]), int(by.loc[default, "instances"])
    said = f"{name} ({change}) gave {ratio} ({_spread(judged[2])}): {VERDICT_WORDS[result]}."
    if k == k_default:
        return said, f"{name} ({change}) gave {ratio} against the default.", "runner_up"
    if threads and k_default == 1 and k > 1:
        predicted = predict_instances(
            instances=k, threads=threads, cores=cores or os.cpu_count() or 1, batch=max(batch, 1.0)
        )
        said += f" {predicted.text}"
    mine_ms, base_ms = (_median(rounds, n, "compute_infer_ms") for n in (name, default))
    shared = k > k_default and mine_ms > base_ms * (1 + NOISE_FLOOR)
    said += (
        f" Measured: one execution took {mine_ms:.0f} ms with {k} instances against "
        f"{base_ms:.0f} ms with {k_default}, for {_median(rounds, name, 'avg_batch_size'):.1f} "
        f"requests against {batch:.1f}"
        + (": the instances' threads shared the cores, not one core each." if shared else ".")
    )
    verb = {"gain": "gained", "tie": "tied", "loss": "lost"}[result]
    short = f"{_COUNT.get(k, k)} instances {verb} ({ratio})" + (
        f": one instance already ran {batch:.1f} requests per execution, so a second only split "
        "its batches on the same cores."
        if result != "gain" and batch >= 1.5
        else "."
    )
    return said, short, f"{k}_instances"


def _search_against_rounds(rounds, by, default, clients) -> str:
    """Why the search's figure of the default differs from the rounds' (or that it agrees)."""
    searched = float(by.loc[default, "throughput"])
    again = _median(rounds, default, "throughput")
    ratio = Ratio.between(again, searched, "infer/s")
    if abs(ratio.value - 1) <= NOISE_FLOOR:
        return (
            f"The search's figure agrees with the rounds': the default gave {searched:.2f} infer/s "
            f"there and {again:.2f} here."
        )
    return (
        f"The search measured the default at {searched:.2f} infer/s, the rounds at {again:.2f} "
        f"({ratio}): the same request from {clients} clients, but one execution took "
        f"{by.loc[default, 'compute_infer_ms']:.0f} ms in the search against "
        f"{_median(rounds, default, 'compute_infer_ms'):.0f} ms in the rounds, so the host ran at "
        "another speed then"
        + (" (and each of the search's servers starts cold)" if again > searched else "")
        + ". Only configurations measured in the same rounds compare."
    )


def _twin(search: pd.DataFrame) -> pd.Series | None:
    """A configuration of the search, other than the default, with the default's own settings."""
    twins = search[(search["change"] == "none") & ~search["is_default"]]
    return twins.iloc[0] if len(twins) else None


def _once(by: pd.DataFrame, default: str) -> str:
    """The takeaway's last sentence: the search measures once, so its winner is measured again."""
    twin = _twin(by.reset_index())
    again = (
        f" (the default's own settings gave {by.loc[default, 'throughput']:.1f} and "
        f"{twin['throughput']:.1f} infer/s in the same search)"
        if twin is not None
        else ""
    )
    return (
        f"Model Analyzer measures each configuration once{again}, so measure its winner again "
        "beside the default, in turns, before you deploy it."
    )


def _spread(ratios: list[float]) -> str:
    """The rounds' ratios as a range: ``x0.80 to x1.10 over 3 rounds``."""
    low, high = min(ratios), max(ratios)
    return f"x{low:.2f} to x{high:.2f} over {len(ratios)} rounds"


def _settings(change: str) -> str:
    """A configuration's change from the default as a parenthesis reads it."""
    return "the default's own settings" if change == "none" else change


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
