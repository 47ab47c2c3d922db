"""Notebook 06's lesson: the lab's in-flight model, vLLM in Triton and vLLM's own server, in tokens.

:func:`inflight_conclusion` reads a :class:`~labkit.llm_serving.Comparison` (every way measured
in rounds, in turns) and says three things, each with the two or three numbers it rests on:

- how far vLLM's engine leads the lab's in-flight model in output tokens/s, and why: both give
  every running answer one token per step, so the step's time (ITL p50) is where they differ;
- what serving vLLM through Triton costs against vLLM's own server;
- what bfloat16 does on vLLM against float32: speed and greedy agreement.

A ratio is called a gain or a loss by the lab's one rule
(:data:`~labkit.lessons.conclusion.NOISE_RULE`), else within the noise.
Beside this run's lead it states the benchmark's (``labkit bench inflight``, shipped as data with
its date, shape and load average) and why the two can differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion, Ratio, judge
from labkit.llm_serving.charts import medians, results_frame, way_name

if TYPE_CHECKING:
    from labkit.llm_serving.benchmark import Benchmark
    from labkit.llm_serving.rounds import Comparison


def verdict(ratios: list[float]) -> str:
    """``gain``, ``tie`` or ``loss`` of per-round ratios (new over old, more is better), by the
    lab's one rule (:func:`~labkit.lessons.conclusion.judge`)."""
    return judge(ratios)


def per_round(comparison: Comparison, new: str, old: str, key: str = "output_tokens_per_s"):
    """``new``'s figure over ``old``'s, round by round (the rounds both measured)."""
    by_round = {}
    for row in comparison.rows:
        by_round.setdefault(row["round"], {})[row["scheduler"]] = row.get(key)
    return [
        ways[new] / ways[old] if ways.get(new) and ways.get(old) else float("nan")
        for _, ways in sorted(by_round.items())
        if new in ways and old in ways
    ]


def inflight_conclusion(comparison: Comparison, benchmark: Benchmark | None = None) -> Conclusion:
    """What the comparison says, with the benchmark's lead (when given) beside this run's."""
    m = medians(comparison)
    if "inflight" not in m or "vllm" not in m:
        raise ConfigError(
            f"the comparison measured {', '.join(m) or 'nothing'}; the lesson needs the in-flight "
            "model and vLLM in Triton ('inflight' and 'vllm')"
        )
    rounds = min(m[w]["rounds"] for w in m)
    clients = comparison.settings.get("concurrency")
    figures: dict = {}
    lead = _ratio(m, "vllm", "inflight")
    lead_verdict = verdict(per_round(comparison, "vllm", "inflight"))
    # The engine's own speed: the in-flight model's step over vLLM's (more: a faster vLLM). A
    # step's median time holds still where tokens/s, which counts the client's stalls and the
    # queue too, moves with the host between rounds.
    step_verdict = verdict(per_round(comparison, "inflight", "vllm", key="itl_p50_ms"))
    figures["vLLM against the lab's in-flight model"] = lead
    figures["the lab's in-flight model, output tokens/s"] = round(
        m["inflight"]["output_tokens_per_s"], 1
    )
    figures["vLLM_in_Triton_output_tokens_per_s"] = round(m["vllm"]["output_tokens_per_s"], 1)

    text = [_lead_words(comparison, m, lead, lead_verdict, rounds, clients, step_verdict)]
    text.append(_step_words(m, clients))
    if same := _same_answers(comparison):
        text.append(same)
    takeaway = [_lead_takeaway(m, lead, lead_verdict, clients, benchmark, step_verdict)]
    if "vllm-standalone" in m:
        cost = _ratio(m, "vllm", "vllm-standalone")
        cost_verdict = verdict(per_round(comparison, "vllm", "vllm-standalone"))
        figures["vLLM_in_Triton_over_its_own_server"] = cost
        text.append(_triton_cost_words(m, cost, cost_verdict))
        takeaway.append(_cost_takeaway(cost, cost_verdict))
    if "vllm_bf16" in m:
        speed = _ratio(m, "vllm_bf16", "vllm")
        speed_verdict = verdict(per_round(comparison, "vllm_bf16", "vllm"))
        figures["vLLM_bfloat16_over_float32"] = speed
        agreed = comparison.answers.get("vllm_bf16") or {}
        text.append(_precision_words(m, speed, speed_verdict, agreed, comparison.host))
        takeaway.append(_precision_takeaway(speed, speed_verdict, agreed))
    if benchmark is not None:
        text.append(_benchmark_words(benchmark, lead, lead_verdict, comparison, step_verdict, m))
    failed = sum(m[w]["failed"] for w in m)
    figures["failed_requests"] = failed
    text.append(
        "Every request was answered (0 failed)."
        if not failed
        else "Failed requests: "
        + ", ".join(f"{m[w]['failed']} with {way_name(w)}" for w in m)
        + "."
    )
    return Conclusion(results_frame(comparison), figures, "\n".join(text), tuple(takeaway))


