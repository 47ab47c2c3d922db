"""Measuring the schedulers on one server: each one's models loaded, warmed, measured with AIPerf
and unloaded in turn, so they never share the CPU; the in-flight answers under load checked
against the answers alone; the same level with labkit's own light client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from labkit import client, profiling, streaming
from labkit.load import stream_workload
from labkit.server import TritonServer, warm_up

from .schedulers import VLLM_DTYPES, StudySettings


def compare_schedulers(
    server: TritonServer,
    names: dict[str, dict[bool, str]],
    workloads: dict[str, profiling.Workload],
    s: StudySettings,
    *,
    progress: bool = True,
    then=None,
) -> list[dict]:
    """Each scheduler in turn on one server: load its models, warm them, run AIPerf on every
    workload and client kind, call ``then(scheduler)`` while they are loaded, unload them."""
    rows: list[dict] = []
    for scheduler in s.schedulers:
        models = sorted({names[scheduler][streams] for streams in s.streaming})
        for model in models:
            server.load_model(model)
            warm_up(server, model)
        rows += _measure_scheduler(server, scheduler, names[scheduler], workloads, s, progress)
        if then is not None:
            then(scheduler)
        for model in models:
            server.unload_model(model)
    return rows


def _measure_scheduler(
    server: TritonServer,
    scheduler: str,
    names: dict[bool, str],
    workloads: dict[str, profiling.Workload],
    s: StudySettings,
    progress: bool,
) -> list[dict]:
    """AIPerf on every workload and client kind of one (loaded) scheduler; one row per level."""
    rows = []
    run_dir = Path(server.log_path).parent / "aiperf"
    for wname, w in workloads.items():
        for streams in s.streaming:
            label = f"{scheduler}-{wname}-{'stream' if streams else 'generate'}"
            frame = profiling.run_aiperf(
                server,
                names[streams],
                w,
                concurrency=s.concurrency,
                streaming=streams,
                run_dir=run_dir,
                label=label,
                timeout_s=s.timeout_s,
                progress=progress,
                cores=s.cores()[1],
            )
            for record in frame.to_dict("records"):
                row = {"scheduler": scheduler, "model": names[streams], **row_figures(record)}
                rows.append({**row, "artifact_dir": record["artifact_dir"]})
    return rows


ROW_FIGURES = (
    "workload",
    "streaming",
    "concurrency",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "request_p50_ms",
    "request_p99_ms",
    "requests",
    "failed",
    "wall_s",
    "aiperf_cpu_s",
    "server_cpu_s",
    "aiperf_cpu_share",
)


def row_figures(record: dict) -> dict:
    row = {}
    for key in ROW_FIGURES:
        value = record.get(key)
        if isinstance(value, float):
            value = None if value != value else round(value, 3)
        elif hasattr(value, "item"):
            value = value.item()
        row[key] = value
    return row


def reference_answers(server, names, workloads, s: StudySettings, *, loaded: bool = False) -> dict:
    """The plain model's answer to each prompt alone (one at a time): what in-flight and vLLM
    (in float32) must give. The plain model is loaded and unloaded around it, unless ``loaded``
    (then the caller loaded it, and unloads it)."""
    if not {"inflight", *VLLM_DTYPES} & set(s.schedulers) or not s.answers:
        return {}
    w = workloads.get("mixed") or next(iter(workloads.values()))
    pairs = list(dict.fromkeys(zip(w.prompts, w.max_tokens, strict=True)))[: s.answers]
    model = names["none"][False]
    if not loaded:
        server.load_model(model)
    try:
        return {
            pair: client.generate(server.http_url, model, pair[0], max_tokens=pair[1]).text
            for pair in pairs
        }
    finally:
        if not loaded:
            server.unload_model(model)


def served_answers(
    server,
    model: str,
    reference: dict,
    s: StudySettings,
    kinds: tuple[str, ...] = ("nonstreaming", "streaming"),
) -> dict:
    """A model's answers under concurrency against the alone ones, for each of ``kinds``:
    ``nonstreaming`` (whole answers) and ``streaming``."""

    def whole(pair):
        return client.generate(server.http_url, model, pair[0], max_tokens=pair[1]).text

    def streamed(pair):
        pieces = streaming.stream(server.http_url, model, pair[0], max_tokens=pair[1], stream=True)
        return "".join(pieces)

    figures: dict = {"compared": len(reference), "concurrency": s.limit_concurrency}
    calls = {"nonstreaming": whole, "streaming": streamed}
    for kind, call in ((k, calls[k]) for k in kinds):
        with ThreadPoolExecutor(s.limit_concurrency) as pool:
            got = dict(zip(reference, pool.map(call, reference), strict=True))
        differing = [pair[0] for pair, text in got.items() if text != reference[pair]]
        figures[f"equal_{kind}"] = len(reference) - len(differing)
        figures[f"differing_{kind}"] = differing[:3]
    return figures


def light_client(server, model: str, w: profiling.Workload, concurrency: int) -> dict:
    """The workload streamed by ``concurrency`` threads of this process (:mod:`labkit.load`), not
    AIPerf: output tokens/s and the CPU seconds the client and the server used. Next to AIPerf's
    row at the same level, it says how much of the gap to the in-process limit is the client's."""
    server_before = profiling.server_cpu_s(server)
    figures = stream_workload(server.http_url, model, w, concurrency)
    figures["server_cpu_s"] = round(profiling.server_cpu_s(server) - server_before, 2)
    return figures
