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
        """The figures as text (what ``labkit bench inflight`` prints)."""
        return figures.table(asdict(self))


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
