"""``labkit bench soak`` and ``inflight-soak``: a model held under load for a while; figures.

``labkit bench inflight-soak`` (:func:`inflight_soak`): AIPerf's streams on the in-flight model
while memory is sampled. ``labkit bench soak`` (:func:`run_soak`): two phases on one server, on
a run folder's own copy of the model repository:

1. **Load.** perf_analyzer keeps ``concurrency`` requests in flight for ``duration_s`` seconds
   (three measurement windows of a third each). Meanwhile the resident memory of tritonserver and
   its Python stubs (psutil) is sampled every second. Figures: requests answered and failed
   (Triton's own ``nv_inference_request_success`` / ``_failure`` counters), throughput and
   latencies, and memory growth between the first and the last ``memory_window_s`` seconds.
2. **Faults** (``faults=True``), each under a closed-loop :class:`labkit.load.Load` of
   ``fault_threads`` Python clients: the model restarted (:func:`labkit.server.restart`: new
   instances replace the old; failed requests are counted), then its Python stub killed with
   SIGKILL and :func:`labkit.server.recover` called. Observed on Triton 2.51: the requests in
   flight on the stub fail with ``Stub process '<m>_0' is not healthy.`` (some only once the new
   instance takes over), those sent later fail at once with it or wait for the new instance,
   depending on timing.

The result (``soak.json`` in the run folder) says in ``passed`` whether the load had zero failed
requests and memory grew by less than ``max_memory_growth_percent``. A benchmark, not a test: the
machine's load average is part of the figures.

``labkit bench inflight-soak`` (:func:`inflight_soak`) is the same memory watch on the in-flight
model, with AIPerf keeping ``concurrency`` streams on it instead of perf_analyzer.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit import proc, profiling
from labkit.errors import ConfigError, ToolError
from labkit.hardware import host_facts
from labkit.load import Load
from labkit.profiling import request_counts
from labkit.repository import prepare_run_repository
from labkit.runs import write_result
from labkit.server import recover, restart, serving, stubs, unhealthy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakSettings:
    """What to load, how hard and for how long (by default 64 clients for 60 s)."""

    model: str = "smollm2"
    concurrency: int = 64
    duration_s: float = 60.0
    memory_window_s: float = 20.0
    prompt: str = "I am going"
    faults: bool = True
    fault_threads: int = 8
    fault_window_s: float = 20.0
    max_memory_growth_percent: float = 10.0
    startup_timeout_s: float = 600.0

    def check(self) -> SoakSettings:
        if self.concurrency < 1 or self.fault_threads < 1:
            raise ConfigError(
                f"concurrency {self.concurrency} and fault_threads {self.fault_threads} must "
                "be >= 1"
            )
        if self.duration_s < 3 or not 0 < 2 * self.memory_window_s <= self.duration_s:
            raise ConfigError(
                f"duration_s={self.duration_s:g} must be >= 3 s and hold two memory windows of "
                f"memory_window_s={self.memory_window_s:g} s; lengthen the run or shorten windows"
            )
        return self


def server_memory(pid: int) -> int:
    """Resident bytes of a process and all its descendants (tritonserver and its stubs)."""

    return int(proc.tree_total(pid, lambda process: process.memory_info().rss))


def _perf_analyzer(server, settings: SoakSettings, run_dir: Path) -> dict:
    """A perf_analyzer load of three windows, whatever their spread: a soak, not a sweep."""
    with server.client() as client:
        config = client.get_model_config(settings.model)
    try:
        frame = profiling.perf_analyzer(
            server,
            settings.model,
            concurrency=settings.concurrency,
            string_data=settings.prompt,
            shapes={config["input"][0]["name"]: [1]},
            measurement_interval_ms=int(settings.duration_s * 1000 / 3),
            stability_percentage=1000,
            max_trials=3,
            collect_metrics=False,
            run_dir=run_dir / "perf",
            label="soak",
            timeout_s=settings.duration_s * 4 + 120,
            progress=False,
        )
    except ToolError as exc:
        return {"perf_analyzer_status": 1, "perf_analyzer_error": proc.tail(str(exc), 10)}
    row = frame.iloc[0]
    figures = {"perf_analyzer_status": 0, "throughput_per_s": round(float(row["throughput"]), 2)}
    for name in ("p50", "p90", "p99"):
        figures[f"{name}_ms"] = round(float(row[f"{name}_ms"]), 1)
    return figures


def memory_while(server, job) -> list[tuple[float, int]]:
    """Run ``job()`` in a thread while the resident memory of the server and its stubs is sampled
    each second; ``(seconds since the start, bytes)`` samples."""
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def run() -> None:
        try:
            job()
        finally:
            done.set()

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    while not done.wait(1.0):
        samples.append((round(time.monotonic() - started, 1), server_memory(server.pid)))
    worker.join()
    return samples


def load_phase(server, settings: SoakSettings, run_dir: Path) -> dict:
    """perf_analyzer at ``concurrency`` for ``duration_s`` while memory is sampled each second."""
    outcome: dict = {}

    def measure() -> None:
        try:
            outcome.update(_perf_analyzer(server, settings, run_dir))
        except Exception as exc:  # noqa: BLE001 (reported in the figures)
            outcome["perf_analyzer_error"] = str(exc)

    before = request_counts(server.metrics_url, settings.model)
    samples = memory_while(server, measure)
    after = request_counts(server.metrics_url, settings.model)
    return {
        "requests_succeeded": int(after["success"] - before["success"]),
        "requests_failed": int(after["failure"] - before["failure"]),
        **outcome,
        "memory": memory_figures(samples, settings.memory_window_s),
    }


def fault_phase(server, settings: SoakSettings) -> dict:
    """A forced reload, then a killed stub and :func:`recover`, each under Python-client load."""
    half = settings.fault_window_s / 2
    figures: dict = {}
    old = set(stubs(server).get(settings.model, []))
    load = Load(server.http_url, settings.model, max_tokens=2, concurrency=settings.fault_threads)
    with load:
        load.wait_for(settings.fault_threads)
        time.sleep(half)
        started = time.monotonic()
        restart(server, settings.model)
        reloaded = time.monotonic()
        time.sleep(half)
    figures["reload"] = {
        "seconds": round(reloaded - started, 1),
        "requests": len(load.outcomes),
        "failed": len(load.failures()),
        "errors": sorted({o.error for o in load.failures()})[:3],
    }
    # the replaced instance's stub is still finishing
    proc.wait_until(lambda: not old & set(stubs(server).get(settings.model, [])), 60, 0.2)
    victims = sorted(set(stubs(server).get(settings.model, [])) - old)
    if not victims:
        figures["stub_kill"] = {"skipped": f"{settings.model} has no Python stub process"}
        return figures
    load = Load(server.http_url, settings.model, max_tokens=2, concurrency=settings.fault_threads)
    with load:
        load.wait_for(settings.fault_threads)
        killed = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        proc.wait_until(lambda: settings.model in unhealthy(server), half, 0.1)
        recovering = time.monotonic()
        reloaded_models = recover(server)
        recovered = time.monotonic()
        load.wait_for(settings.fault_threads, since=recovered)
        time.sleep(half)
    refused = load.failures(killed, recovered)
    figures["stub_kill"] = {
        "recovered_models": reloaded_models,
        "recover_seconds": round(recovered - recovering, 1),
        "refused_while_dead": len(refused),
        "answered_while_dead": load.successes(killed) - load.successes(recovered),
        "failed_in_all": len(load.failures()),
        "errors": sorted({o.error for o in load.failures()})[:3],
        "failed_after_recover": len(load.failures(recovered)),
        "answered_after_recover": load.successes(recovered),
    }
    return figures


def run_soak(settings: SoakSettings, run_dir: str | os.PathLike, source=None) -> dict:
    """Serve ``settings.model`` from a copy of ``source`` in ``run_dir``, soak it, return figures."""
    settings.check()
    run_dir = Path(run_dir)
    repo = prepare_run_repository(run_dir, models=[settings.model], source=source)
    result: dict = {
        "settings": asdict(settings),
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    options = {"startup_timeout_s": settings.startup_timeout_s, "warm": False}
    with serving(run_dir, repo.path, [settings.model], **options) as server:
        result["load"] = load_phase(server, settings, run_dir)
        result["load_average_after_load"] = [round(x, 2) for x in os.getloadavg()]
        if settings.faults:
            result["faults"] = fault_phase(server, settings)
    growth = result["load"]["memory"].get("growth_percent")
    result["passed"] = {
        "zero_failed_requests": result["load"]["requests_failed"] == 0
        and result["load"].get("perf_analyzer_status") == 0,
        "memory_growth_under_limit": growth is not None
        and growth < settings.max_memory_growth_percent,
    }
    write_result(run_dir, "soak", result)
    return result


def table(result: dict) -> str:
    """The soak's figures as aligned text."""
    s, load = result["settings"], result["load"]
    memory = load["memory"]
    rows = [
        ("model", s["model"]),
        ("concurrency x seconds", f"{s['concurrency']} x {s['duration_s']:g}"),
        ("requests answered / failed", f"{load['requests_succeeded']} / {load['requests_failed']}"),
        ("throughput (infer/s)", load.get("throughput_per_s", "-")),
        ("p50 / p99 latency (ms)", f"{load.get('p50_ms', '-')} / {load.get('p99_ms', '-')}"),
        (
            f"memory first / last {s['memory_window_s']:g} s (MiB)",
            f"{memory.get('first_window_mib', '-')} / {memory.get('last_window_mib', '-')} "
            f"({memory.get('growth_percent', '-')}%)",
        ),
        (
            "load average before / after",
            f"{result['load_average_before']} / "
            f"{result.get('load_average_after_load')} on {result['cpu_count']} CPUs",
        ),
    ]
    faults = result.get("faults", {})
    if "reload" in faults:
        r = faults["reload"]
        rows.append(("reload under load: failed", f"{r['failed']} of {r['requests']}"))
    if "recover_seconds" in faults.get("stub_kill", {}):
        k = faults["stub_kill"]
        rows.append(
            (
                "killed stub: refused / recover s",
                f"{k['refused_while_dead']} / {k['recover_seconds']} "
                f"(failed after: {k['failed_after_recover']})",
            )
        )
    rows += [(f"passed: {name}", ok) for name, ok in result["passed"].items()]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def memory_figures(samples: list[tuple[float, int]], window_s: float) -> dict:
    """Mean resident MiB over the first and the last ``window_s`` seconds, growth and peak."""
    end = samples[-1][0] if samples else 0.0
    first = [rss for t, rss in samples if t <= window_s]
    last = [rss for t, rss in samples if t >= end - window_s]
    figures: dict = {"samples": len(samples), "seconds": end}
    if first and last:
        first_mib, last_mib = statistics.fmean(first) / 2**20, statistics.fmean(last) / 2**20
        figures.update(
            first_window_mib=round(first_mib, 1),
            last_window_mib=round(last_mib, 1),
            growth_percent=round((last_mib - first_mib) / first_mib * 100, 2),
            peak_mib=round(max(rss for _, rss in samples) / 2**20, 1),
        )
    return figures


