"""Notebook 06's figures and verdicts: vLLM in Triton against the lab's in-flight model (in
tokens/s, and in the time of one step), against vLLM's own server, and in bfloat16 against
float32, each judged round by round; why a verdict comes out as it does is the notebook's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Verdict
from labkit.llm_serving.charts import medians

if TYPE_CHECKING:
    from labkit.llm_serving.benchmark import Benchmark
    from labkit.llm_serving.rounds import Comparison

TOKENS = "output tokens/s"
#: The lesson's comparisons: (what, new way, old way, figure, of). More is better, so the step's
#: ratio is the in-flight model's ITL over vLLM's.
COMPARISONS = (
    ("vLLM in Triton against the lab's in-flight model", "vllm", "inflight",
     "output_tokens_per_s", TOKENS),
    ("vLLM's step against the in-flight model's", "inflight", "vllm", "itl_p50_ms",
     "steps/s (1 / ITL p50)"),
    ("vLLM in Triton against vLLM's own server", "vllm", "vllm-standalone",
     "output_tokens_per_s", TOKENS),
    ("vLLM in bfloat16 against float32", "vllm_bf16", "vllm", "output_tokens_per_s", TOKENS),
)  # fmt: skip
_NAMES = {"inflight": "the lab's in-flight model", "vllm": "vLLM in Triton"}


def per_round(comparison: Comparison, new: str, old: str, key: str = "output_tokens_per_s"):
    """``new``'s figure over ``old``'s, round by round (the rounds both measured)."""
    by_round: dict = {}
    for row in comparison.rows:
        by_round.setdefault(row["round"], {})[row["scheduler"]] = row.get(key)
    return [
        ways[new] / ways[old] if ways.get(new) and ways.get(old) else float("nan")
        for _, ways in sorted(by_round.items())
        if new in ways and old in ways
    ]


def verdicts(comparison: Comparison) -> dict[str, Verdict]:
    """Each of :data:`COMPARISONS` whose two ways were measured, judged round by round."""
    ways = set(comparison.ways)
    if not {"inflight", "vllm"} <= ways:
        raise ConfigError(
            f"the comparison measured {', '.join(sorted(ways)) or 'nothing'}; the lesson needs "
            "'inflight' and 'vllm'"
        )
    return {
        what: Verdict(what, per_round(comparison, new, old, key), of)
        for what, new, old, key, of in COMPARISONS
        if new in ways and old in ways
    }


def inflight_conclusion(comparison: Comparison, benchmark: Benchmark | None = None) -> Conclusion:
    """The verdicts, a takeaway made of them, and this run's figures beside the benchmark's."""
    found = verdicts(comparison)
    lead, step, cost, bf16 = (found.get(c[0]) for c in COMPARISONS)
    m = medians(comparison)
    own, vllm = m["inflight"]["itl_p50_ms"], m["vllm"]["itl_p50_ms"]
    steps = f"{vllm:.0f} ms a step against {own:.0f} ms ({step.word}, x{step.median:.2f})"
    takeaway = [f"{_said(lead)}, at {steps}."]
    figures = {
        "vLLM in Triton over the lab's in-flight model": lead.ratio,
        **{f"{name}, output tokens/s": round(m[w]["output_tokens_per_s"], 1) for w, name in _NAMES.items()},
    }  # fmt: skip
    if cost:
        figures["vLLM in Triton over its own server"] = cost.ratio
        takeaway.append(f"{_said(cost)}.")
    if bf16:
        figures["vLLM in bfloat16 over float32"] = bf16.ratio
        a = comparison.answers.get("vllm_bf16") or {}
        same = f", {a['equal_streaming']} of {a['compared']} greedy answers as float32's"
        takeaway.append(f"{_said(bf16)}{same if a.get('compared') else ''}.")
    figures["failed requests"] = sum(m[w]["failed"] for w in m)
    table = beside_benchmark(comparison, benchmark)
    return Conclusion(table, figures, takeaway=tuple(takeaway), verdicts=tuple(found.values()))


def _said(v: Verdict) -> str:
    return f"{v.comparison}: {v.word}, {v.ratio}"


def beside_benchmark(comparison: Comparison, benchmark: Benchmark | None = None) -> pd.DataFrame:
    """This run's headline figures, the benchmark's beside them (the same shape, its own date and
    load), and what only this run checked: greedy answers, failures, bfloat16 instructions."""
    m, h, s = medians(comparison), comparison.host, comparison.settings
    load = comparison.load_average
    pinned = f", server on core {h.get('server_cores')}, AIPerf on core {h.get('client_cores')}"
    lead = verdicts(comparison)[COMPARISONS[0][0]].median  # the verdict's: median of the rounds
    answers = {w: comparison.answers.get(w) or {} for w in (*_NAMES, "vllm_bf16")}
    here = {
        "shape": f"{s.get('concurrency')} clients, {s.get('requests')} requests of {s.get('low')} "
        f"to {s.get('high')} tokens" + (pinned if "server_cores" in h else ""),
        "load average at the start": f"{load[0][0]:.1f}" if load else "-",
        **{f"{name}, output tokens/s": f"{m[w]['output_tokens_per_s']:.1f}" for w, name in _NAMES.items()},
        "vLLM in Triton over the in-flight model": f"x{lead:.2f}",
        **{f"{name}, one step (ITL p50, ms)": f"{m[w]['itl_p50_ms']:.0f}" for w, name in _NAMES.items()},
        **{f"{_NAMES.get(w, 'vLLM in bfloat16')}, greedy answers under load as the plain model's alone":
           f"{a['equal_streaming']} of {a['compared']}" for w, a in answers.items() if a.get("compared")},
        "failed requests": str(sum(m[w]["failed"] for w in m)),
        "this CPU has bfloat16 instructions": {True: "yes", False: "no"}.get(h.get("avx512_bf16"), "-"),
    }  # fmt: skip
    frame = pd.DataFrame({"figure": list(here), "this run": list(here.values())})
    if b := benchmark:
        there = {
            "shape": b.shape(),
            "load average at the start": f"{b.load_average[0]:.1f}",
            **{f"{name}, output tokens/s": f"{b.output_tokens_per_s[w]:.1f}" for w, name in _NAMES.items()},
            "vLLM in Triton over the in-flight model": f"x{b.vllm_lead:.2f}",
            **{f"{name}, one step (ITL p50, ms)": f"{b.itl_p50_ms[w]:.0f}"
               for w, name in _NAMES.items() if w in b.itl_p50_ms},
        }  # fmt: skip
        frame[f"benchmark, {b.date}"] = [there.get(name, "-") for name in here]
    return frame
