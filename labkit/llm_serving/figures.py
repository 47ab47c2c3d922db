"""What a study's figures say: the ratios its targets are about, each target next to what was
measured, and the whole result as a text table (``labkit bench inflight`` prints it)."""

from __future__ import annotations

from .schedulers import VLLM_DTYPES

#: What the issue asks of in-flight batching (float32, quiet 2-core host). The bench reports them
#: next to the figures and never asserts them: a benchmark is not a test of the machine.
TARGETS = {
    "inflight_vs_dynamic_output_tokens_per_s_c8_mixed": (">=", 1.5),
    "inflight_ttft_p99_vs_dynamic_c8_mixed": ("<=", 0.33),
    "inflight_ttft_p50_s_c4_streaming": ("<=", 1.0),
    "inflight_served_vs_limit_c8_mixed": (">=", 0.85),
    "vllm_served_vs_standalone_c8_mixed": (">=", 0.9),
    "vllm_bf16_served_vs_standalone_c8_mixed": (">=", 0.9),
    "vllm_vs_inflight_output_tokens_per_s_c8_mixed": (">=", 1.5),
    "failed_requests": ("==", 0),
}


def _pick(rows: list[dict], scheduler: str, workload: str, streams: bool, concurrency: int):
    for row in rows:
        if (row["scheduler"], row["workload"], row["streaming"], row["concurrency"]) == (
            scheduler,
            workload,
            streams,
            concurrency,
        ):
            return row
    return None


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(rows: list[dict], limit: dict, concurrency: int = 8) -> dict:
    """The ratios the targets are about (None where the run did not measure both sides).

    The targets are set at concurrency 8 on the mixed workload; notebook 06, sized for a CPU,
    asks for its own ``concurrency`` (the names then say ``c<concurrency>``).
    """
    out: dict = {}
    c = concurrency
    for w in ("mixed", "fixed16"):  # the targets are on mixed lengths; fixed16 stands beside them
        for streams, suffix in ((True, ""), (False, "_nonstreaming")):
            out.update(_ratios_of(rows, limit, c, w, streams, suffix))
    c4 = _pick(rows, "inflight", "fixed16", True, 4) or _pick(rows, "inflight", "mixed", True, 4)
    out["inflight_ttft_p50_s_c4_streaming"] = (
        round(c4["ttft_p50_ms"] / 1000, 3) if c4 and c4.get("ttft_p50_ms") is not None else None
    )
    out["failed_requests"] = sum(int(row.get("failed") or 0) for row in rows)
    return out


def _ratios_of(rows, limit, c: int, w: str, streams: bool, suffix: str) -> dict:
    def get(scheduler: str, key: str):
        row = _pick(rows, scheduler, w, streams, c)
        return row.get(key) if row else None

    tokens = "output_tokens_per_s"
    out = {
        f"inflight_vs_dynamic_{tokens}_c{c}_{w}{suffix}": ratio(
            get("inflight", tokens), get("dynamic", tokens)
        ),
        f"inflight_ttft_p99_vs_dynamic_c{c}_{w}{suffix}": ratio(
            get("inflight", "ttft_p99_ms"), get("dynamic", "ttft_p99_ms")
        ),
        f"inflight_served_vs_limit_c{c}_{w}{suffix}": ratio(
            get("inflight", tokens), limit.get(w, {}).get(tokens)
        ),
    }
    for way in ("vllm", "vllm_bf16"):
        out[f"{way}_served_vs_standalone_c{c}_{w}{suffix}"] = ratio(
            get(way, tokens), get(f"{way}-standalone", tokens)
        )
        out[f"{way}_vs_inflight_{tokens}_c{c}_{w}{suffix}"] = ratio(
            get(way, tokens), get("inflight", tokens)
        )
    return out


def targets(measured: dict, concurrency: int = 8) -> dict:
    """Each target next to what was measured, and whether it was met (None: not measured)."""
    out = {}
    for name, (op, value) in TARGETS.items():
        name = name.replace("_c8_", f"_c{concurrency}_")
        got = measured.get(name)
        met = None
        if got is not None:
            met = {">=": got >= value, "<=": got <= value, "==": got == value}[op]
        out[name] = {"target": f"{op} {value:g}", "measured": got, "met": met}
    return out


def table(result: dict) -> str:
    """The figures as text: one line per measured row, then the limit, ratios and context."""
    head = ("scheduler", "workload", "clients", "c", "tok/s", "req/s", "TTFT p50", "TTFT p99",
            "ITL p50", "req p99", "failed", "aiperf CPU")  # fmt: skip
    lines = [head]
    for r in result["rows"]:
        share = r.get("aiperf_cpu_share")
        lines.append(
            (
                r["scheduler"],
                r["workload"],
                "stream" if r["streaming"] else "whole",
                str(r["concurrency"]),
                *(_fmt(r.get(k)) for k in ("output_tokens_per_s", "requests_per_s")),
                *(
                    _fmt(r.get(k), 0)
                    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "request_p99_ms")
                ),
                str(r.get("failed")),
                f"{share:.0%}" if share is not None else "-",
            )
        )
    width = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [
        "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, width, strict=True))
        )
        for line in lines
    ]
    text.append(
        "(latencies in ms; aiperf CPU: AIPerf's CPU time over the level's wall time, of all cores)"
    )
    for name, figures in result.get("limit", {}).items():
        text.append(
            f"in-process limit, {name}, c{figures['concurrency']}: {figures['output_tokens_per_s']:.1f} tok/s"
        )
    for name, t in result.get("targets", {}).items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        text.append(f"{name}: {t['measured']} (target {t['target']}: {verdict})")
    beside = [
        f"{name} {value}"
        for name, value in result.get("ratios", {}).items()
        if "_fixed16" in name and not name.endswith("_nonstreaming") and value is not None
    ]
    if beside:
        text.append("fixed 16 tokens, beside the mixed targets: " + ", ".join(beside))
    p = result.get("precision")
    if p:
        for dtype in ("float32", "bfloat16"):
            d = p[dtype]
            text.append(
                f"{dtype}: {d['output_tokens_per_s']:.1f} tok/s in-process; greedy answers equal to "
                f"the answer alone {d['equal_alone']}/{p['compared']}, to float32's "
                f"{d['equal_float32']}/{p['compared']}"
            )
    light = result.get("light_client")
    if light:
        text.append(
            f"the same in-flight level without AIPerf (labkit's own streaming client, "
            f"c{light['concurrency']}): {light['output_tokens_per_s']:.1f} tok/s, client CPU "
            f"{light['client_cpu_s']} s, server CPU {light['server_cpu_s']} s in {light['seconds']} s"
        )
    answers = {"in-flight": result.get("answers")}
    answers.update(
        (f"{way} ({VLLM_DTYPES[way]})", a) for way, a in result.get("vllm_answers", {}).items()
    )
    for who, a in answers.items():
        if a:
            text.append(
                f"{who} answers under concurrency {a['concurrency']} equal to the answer alone: "
                f"{a['equal_nonstreaming']}/{a['compared']} whole, "
                f"{a['equal_streaming']}/{a['compared']} streamed"
            )
    h = result["host"]
    pinned = (
        f"; servers pinned to core(s) {h['server_cores']}, AIPerf to {h['client_cores']}"
        if h.get("server_cores")
        else "; not pinned"
    )
    text.append(
        f"host: {h['cores']} cores ({h['cpu_model']}), load average {h['load_average_start']} at the "
        f"start, {h.get('load_average_end')} at the end{pinned}; {result.get('wall_s')} s in all"
    )
    return "\n".join(text)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