# -- labkit bench inflight-soak -----------------------------------------------------------------
#: The figures of AIPerf's row that :func:`inflight_soak` keeps.
INFLIGHT_SOAK_FIGURES = (
    "requests",
    "failed",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "request_p99_ms",
    "aiperf_cpu_share",
)


@dataclass
class InflightSoakSettings:
    """Many streams for a while on the in-flight model (by default 64 streams for 60 s)."""

    model: str = "smollm2_inflight"
    concurrency: int = 64
    duration_s: float = 60.0
    memory_window_s: float = 20.0
    streaming: bool = True
    startup_timeout_s: float = 600.0

    def check(self) -> InflightSoakSettings:
        if self.concurrency < 1 or not 0 < 2 * self.memory_window_s <= self.duration_s:
            raise ConfigError(
                f"concurrency {self.concurrency} must be >= 1 and duration_s="
                f"{self.duration_s:g} must hold two memory windows of {self.memory_window_s:g} s"
            )
        return self


def inflight_soak(
    repository: str | os.PathLike,
    run_dir: str | os.PathLike,
    settings: InflightSoakSettings | None = None,
) -> dict:
    """AIPerf keeps ``concurrency`` streams on the model for ``duration_s`` while the resident
    memory of tritonserver and its stubs is sampled each second. Figures, never a verdict of
    speed: requests answered and failed (refused busy included), tokens/s, memory growth."""
    s = (settings or InflightSoakSettings()).check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = prepare_run_repository(run_dir, models=[s.model], source=repository)
    result: dict = {"settings": asdict(s), "host": host_facts()}
    with serving(run_dir, repo.path, [s.model], startup_timeout_s=s.startup_timeout_s) as server:
        outcome: dict = {}

        def load() -> None:
            try:
                outcome["frame"] = profiling.run_aiperf(
                    server,
                    s.model,
                    profiling.mixed_workload(max(64, s.concurrency)),
                    concurrency=s.concurrency,
                    streaming=s.streaming,
                    duration_s=s.duration_s,
                    run_dir=run_dir / "aiperf",
                    label="soak",
                    timeout_s=s.duration_s * 5 + 300,
                    progress=False,
                )
            except Exception as exc:  # noqa: BLE001 (reported in the figures)
                outcome["error"] = str(exc)

        samples = memory_while(server, load)
        stats = [line for line in server.log_tail(400).splitlines() if "in-flight engine" in line]
    if "frame" in outcome:
        row = outcome["frame"].iloc[0].to_dict()
        result.update({key: _figure(row.get(key)) for key in INFLIGHT_SOAK_FIGURES})
    else:
        result["error"] = outcome.get("error", "AIPerf did not finish")
    result["engine_log"] = stats[-2:]
    result["memory"] = memory_figures(samples, s.memory_window_s)
    result["host"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(run_dir, "inflight-soak", result)
    return result


def _figure(value):
    """A figure for JSON: floats to 3 decimals (NaN to None), numpy scalars to Python's."""
    if isinstance(value, float):
        return None if value != value else round(value, 3)
    return value.item() if hasattr(value, "item") else value


def inflight_soak_table(result: dict) -> str:
    """The in-flight soak's figures as lines of text."""
    s, m = result["settings"], result["memory"]
    rows = [
        f"{s['model']}: {s['concurrency']} {'streams' if s['streaming'] else 'clients'} for "
        f"{s['duration_s']:g} s",
        f"requests {result.get('requests')}, failed {result.get('failed')} (busy refusals count)",
        f"output tokens/s {result.get('output_tokens_per_s')}, TTFT p50/p99 "
        f"{result.get('ttft_p50_ms')}/{result.get('ttft_p99_ms')} ms",
        f"resident memory first/last {s['memory_window_s']:g} s: {m.get('first_window_mib')}/"
        f"{m.get('last_window_mib')} MiB ({m.get('growth_percent')}%), peak {m.get('peak_mib')}",
        f"load average {result['host']['load_average_start']} -> "
        f"{result['host'].get('load_average_end')} on {result['host']['cores']} cores",
    ]
    if "error" in result:
        rows.append(f"error: {result['error']}")
    return "\n".join(rows)
