"""Notebook 06's lesson: in-flight batching against the other ways of serving, in tokens.

:func:`inflight_conclusion` reads a :class:`~labkit.llm_serving.StudyResult` at one level
(concurrency, workload, client kind) and says, for each way the study measured beside in-flight
batching, whether in-flight gave more or fewer output tokens/s, a sooner or later first token
(TTFT) and a shorter or longer gap between tokens (ITL), each as a :class:`Ratio`; then what
bfloat16 did against float32. A way it does not know (a later study's fourth) is compared too,
under its own name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import GAIN, Conclusion, Ratio, noise_band

if TYPE_CHECKING:
    from labkit.llm_serving import StudyResult

#: The plain names of the ways the lab serves its text model, in the order they are shown.
WAYS = {
    "none": "no batching",
    "dynamic": "dynamic batching",
    "inflight": "in-flight batching",
    "vllm": "vLLM in Triton",
    "vllm-standalone": "vLLM's own server",
    "vllm_bf16": "vLLM in Triton (bfloat16)",
    "vllm_bf16-standalone": "vLLM's own server (bfloat16)",
}

#: The figures compared: row key -> (plain name, unit, is a higher value better?).
MEASURES = {
    "output_tokens_per_s": ("output tokens/s", "", True),
    "ttft_p50_ms": ("TTFT p50", " ms", False),
    "ttft_p99_ms": ("TTFT p99", " ms", False),
    "itl_p50_ms": ("ITL p50", " ms", False),
}

#: How each verdict reads, for a figure where more is better and one where less is.
VERDICTS = {
    True: {"gain": "a gain", "tie": "a tie", "loss": "a loss"},
    False: {"gain": "shorter", "tie": "about the same", "loss": "longer"},
}


def way_name(scheduler: str) -> str:
    """A scheduler's plain name (``dynamic`` -> ``dynamic batching``); an unknown one as itself."""
    return WAYS.get(scheduler, scheduler)


def verdict(ratio: float, higher_is_better: bool, band: float | None = None) -> str:
    """``gain``, ``tie`` or ``loss`` of ``ratio`` (new over old).

    With a noise band (the spread of repeats), a ratio within ``1 +- band`` is a tie; without one
    (a single measurement), a ratio between ``1 / GAIN`` and ``GAIN`` is.
    """
    high, low = (1 + band, 1 - band) if band is not None else (GAIN, 1 / GAIN)
    if ratio != ratio:  # NaN: one side was not measured
        return "tie"
    better = ratio >= high if higher_is_better else ratio <= low
    worse = ratio <= low if higher_is_better else ratio >= high
    return "gain" if better else "loss" if worse else "tie"