def _same_answers(comparison: Comparison) -> str:
    """How many greedy float32 answers under load equalled the plain model's alone, per way that
    was checked (vLLM's own server is measured, not checked: it serves the same engine)."""
    parts = [
        f"{way_name(way)} {a['equal_streaming']} of {a['compared']}"
        for way, a in comparison.answers.items()
        if way != "vllm_bf16" and a.get("compared")
    ]
    if not parts:
        return ""
    return (
        "Greedy answers given 8 at a time, against the plain model's answers alone: "
        + ", ".join(parts)
        + " the same (bfloat16's are counted below)."
    )


def _ratio(m: dict, new: str, old: str) -> Ratio:
    return Ratio.between(
        m[new]["output_tokens_per_s"], m[old]["output_tokens_per_s"], "output tokens/s"
    )


def _spread(comparison: Comparison, new: str, old: str) -> str:
    ratios = per_round(comparison, new, old)
    if len(ratios) < 2:
        return "one round"
    return f"{min(ratios):.2f}x to {max(ratios):.2f}x over {len(ratios)} rounds"


def _tokens(m: dict, way: str) -> str:
    return f"{m[way]['output_tokens_per_s']:.1f}"


def _lead_words(
    comparison, m, lead: Ratio, said: str, rounds: int, clients, step: str = "tie"
) -> str:
    head = (
        f"With {clients} streaming clients, vLLM in Triton served {_tokens(m, 'vllm')} output "
        f"tokens/s and the lab's in-flight model {_tokens(m, 'inflight')} (medians of {rounds} "
        f"round{'s' if rounds > 1 else ''}): {lead.value:.2f}x"
    )
    spread = _spread(comparison, "vllm", "inflight")
    if said == "tie" and step == "gain":
        return (
            f"{head}, a lead in tokens/s that moved with the host between rounds ({spread}); "
            "vLLM's step, the time between two tokens of one answer, was shorter in every round."
        )
    return (
        head
        + {
            "gain": f", ahead in every round ({spread}).",
            "tie": f", a difference this run cannot tell from its noise ({spread}).",
            "loss": f", behind in every round ({spread}).",
        }[said]
    )


def _step_words(m: dict, clients) -> str:
    own, vllm = m["inflight"]["itl_p50_ms"], m["vllm"]["itl_p50_ms"]
    compared = (
        f"vLLM's step took {vllm:.0f} ms where the in-flight model's took {own:.0f} ms"
        if vllm < own
        else f"vLLM's step took {vllm:.0f} ms and the in-flight model's {own:.0f} ms"
    )
    return (
        "Why: both engines batch the same way, every running answer getting one token per step, "
        f"with up to {clients} answers in a step. The time between two tokens of one answer (ITL "
        f"p50) is the time of one step, and there the engines differ: {compared}."
    )


