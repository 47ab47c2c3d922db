"""Notebook 04's figures: what the search found, and the rounds that measure its answers again.

Both read :func:`labkit.profiling.analyzer.ranked`'s table of the search: one row per
configuration (``config``, ``change``, ``instances``, ``max_batch_size``, ``concurrency``,
``throughput``, ``avg_batch_size``, ``compute_infer_ms``, ``is_default``), winner first. The
rounds are :func:`labkit.profiling.analyzer.measure_rounds`'s table: one measurement of each
configuration a round. Why a verdict comes out as it does is the notebook's markdown.
"""

from __future__ import annotations

import pandas as pd

from labkit import hardware
from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio, Verdict, figure_text, judge
from labkit.lessons.instances import predict_instances, prediction_table

#: A takeaway's lines: Model Analyzer's pick, then a verdict per configuration measured again.
MAX_TAKEAWAY = 3


def verdict(ratios: list[float]) -> str:
    """``gain``, ``tie`` or ``loss`` of per-round ratios (a configuration over the default), by
    the lab's one rule (:func:`~labkit.lessons.conclusion.judge`); it needs two rounds or more."""
    if len([r for r in ratios if r == r]) < 2:  # NaN: a side was not measured that round
        raise ConfigError(f"a verdict needs two or more rounds that measured both sides: {ratios}")
    return judge(ratios)


def search_noise(search: pd.DataFrame) -> float | None:
    """How far apart (max over min, in infer/s) the search measured configurations that cannot
    differ here: those that differ only in a max batch size the clients never fill, or a
    configuration with the default's own settings against the default. None when it has none."""
    sizes = set(search["max_batch_size"])
    if len(sizes) > 1 and min(sizes) >= int(search["concurrency"].max()):
        spreads = [
            rows["throughput"].max() / rows["throughput"].min()
            for _, rows in search.groupby("instances")
            if len(rows) > 1
        ]
        return float(max(spreads)) if spreads else None
    twin = search[(search["change"] == "none") & ~search["is_default"]]
    if twin.empty:
        return None
    pair = [float(twin["throughput"].iloc[0]), float(_default(search)["throughput"])]
    return max(pair) / min(pair)


def search_figures(search: pd.DataFrame, winner: str | None = None) -> dict:
    """Model Analyzer's pick (``winner``, by default its first), its lead over the default (one
    measurement each) and the search's noise: what the search says before it is measured again."""
    _check_search(search)
    pick = search.iloc[0] if winner is None else search.set_index("config").loc[winner]
    noise = search_noise(search)
    return {
        "Model Analyzer's pick": _pick(pick),
        "its lead over the default in the search": Ratio.between(
            pick["throughput"], _default(search)["throughput"], "infer/s"
        ),
        "spread between configurations that cannot differ": Ratio(noise, "infer/s")
        if noise is not None
        else "none searched",
    }


def figures_table(figures: dict) -> pd.DataFrame:
    """Figures as a learner reads them: one row each, a ratio as ``x1.07 infer/s``."""
    shown = {k: v for k, v in figures.items() if not isinstance(v, dict)}
    return pd.DataFrame({"figure": list(shown), "value": [figure_text(v) for v in shown.values()]})