def inflight_conclusion(
    study: StudyResult,
    concurrency: int | None = None,
    *,
    workload: str = "mixed",
    streaming: bool = True,
) -> Conclusion:
    """In-flight batching against every other way the study measured, at one level.

    ``concurrency`` defaults to the highest level at which in-flight batching was measured.
    Rows repeated at the same level (same scheduler) are averaged, and their spread is the noise
    band; a single measurement per way is judged with :data:`GAIN` and said to be one.
    """
    rows = [r for r in study.rows if (r["workload"], r["streaming"]) == (workload, streaming)]
    levels = sorted({r["concurrency"] for r in rows if r["scheduler"] == "inflight"})
    if not levels:
        kind = "streaming" if streaming else "non-streaming"
        raise ConfigError(
            f"the study measured no in-flight batching on the {workload!r} workload with {kind} "
            "clients; measure 'inflight' there, or pass the workload and client kind it measured"
        )
    c = levels[-1] if concurrency is None else concurrency
    by_way: dict[str, list[dict]] = {}
    for r in rows:
        if r["concurrency"] == c:
            by_way.setdefault(r["scheduler"], []).append(r)
    if "inflight" not in by_way:
        raise ConfigError(f"in-flight batching was measured at concurrency {levels}, not at {c}")
    order = [w for w in WAYS if w in by_way] + [w for w in by_way if w not in WAYS]
    means = {w: {k: _mean(by_way[w], k) for k in MEASURES} for w in order}
    repeats = min(len(by_way[w]) for w in order)
    bands = (
        {k: max(noise_band([r[k] for r in by_way[w]]) for w in order) for k in MEASURES}
        if repeats > 1
        else dict.fromkeys(MEASURES)
    )
    others = [w for w in order if w != "inflight"]
    failed = sum(_failed(by_way[w]) for w in order)

    figures: dict = {}
    verdicts: dict[tuple[str, str], str] = {}
    for w in others:
        for key, (name, _, higher) in MEASURES.items():
            ratio = Ratio.between(means["inflight"][key], means[w][key], name)
            figures[_name(w, key)] = ratio
            verdicts[w, key] = verdict(ratio.value, higher, bands[key])
    figures["failed_requests"] = failed

    kind = "streaming" if streaming else "non-streaming"
    lines = [
        f"At concurrency {c} ({workload} answer lengths, {kind} clients), in-flight batching "
        + "served "
        + _compared(means, others, figures, verdicts, "output_tokens_per_s")
        + ".",
        "Its first token came after "
        + _compared(means, others, figures, verdicts, "ttft_p50_ms", "at the median (TTFT p50)")
        + ".",
        "Between two tokens of one answer it took "
        + _compared(means, others, figures, verdicts, "itl_p50_ms", "at the median (ITL p50)")
        + ".",
    ]
    longer = [w for w in others if verdicts[w, "itl_p50_ms"] == "loss"]
    if longer:
        lines.append(_why_itl_is_longer(longer, c, figures, verdicts))
    lines.append(_noise_words(by_way, repeats, bands))
    lines.append(
        "Failed requests: "
        + ", ".join(f"{_failed(by_way[w])} with {way_name(w)}" for w in order)
        + "."
        if failed
        else "Every request was answered (0 failed)."
    )
    limit = (getattr(study, "limit", None) or {}).get(workload)
    if limit and limit.get("concurrency") == c and streaming:
        lines.append(_limit_words(means["inflight"]["output_tokens_per_s"], limit, figures))
    for way in ("vllm", "vllm_bf16"):
        if way in means and f"{way}-standalone" in means:
            lines.append(_triton_cost_words(way, means, figures, bands["output_tokens_per_s"]))
    if getattr(study, "precision", None):
        lines.append(precision_words(study.precision, getattr(study, "host", None) or {}))
        p = study.precision
        figures["bfloat16_vs_float32_output_tokens_per_s"] = Ratio.between(
            p["bfloat16"]["output_tokens_per_s"], p["float32"]["output_tokens_per_s"],
            "output tokens/s",
        )  # fmt: skip

    table = pd.DataFrame(
        [
            {
                "figure": f"{name}{' (ms)' if unit else ''}",
                **{way_name(w): round(means[w][key], 1) for w in order},
            }
            for key, (name, unit, _) in MEASURES.items()
        ]  # fmt: skip
    )
    takeaway = [
        f"At concurrency {c}, in-flight batching's output tokens/s against "
        + _names_with(others, figures, "output_tokens_per_s", verdicts)
        + ".",
        "Its median time to first token against "
        + _names_with(others, figures, "ttft_p50_ms", verdicts)
        + "; between tokens against "
        + _names_with(others, figures, "itl_p50_ms", verdicts)
        + ".",
        f"{failed} failed request(s)"
        + (
            f"; bfloat16 against float32: {figures['bfloat16_vs_float32_output_tokens_per_s']}."
            if "bfloat16_vs_float32_output_tokens_per_s" in figures
            else "."
        ),
    ]
    return Conclusion(table, figures, "\n".join(lines), tuple(takeaway))


def _names_with(others: list[str], figures: dict, key: str, verdicts: dict) -> str:
    """``dynamic batching x1.50 output tokens/s (a gain), ...``: in-flight over each other way."""
    higher = MEASURES[key][2]
    return ", ".join(
        f"{way_name(w)} {figures[_name(w, key)]} ({VERDICTS[higher][verdicts[w, key]]})"
        for w in others
    )


def _value(x: float) -> str:
    """One decimal under 100 (``59.5``), none above (``2485``)."""
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _name(way: str, key: str) -> str:
    """The recorded figure of in-flight over ``way`` for ``key``: ``inflight_vs_dynamic_itl_p50``."""
    return f"inflight_vs_{way}_{key.removesuffix('_ms')}"


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def _failed(rows: list[dict]) -> int:
    return sum(int(r.get("failed") or 0) for r in rows)


def _compared(means, others, figures, verdicts, key: str, how: str = "") -> str:
    """``39.4 output tokens/s: against dynamic batching's 19.8, x1.99 output tokens/s, a gain``"""
    name, unit, higher = MEASURES[key]
    head = f"{_value(means['inflight'][key])}{unit or ' ' + name}" + (f" {how}" if how else "")
    parts = [
        f"against {way_name(w)}'s {_value(means[w][key])}{unit}, "
        f"{figures[_name(w, key)]}, "
        f"{VERDICTS[higher][verdicts[w, key]]}"
        for w in others
    ]
    return head + (": " + "; ".join(parts) if parts else "")


def _why_itl_is_longer(longer: list[str], c: int, figures: dict, verdicts: dict) -> str:
    names = " and ".join(way_name(w) for w in longer)
    paid = [w for w in longer if verdicts[w, "output_tokens_per_s"] == "gain"]
    price = (
        "That is the price of serving the answers together: in all, in-flight batching made "
        + ", ".join(
            f"{figures[f'inflight_vs_{w}_output_tokens_per_s']} against {way_name(w)}" for w in paid
        )
        + "."
        if paid
        else "Here the batch did not make up for it in output tokens/s."
    )
    return (
        f"Why the gap between tokens is longer in flight than with {names}: each generation step "
        f"of the running batch computes the next token of every answer in it (up to {c} here), "
        "and a step in which a request joins also reads that request's prompt. A step for "
        "several answers takes longer than a step for one, so each answer's next token comes "
        f"later. {price}"
    )