def _lead_takeaway(m: dict, lead: Ratio, said: str, clients, benchmark, step: str = "tie") -> str:
    own, vllm = m["inflight"]["itl_p50_ms"], m["vllm"]["itl_p50_ms"]
    if said == "gain":
        return (
            f"vLLM served the same model at {lead.value:.2f}x the output tokens/s of the lab's "
            f"in-flight model ({_tokens(m, 'vllm')} against {_tokens(m, 'inflight')}, "
            f"{clients} clients), as its engine took {vllm:.0f} ms a step against {own:.0f} ms."
        )
    bench = (
        f"; the lab's full benchmark, shipped with it, measured vLLM {benchmark.vllm_lead:.2f}x "
        "ahead"
        if benchmark is not None
        else ""
    )
    if said == "tie" and step == "gain":
        return (
            f"vLLM's engine took {vllm:.0f} ms a step against {own:.0f} ms for the lab's "
            f"in-flight model in every round, for {lead.value:.2f}x its output tokens/s here "
            f"({_tokens(m, 'vllm')} against {_tokens(m, 'inflight')}, {clients} clients){bench}."
        )
    if said == "tie":
        return (
            f"Here vLLM and the lab's in-flight model served within this run's noise of each "
            f"other ({_tokens(m, 'vllm')} and {_tokens(m, 'inflight')} output tokens/s){bench}."
        )
    return (
        f"Here vLLM served fewer output tokens/s than the lab's in-flight model "
        f"({_tokens(m, 'vllm')} against {_tokens(m, 'inflight')}){bench}."
    )


def _triton_cost_words(m: dict, cost: Ratio, said: str) -> str:
    head = (
        f"vLLM's own OpenAI server, on the same cores with the same engine settings, served "
        f"{_tokens(m, 'vllm-standalone')} output tokens/s; vLLM in Triton made {cost.value:.2f}x "
        "that"
    )
    ahead = (
        " Triton can come out a little ahead here: both front ends send one JSON chunk "
        "per token, built in C++ by Triton's HTTP server and in Python by vLLM's (FastAPI), on "
        "the core the engine steps on (`labkit bench frontend` measures the same small lead; the "
        "README lists its figures)."
        if said == "tie" and cost.value > 1
        else ""
    )
    return (
        head
        + {
            "gain": ", more in every round: the two differ only in their front ends (Triton's HTTP "
            "server and Python backend against vLLM's FastAPI server), and here Triton's cost less.",
            "tie": ": what Triton's front end costs is within this run's noise." + ahead,
            "loss": f": Triton's front end (its HTTP server, the Python backend's stub, one response "
            f"per token) cost about {1 - cost.value:.0%} of the tokens/s in every round: on the "
            "same core, every token's way through Triton takes time the engine's steps would "
            "have had.",
        }[said]
    )


def _cost_takeaway(cost: Ratio, said: str) -> str:
    return {
        "gain": f"Through Triton, vLLM served {cost.value:.2f}x its own server's tokens/s here.",
        "tie": "Serving vLLM through Triton cost nothing this run could tell from its noise "
        "against vLLM's own server.",
        "loss": f"Serving vLLM through Triton cost about {1 - cost.value:.0%} of its own "
        "server's tokens/s.",
    }[said]


def _precision_words(m: dict, speed: Ratio, said: str, agreed: dict, host: dict) -> str:
    words = (
        f"vLLM in bfloat16 served {_tokens(m, 'vllm_bf16')} output tokens/s against "
        f"{_tokens(m, 'vllm')} in float32 ({speed.value:.2f}x"
        + {
            "gain": ", faster in every round)",
            "tie": ", within this run's noise)",
            "loss": ", slower in every round)",
        }[said]
    )
    if host.get("avx512_bf16"):
        words += "; this CPU has bfloat16 instructions (AVX512-BF16), which vLLM's CPU kernels use"
    elif host.get("avx512_bf16") is False:
        words += "; this CPU has no bfloat16 instructions, so bfloat16 saves memory, not time"
    if agreed.get("compared"):
        same, total = agreed["equal_streaming"], agreed["compared"]
        were = "was" if same == 1 else "were"
        words += f". Of its {total} greedy answers, {same} {were} the same as float32's: " + (
            "where a token's two best candidates are close, bfloat16's fewer digits flip it, "
            "and the rest of the answer follows the other path."
            if same < total
            else "none flipped in this run, though a token whose two best candidates are close can."
        )
    else:
        words += "."
    return words


