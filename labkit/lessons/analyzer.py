"""Notebook 04's lesson: is Model Analyzer's winner better than the default, beyond the noise?"""

from __future__ import annotations

import os

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio, noise_band

#: The tutorial's Model Analyzer summary: best config and the default, infer/s.
TUTORIAL_ANALYZER = {"winner": "3 instances, max batch 16", "winner_infer_s": 71.944}
TUTORIAL_ANALYZER_DEFAULT = 63.9384


def confirm_winner(
    default: pd.DataFrame,
    winner: pd.DataFrame,
    name: str,
    *,
    instances: tuple[int, int] | None = None,
    threads: int | None = None,
    cores: int | None = None,
) -> Conclusion:
    """Is the search's winner better than the default, beyond the noise?

    ``default`` and ``winner`` hold repeated perf_analyzer measurements (a ``repeat`` column)
    at one or more concurrencies. The noise band at a level is the larger spread of the two
    configurations' repeats; the winner is called better only where its mean throughput beats
    the default's by more than that band, and slower only where it trails by more.
    ``instances`` (the default's and the winner's instance counts), ``threads`` (torch threads
    per instance) and ``cores`` (this machine's, by default) let the words say how many cores
    each configuration kept busy: on a CPU, that is what extra instances change.
    """
    rows = []
    for c in sorted(set(default["concurrency"]) & set(winner["concurrency"])):
        base = default[default["concurrency"] == c]["throughput"].tolist()
        best = winner[winner["concurrency"] == c]["throughput"].tolist()
        band = max(noise_band(base), noise_band(best))
        change = (sum(best) / len(best)) / (sum(base) / len(base)) - 1
        verdict = "better" if change > band else "slower" if change < -band else "within the noise"
        rows.append(
            {
                "concurrency": c,
                "default infer/s": sum(base) / len(base),
                f"{name} infer/s": sum(best) / len(best),
                "winner / default": 1 + change,  # the same ratio the words give
                "noise band": band,
                "verdict": verdict,
            }
        )
    if not rows:
        raise ConfigError("the default and the winner share no concurrency level")
    table = pd.DataFrame(rows).round(3)
    overall = (
        "better"
        if all(v == "better" for v in table["verdict"])
        else "slower"
        if any(v == "slower" for v in table["verdict"])
        else "not better beyond the noise"
    )
    figures = {
        "winner": name,
        "winner_vs_default": Ratio(float(table["winner / default"].mean()), "infer/s"),
        "noise_band": round(float(table["noise band"].max()), 3),
        "verdict": overall,
    }
    per_level = "; ".join(
        f"at concurrency {int(r['concurrency'])} {Ratio(r['winner / default'], 'infer/s')} (noise "
        f"band {r['noise band']:.0%} of the mean): {r['verdict']}"
        for r in rows
    )
    text = (
        f"Measured again after warm-up, {name} against the default: {per_level}. So the winner "
        f"is {overall}. The tutorial's search on an A6000 found "
        f"{TUTORIAL_ANALYZER['winner']} at {TUTORIAL_ANALYZER['winner_infer_s']:.1f} infer/s "
        f"against {TUTORIAL_ANALYZER_DEFAULT:.1f} for its default ("
        f"{Ratio(TUTORIAL_ANALYZER['winner_infer_s'] / TUTORIAL_ANALYZER_DEFAULT, 'infer/s')}). "
        + _cores_used(instances, threads, cores or os.cpu_count() or 1)
    )
    if is_default(name):
        # The search kept the default: measuring it twice shows this host's noise, no gain.
        text = (
            f"Model Analyzer ranked the default configuration ({name}) first: no candidate beat "
            f"it. Measured twice more, it gave {per_level}: the difference between two "
            "measurements of the same configuration, this host's noise. "
            + _cores_used(instances, threads, cores or os.cpu_count() or 1)
        )
        first = (
            f"Model Analyzer kept the default ({name}): measured twice, it gave "
            f"{figures['winner_vs_default']} against itself, this host's noise."
        )
    else:
        first = (
            f"Model Analyzer's winner, {name}, measured again: {figures['winner_vs_default']} "
            f"against the default, {overall}."
        )
    takeaway = (
        first,
        "Per level: "
        + "; ".join(
            f"{Ratio(r['winner / default'], 'infer/s')} at {int(r['concurrency'])}" for r in rows
        )
        + f", in a noise band up to {figures['noise_band']:.0%} of the mean.",
        f"The tutorial's A6000 search gave "
        f"{Ratio(TUTORIAL_ANALYZER['winner_infer_s'] / TUTORIAL_ANALYZER_DEFAULT, 'infer/s')} "
        f"for {TUTORIAL_ANALYZER['winner']}; this host gave {figures['winner_vs_default']}.",
    )
    return Conclusion(table, figures, text, takeaway)


def is_default(name: str) -> bool:
    """Whether Model Analyzer's configuration ``name`` is the model's own (``<model>_config_default``)."""
    return name.endswith("_config_default")


def _cores_used(instances: tuple[int, int] | None, threads: int | None, cores: int) -> str:
    """What instance counts mean on a CPU: how many cores each configuration can keep busy."""
    if not instances or not threads:
        return (
            "On a CPU, an extra instance gains only by putting cores to work that the others "
            "left idle; where every core is already busy, instances compete for them."
        )
    (d, w), t = instances, threads
    used_d, used_w = min(d * t, cores), min(w * t, cores)
    said = (
        f"Here each instance runs {t} torch thread(s): the default's {d} instance(s) can keep "
        f"{used_d} of the {cores} cores busy, the winner's {w} can keep {used_w}."
    )
    if used_w > used_d:
        return f"{said} Its extra instances put idle cores to work, which a GPU does not need."
    if used_w < used_d:
        return f"{said} It keeps fewer cores busy, so whatever it gains comes from batching."
    return f"{said} Both keep the same cores busy: instances alone cannot gain here."