def _noise_words(by_way: dict, repeats: int, bands: dict) -> str:
    if repeats > 1:
        widest = max(b for b in bands.values() if b is not None)
        return (
            f"Each figure is the mean of {repeats} or more repeated measurements; a ratio is "
            f"called a gain or a loss only beyond their spread (noise band up to {widest:.0%})."
        )
    requests = sorted({r.get("requests") for rows in by_way.values() for r in rows} - {None})
    of = f" of {requests[0]} requests" if len(requests) == 1 else ""
    return (
        f"Each figure is a single measurement{of} (no repeats): a ratio between "
        f"x{1 / GAIN:.2f} and x{GAIN:.2f} is called a tie, as one run cannot tell it from the "
        "noise."
    )


def _limit_words(served: float, limit: dict, figures: dict) -> str:
    ratio = Ratio.between(served, limit["output_tokens_per_s"], "output tokens/s")
    figures["inflight_served_vs_limit"] = ratio
    said = {
        "gain": "more than the engine alone: a single measurement on a busy machine, not a "
        "real gain (Triton cannot add speed to the engine)",
        "tie": "about as much as the engine alone: Triton, HTTP and the benchmark's clients "
        "cost little here",
        "loss": "less than the engine alone: the difference is what Triton, HTTP and the "
        "benchmark's clients cost",
    }[verdict(ratio.value, True)]
    return (
        f"The same engine in this kernel, without Triton (the in-process limit), made "
        f"{limit['output_tokens_per_s']:.1f} output tokens/s; served, in-flight batching made "
        f"{served:.1f} ({ratio}), {said}."
    )


def _triton_cost_words(way: str, means: dict, figures: dict, band: float | None) -> str:
    """vLLM served through Triton's Python backend against vLLM's own OpenAI server: the same
    engine and settings on the same cores, so the ratio is what the front end costs."""
    served = means[way]["output_tokens_per_s"]
    own = means[f"{way}-standalone"]["output_tokens_per_s"]
    ratio = Ratio.between(served, own, "output tokens/s")
    figures[f"{way}_in_triton_vs_standalone_output_tokens_per_s"] = ratio
    said = {
        "gain": "more than its own server: both run the same engine with the same settings, so "
        "the difference is in the front ends (request handling, detokenizing, framing the "
        "stream) sharing the cores with it",
        "tie": "about as much as its own server: serving it through Triton's Python backend cost "
        "nothing this run can tell from the noise",
        "loss": f"less than its own server: Triton's Python backend cost {1 - ratio.value:.0%} "
        "of its tokens/s here",
    }[verdict(ratio.value, True, band)]
    return (
        f"vLLM's own OpenAI server, on the same cores with the same engine settings, made "
        f"{_value(own)} output tokens/s; {way_name(way)} made {_value(served)} ({ratio}), {said}."
    )


def precision_words(precision: dict, host: dict) -> str:
    """bfloat16 against float32 on the engine: speed (single measurements) and agreement."""
    f32, bf16 = precision["float32"], precision["bfloat16"]
    ratio = Ratio.between(
        bf16["output_tokens_per_s"], f32["output_tokens_per_s"], "output tokens/s"
    )
    figures = f"{bf16['output_tokens_per_s']:.1f} output tokens/s against {f32['output_tokens_per_s']:.1f} ({ratio})"  # fmt: skip
    speed = verdict(ratio.value, True)
    lines = [
        {
            "gain": f"In this kernel, bfloat16 ran faster than float32: {figures}.",
            "tie": f"In this kernel, bfloat16 ran no faster than float32: {figures}, a "
            "difference one measurement cannot tell from the noise.",
            "loss": f"In this kernel, bfloat16 ran slower than float32: {figures}.",
        }[speed]
    ]
    has_bf16 = host.get("avx512_bf16")
    if has_bf16 is True:
        lines.append(
            "This CPU has bfloat16 instructions (AVX512-BF16)"
            + ("." if speed == "gain" else ", yet this single short run did not show them pay.")
        )
    elif has_bf16 is False:
        lines.append(
            "This CPU has no bfloat16 instructions (no AVX512-BF16): it computes bfloat16 "
            "through float32, so bfloat16 saves memory, not time."
        )
    total, agree = precision["compared"], bf16["equal_float32"]
    lines.append(
        f"{agree} of bfloat16's {total} greedy answers equal float32's: where a token's two best "
        "candidates are close, bfloat16 flipped it, and everything after it differs."
        if agree < total
        else f"All {total} of bfloat16's greedy answers equal float32's here; with so few prompts "
        "that shows that none flipped in this run, not that none can (a token whose two best "
        "candidates are close can flip in bfloat16)."
    )
    return " ".join(lines)