def _precision_takeaway(speed: Ratio, said: str, agreed: dict) -> str:
    how = {
        "gain": f"In bfloat16, vLLM ran {speed.value:.2f}x faster on this CPU",
        "tie": "In bfloat16, vLLM ran within this run's noise of float32",
        "loss": f"In bfloat16, vLLM ran slower on this CPU ({speed.value:.2f}x)",
    }[said]
    if agreed.get("compared"):
        how += (
            f", and {agreed['equal_streaming']} of {agreed['compared']} greedy answers matched "
            "float32's"
        )
    return how + "."


def _moved(b: Benchmark, m: dict | None) -> str:
    """Which way's figure moved more between the benchmark and this run: the one the lead's size
    followed."""
    if not m or "inflight" not in m or "vllm" not in m:
        return ""
    then = {way: b.output_tokens_per_s[way] for way in ("inflight", "vllm")}
    now = {way: m[way]["output_tokens_per_s"] for way in ("inflight", "vllm")}
    moved = {way: max(now[way], then[way]) / min(now[way], then[way]) for way in now}
    more, less = sorted(moved, key=moved.get, reverse=True)
    return (
        f" Between the two, {way_name(more)} moved more ({then[more]:.1f} there, {now[more]:.1f} "
        f"here) than {way_name(less)} ({then[less]:.1f}, {now[less]:.1f})."
    )


def _benchmark_words(
    b: Benchmark,
    lead: Ratio,
    said: str,
    comparison: Comparison,
    step: str = "tie",
    m: dict | None = None,
) -> str:
    load = comparison.load_average[0][0] if comparison.load_average else None
    here = f" (load average {load:.1f} at this run's start)" if load is not None else ""
    words = (
        f"The lab's full benchmark (labkit bench inflight) on {b.date} ({b.shape()}; load average "
        f"{b.load_average[0]:.1f} at its start) "
        f"measured the in-flight model at {b.output_tokens_per_s['inflight']:.1f} output tokens/s "
        f"and vLLM in Triton at {b.output_tokens_per_s['vllm']:.1f}: {b.vllm_lead:.2f}x"
    )
    # the same lead, as the lab's rule reads two figures: within x1.20 of each other
    near = judge([lead.value / b.vllm_lead]) == "tie" if lead.value == lead.value else False
    if near:
        return words + (
            f"; this run measured {lead.value:.2f}x at the same shape, the same lead within the "
            "noise. Compare the leads, not the tokens/s: both engines' tokens/s move together "
            "with the host's speed, which drifts by 2x and more between hours, so one day's "
            "figures can sit far above or below another's while the ratio holds."
        )
    if said == "gain":
        return words + (
            f". This run measured {lead.value:.2f}x at the same shape: the lead is vLLM's in "
            f"both, and how large it comes out moves between runs on a host whose speed drifts by up "
            f"to 2x{here}." + _moved(b, m)
        )
    if step == "gain":
        return words + (
            f". This run measured {lead.value:.2f}x in tokens/s, a figure that moved with the "
            f"host between rounds{here}, while vLLM's step was shorter in every round: the "
            "lead is vLLM's in both, and the benchmark's figure is its size on a quieter host."
        )
    return words + (
        f". This run could not show that lead beyond its noise{here}: other work on the host "
        "takes the cores the servers run on; the benchmark's figure is the one to keep."
    )
