"""The study in one call: serve the text model every way on one server, measure each with AIPerf,
then the in-process limit and precision, and say what the figures mean.

:func:`run` is what ``labkit bench inflight`` and notebook 06 call; it returns a
:class:`StudyResult` and writes it to ``<run_dir>/inflight.json``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.hardware import format_cores, host_facts, pinned
from labkit.repository import prepare_run_repository
from labkit.repository.textgen import engine_limits
from labkit.runs import write_result
from labkit.server import serving

from . import figures
from .inprocess import inprocess_figures
from .measure import compare_schedulers, light_client, reference_answers, served_answers
from .schedulers import VLLM_DTYPES, StudySettings, workload, write_scheduler_folders
from .standalone import measure_standalone

#: The file a study writes into its run folder.
RESULT_NAME = "inflight"


@dataclass(frozen=True)
class Headline:
    """The study's ratios at one concurrency on the mixed workload, streaming (None: not measured)."""

    concurrency: int
    inflight_vs_dynamic_output_tokens_per_s: float | None
    inflight_ttft_p99_vs_dynamic: float | None
    inflight_served_vs_limit: float | None
    failed_requests: int


@dataclass
class StudyResult:
    """Everything a study measured; ``rows`` has one AIPerf level each (see
    :data:`~labkit.llm_serving.measure.ROW_FIGURES`)."""

    settings: dict
    engine_limits: dict[str, int]
    host: dict
    run_dir: str
    rows: list[dict] = field(default_factory=list)
    limit: dict = field(default_factory=dict)
    precision: dict | None = None
    answers: dict | None = None  # the in-flight model's, under concurrency, against alone
    vllm_answers: dict = field(default_factory=dict)  # each vLLM way's, the same way
    light_client: dict | None = None
    ratios: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)
    load_average_after_serving: list[float] = field(default_factory=list)
    wall_s: float | None = None

    def ratios_at(self, concurrency: int) -> dict:
        """The ratios the targets are about, at ``concurrency`` rather than the targets' 8."""
        return figures.ratios(self.rows, self.limit, concurrency=concurrency)

    def headline(self, concurrency: int) -> Headline:
        """The ratios at ``concurrency`` (mixed lengths, streaming clients)."""
        measured = self.ratios_at(concurrency)
        c = concurrency
        return Headline(
            concurrency=c,
            inflight_vs_dynamic_output_tokens_per_s=measured[
                f"inflight_vs_dynamic_output_tokens_per_s_c{c}_mixed"
            ],
            inflight_ttft_p99_vs_dynamic=measured[f"inflight_ttft_p99_vs_dynamic_c{c}_mixed"],
            inflight_served_vs_limit=measured[f"inflight_served_vs_limit_c{c}_mixed"],
            failed_requests=measured["failed_requests"],
        )

    def table(self) -> str:
        """The figures as text (what ``labkit bench inflight`` prints: :func:`table`)."""
        return table(asdict(self))


def run(
    run_dir: str | os.PathLike,
    settings: StudySettings | None = None,
    *,
    source: str | os.PathLike | None = None,
    progress: bool = True,
) -> StudyResult:
    """Serve the text model every way of ``settings.schedulers`` on one server, one after another
    (each one's models loaded, warmed, measured with AIPerf on every workload, then unloaded).
    Then, with the server stopped: vLLM's own OpenAI server on each vLLM way's settings (unless
    ``settings.standalone`` is false), and, when in-flight batching or precision was asked, the
    in-process limit (the same engine on the same prompts, without Triton) and float32 against
    bfloat16. On two cores or more the servers and the limit run pinned apart from AIPerf
    (:meth:`StudySettings.cores`).

    ``source`` (default: the lab's ``model_repository/``) is copied into the run folder first
    and never changed. The result is also written to ``<run_dir>/inflight.json``.
    """
    s = (settings or StudySettings()).check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = prepare_run_repository(run_dir, source=source)
    names = write_scheduler_folders(repo, s)
    workloads = {name: workload(name, s) for name in s.workloads}
    result = StudyResult(
        settings={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(s).items()},
        engine_limits=engine_limits(repo.config(s.inflight_model)),
        host=host_facts(),
        run_dir=str(run_dir),
    )
    server_cores, client_cores = s.cores()
    if server_cores is not None:  # which cores each side had: part of reading the figures
        result.host["server_cores"] = format_cores(server_cores)
        result.host["client_cores"] = format_cores(client_cores)
    started = time.monotonic()
    options = {"startup_timeout_s": s.startup_timeout_s, "warm": False, "cores": server_cores}
    with serving(run_dir, repo.path, [], **options) as server:
        reference = reference_answers(server, names, workloads, s)

        def check_answers(scheduler: str) -> None:
            if scheduler in VLLM_DTYPES and reference:  # float32: asserted; bfloat16: reported
                model = names[scheduler][True]
                result.vllm_answers[scheduler] = served_answers(server, model, reference, s)
            if scheduler != "inflight":
                return
            if reference:
                result.answers = served_answers(server, s.inflight_model, reference, s)
            if "mixed" in workloads:  # the same level without AIPerf: what the client costs
                result.light_client = light_client(
                    server, s.inflight_model, workloads["mixed"], s.limit_concurrency
                )

        result.rows = compare_schedulers(
            server, names, workloads, s, progress=progress, then=check_answers
        )
        result.load_average_after_serving = [round(x, 2) for x in os.getloadavg()]
    if s.standalone:  # with Triton stopped: the cores are the reference's alone
        result.rows += measure_standalone(run_dir, repo, names, workloads, s, progress=progress)
    if "inflight" in s.schedulers or s.precision:  # the in-flight engine alone: its limit
        with pinned(server_cores):  # on the cores the servers had
            result.limit, result.precision = inprocess_figures(repo, s, workloads)
    result.ratios = figures.ratios(result.rows, result.limit)
    if result.light_client and "mixed" in result.limit:
        result.ratios["inflight_light_client_vs_limit_mixed"] = figures.ratio(
            result.light_client["output_tokens_per_s"],
            result.limit["mixed"]["output_tokens_per_s"],
        )
    result.targets = figures.targets(result.ratios)
    result.host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result.wall_s = round(time.monotonic() - started, 1)
    write_result(run_dir, RESULT_NAME, result)
    return result


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
    for name, limit in result.get("limit", {}).items():
        text.append(
            f"in-process limit, {name}, c{limit['concurrency']}: {limit['output_tokens_per_s']:.1f} tok/s"
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