def instance_predictions(
    search: pd.DataFrame, *, threads: int, cores: list[int] | None = None
) -> pd.DataFrame:
    """The thread budget's prediction for the search's most instances against one, on each of
    ``cores`` (by default this host's and one), from the default's requests per execution in
    the search; no rows when it tried one instance only. ``threads`` 0: labkit's budget on each
    core count (every core for one instance, a share for each of ``most``)."""
    _check_search(search)
    most, batch = int(search["instances"].max()), float(_default(search)["avg_batch_size"])
    return prediction_table(
        [
            predict_instances(
                instances=most,
                threads=threads or c,
                threads_each=threads or max(1, c // most),
                cores=c,
                batch=max(batch, 1.0),
            )
            for c in cores or [len(hardware.usable_cores()), 1]
            if most > 1
        ]
    )


def confirm_winner(rounds: pd.DataFrame, search: pd.DataFrame, winner: str) -> Conclusion:
    """Every configuration of ``rounds`` against the default, round by round: one
    :class:`~labkit.lessons.conclusion.Verdict` each (Model Analyzer's ``winner`` first), the
    rounds' table, the figures and the takeaway. Each ratio is taken within a round, so a host
    that drifts between rounds weighs on both sides alike."""
    _check_search(search)
    by = search.set_index("config")
    default = str(_default(search)["config"])
    needed = [default] + ([winner] if by.loc[winner, "change"] != "none" else [])
    if missing := [n for n in needed if n not in set(rounds["config"])]:
        raise ConfigError(f"the rounds must measure {', '.join(needed)}; they lack {missing}")
    others = sorted(
        set(rounds["config"]) - {default}, key=lambda n: (n != winner, by.loc[n, "rank"])
    )
    base, verdicts, figures = _per_round(rounds, default), [], search_figures(search, winner)
    for name in others:
        mine = _per_round(rounds, name)
        ratios = [mine[r] / base[r] if base.get(r) else float("nan") for r in sorted(mine)]
        verdict(ratios)  # two rounds or more
        pick = " (Model Analyzer's pick)" if name == winner else ""
        change = by.loc[name, "change"]
        verdicts.append(Verdict(f"{change} against the default{pick}", ratios, "infer/s"))
        figures[f"{change} against the default"] = verdicts[-1].ratio
    figures["verdicts"] = {
        by.loc[n, "change"]: v.word for n, v in zip(others, verdicts, strict=True)
    }
    table = pd.DataFrame(
        {
            "configuration": name,
            "rank in the search": int(by.loc[name, "rank"]),
            "change from the default": by.loc[name, "change"],
            "infer/s in the search": round(float(by.loc[name, "throughput"]), 2),
            "infer/s, each round": ", ".join(f"{t:.2f}" for t in _per_round(rounds, name).values()),
            "requests per execution": round(_median(rounds, name, "avg_batch_size"), 1),
            "compute of each request's batch (ms)": round(
                _median(rounds, name, "compute_infer_ms"), 0
            ),
        }
        for name in [default, *others]
    )
    pick, lead = (figures[k] for k in list(figures)[:2])  # the pick, its lead in the search
    first = (
        "Model Analyzer ranked the default first, from one measurement of each configuration."
        if pick == "the default"
        else f"Model Analyzer picked {pick}, {lead} over the default in one measurement each."
    )
    takeaway = (first, *(v.sentence() for v in verdicts))[:MAX_TAKEAWAY]
    return Conclusion(table, figures, "", takeaway, tuple(verdicts))


def _pick(row: pd.Series) -> str:
    if row["is_default"]:
        return "the default"
    return "the default's own settings" if row["change"] == "none" else str(row["change"])


def _default(search: pd.DataFrame) -> pd.Series:
    return search[search["is_default"]].iloc[0]


def _per_round(rounds: pd.DataFrame, name: str) -> dict[int, float]:
    rows = rounds[rounds["config"] == name].sort_values("round")
    return {int(r): float(t) for r, t in zip(rows["round"], rows["throughput"], strict=True)}


def _median(rounds: pd.DataFrame, name: str, column: str) -> float:
    values = rounds.loc[rounds["config"] == name, column].dropna()
    return float(values.median()) if len(values) else float("nan")


def _check_search(search: pd.DataFrame) -> None:
    needed = {"config", "change", "instances", "max_batch_size", "concurrency", "throughput"}
    needed |= {"avg_batch_size", "compute_infer_ms", "is_default"}
    if missing := needed - set(search.columns):
        raise ConfigError(
            f"the search's table lacks {sorted(missing)}: pass analyzer.ranked(result)"
        )
    if not search["is_default"].any():
        raise ConfigError("the search's table has no default configuration (is_default)")
