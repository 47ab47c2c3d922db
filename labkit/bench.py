"""``labkit bench batching``: one server, one model, one concurrency, dynamic batching off then on.

Both measurements come from the same server process in one run: the model's configuration is
rewritten in the run folder's copy of the repository and reloaded live between them, so the only
difference is the scheduler. The result is a table and ``<run_dir>/batching.json`` with both
throughputs, p50 and p99 latencies, the server's average batch size and the throughput ratio.

The LLM-serving study (``labkit bench inflight``) is :mod:`labkit.llm_serving`; the soaks are
:mod:`labkit.soak`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit import profiling
from labkit.errors import ConfigError
from labkit.hardware import host_facts
from labkit.repository import apply_edits, prepare_run_repository
from labkit.runs import write_result
from labkit.server import TritonServer, reload, serving

log = logging.getLogger(__name__)

#: The figures kept per phase (perf_analyzer columns, see :func:`labkit.profiling.perf_analyzer`).
PHASE_FIGURES = (
    "throughput",
    "p50_ms",
    "p99_ms",
    "avg_latency_ms",
    "queue_ms",
    "compute_infer_ms",
    "avg_batch_size",
    "request_count",
    "stable",
)


@dataclass
class BatchingSettings:
    """What the benchmark measures, and how long each measurement window is."""

    model: str = "smollm2"
    concurrency: int = 8
    max_batch_size: int = 8
    max_queue_delay_microseconds: int = 0  # the tutorial's `dynamic_batching {}`
    string_data: str = "Where is the nearest"
    request_parameters: dict = field(default_factory=dict)
    measurement_mode: str = "count_windows"
    measurement_request_count: int | None = None  # default: the concurrency
    measurement_interval_ms: int = 5000
    stability_percentage: float = 30.0
    max_trials: int = 4
    startup_timeout_s: float = 600.0
    timeout_s: float = 900.0


@dataclass
class BatchingResult:
    """Both phases' figures (:data:`PHASE_FIGURES`, plus the server's own average batch size),
    and how the second compares with the first."""

    model: str
    concurrency: int
    max_batch_size: int
    max_queue_delay_microseconds: int
    host: dict
    run_dir: str
    off: dict = field(default_factory=dict)
    on: dict = field(default_factory=dict)
    throughput_ratio: float | None = None
    p99_ratio: float | None = None
    wall_s: float | None = None


def batching_off_on(
    repository: str | os.PathLike,
    run_dir: str | os.PathLike,
    settings: BatchingSettings | None = None,
    *,
    progress: bool = True,
) -> BatchingResult:
    """Measure ``settings.model`` with dynamic batching off, then on; return the figures and
    write them to ``<run_dir>/batching.json``.

    ``repository`` is copied into ``run_dir`` (weights are linked, not copied), so the source
    repository is never changed; offline models get their weights built first
    (:func:`labkit.repository.prepare_run_repository`).
    """
    s = settings or BatchingSettings()
    if s.concurrency < 1 or s.max_batch_size < 1:
        raise ConfigError(
            f"concurrency ({s.concurrency}) and max_batch_size ({s.max_batch_size}) must be >= 1"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = prepare_run_repository(run_dir, source=repository)
    base = repo.config(s.model)
    off = apply_edits(base, dynamic_batching=False)
    on = apply_edits(
        base,
        max_batch_size=max(base.max_batch_size, s.max_batch_size),
        dynamic_batching=True,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
    )
    repo.write_config(s.model, off)
    result = BatchingResult(
        model=s.model,
        concurrency=s.concurrency,
        max_batch_size=on.max_batch_size,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
        host=host_facts(),
        run_dir=str(run_dir),
    )
    started = time.monotonic()
    options = {"startup_timeout_s": s.startup_timeout_s, "warm": False}
    with serving(run_dir, repo.path, [s.model], **options) as server:
        reload(server, s.model, off, repository=repo)
        result.off = _measure(server, s, "off", run_dir, progress)
        reload(server, s.model, on, repository=repo)
        result.on = _measure(server, s, "on", run_dir, progress)
    result.throughput_ratio = result.on["throughput"] / result.off["throughput"]
    result.p99_ratio = result.on["p99_ms"] / result.off["p99_ms"]
    result.host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result.wall_s = round(time.monotonic() - started, 1)
    write_result(run_dir, "batching", result)
    return result


def _measure(
    server: TritonServer, s: BatchingSettings, phase: str, run_dir: Path, progress: bool
) -> dict:
    before = profiling.metrics(server)
    frame = profiling.perf_analyzer(
        server,
        s.model,
        concurrency=s.concurrency,
        string_data=s.string_data,
        shapes={_input_name(server, s.model): [1]},
        request_parameters=s.request_parameters,
        measurement_mode=s.measurement_mode,
        measurement_request_count=s.measurement_request_count or s.concurrency,
        measurement_interval_ms=s.measurement_interval_ms,
        stability_percentage=s.stability_percentage,
        max_trials=s.max_trials,
        run_dir=run_dir / f"batching-{phase}",
        label=f"batching {phase}",
        timeout_s=s.timeout_s,
        progress=progress,
    )
    row = frame.iloc[0]
    figures = {k: (bool(row[k]) if k == "stable" else float(row[k])) for k in PHASE_FIGURES}
    served = profiling.metrics(server, since=before).set_index("model")
    if s.model in served.index:  # over the whole phase, warm-up included
        figures["server_avg_batch_size"] = float(served.loc[s.model, "avg_batch_size"])
    frame.to_csv(run_dir / f"batching-{phase}.csv", index=False)
    return figures


def _input_name(server: TritonServer, model: str) -> str:
    with server.client() as client:
        inputs = client.get_model_metadata(model).get("inputs", [])
    if len(inputs) != 1:
        raise ConfigError(
            f"the batching benchmark sends one text input, but {model!r} has "
            f"{len(inputs)} inputs; pick a text-generation model such as smollm2"
        )
    return inputs[0]["name"]


def table(result: BatchingResult) -> str:
    """The result as a small text table."""
    rows = [
        ("", "batching off", "batching on"),
        *[
            (name, f"{result.off[key]:.2f}", f"{result.on[key]:.2f}")
            for name, key in (
                ("throughput (infer/s)", "throughput"),
                ("p50 latency (ms)", "p50_ms"),
                ("p99 latency (ms)", "p99_ms"),
                ("queue (ms)", "queue_ms"),
                ("compute infer (ms)", "compute_infer_ms"),
                ("average batch size", "avg_batch_size"),
            )
        ],
        ("stable measurement", str(result.off["stable"]), str(result.on["stable"])),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, width, strict=True))
        )
        for r in rows
    ]
    lines.append(
        f"{result.model} at concurrency {result.concurrency}: throughput x"
        f"{result.throughput_ratio:.2f} with dynamic batching, p99 x{result.p99_ratio:.2f}"
    )
    return "\n".join(lines)
