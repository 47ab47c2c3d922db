"""vLLM's engine statistics on Triton's ``/metrics``, under vLLM's own names, labelled by model.

vLLM hands each engine step's statistics to the stat loggers given to ``AsyncLLM`` (its
``StatLoggerBase``); :meth:`EngineMetrics.logger_factory` makes one. What it exports, with the
names vLLM's own server and Triton's ``vllm_backend`` give them:

- counters ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``: the tokens the
  engine prefilled and generated;
- histograms ``vllm:time_to_first_token_seconds`` (one observation per prompt),
  ``vllm:time_per_output_token_seconds`` (one per token after the first: the time since the one
  before it; Triton's vllm_backend's name, which vLLM 0.32's own server now calls
  ``vllm:inter_token_latency_seconds``) and ``vllm:e2e_request_latency_seconds`` (one per
  finished sequence), on vLLM's default buckets;
- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` (0..1, vLLM 0.32's name for the older ``gpu_cache_usage_perc``);
- and the lab's own counter ``vllm_requests_aborted_total`` (engine.py counts the requests it
  aborted because their client went away), not in vLLM's ``vllm:`` namespace since vLLM has no
  such metric.

Triton 2.51's Python backend has histograms (``pb_utils.MetricFamily.HISTOGRAM``, ``buckets=``,
``observe``). Each metric call is a round trip to the server process: 30 to 70 us a call, warm,
in Triton 2.51 on the lab's 2-core host, where a Python thread spinning beside 2,000 calls kept
its pace (the stub does not hold the GIL while it waits). vLLM calls the stat logger on the
engine's event-loop thread after every step, where no call should wait; so the logger only
queues what it gets, and a thread of its own writes it every :data:`WRITE_EVERY_S`, folded into
one increment per counter and one set per gauge that changed (a histogram takes one call per
observation: one per token for the time per output token).

Imported after vLLM's environment is set (model.py), as engine.py is.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils
from vllm.v1.metrics.buckets import histogram_buckets
from vllm.v1.metrics.loggers import StatLoggerBase

WRITE_EVERY_S = 0.25  # how often the metrics are written (each call is a round trip)
LOG_EVERY_S = 60.0  # a writer that keeps failing is logged at most this often

#: name -> (vLLM's name on /metrics, its description)
COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
    "generation_tokens": (
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
    ),
    "aborted": (
        "vllm_requests_aborted_total",
        "Requests aborted in the vLLM engine because their client went away",
    ),
}
GAUGES = {
    "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_cache": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
}
#: name -> (vLLM's name, its description, vLLM's bucket family for its default buckets)
HISTOGRAMS = {
    "ttft": (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        "time_to_first_token",
    ),
    "tpot": (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        "inter_token_latency",
    ),
    "e2e": (
        "vllm:e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        "request_latency",
    ),
}


class EngineMetrics:
    """The model's metric families on Triton's ``/metrics``, and the thread that writes them."""

    def __init__(self, model: str) -> None:
        labels = {"model": model}
        kind = pb_utils.MetricFamily
        # The families must live as long as their metrics: Triton drops a family's metrics
        # with it.
        self.families = {}
        self.metrics = {}
        for name, (metric, text) in COUNTERS.items():
            self.families[name] = kind(metric, text, kind.COUNTER)
            self.metrics[name] = self.families[name].Metric(labels=labels)
        for name, (metric, text) in GAUGES.items():
            self.families[name] = kind(metric, text, kind.GAUGE)
            self.metrics[name] = self.families[name].Metric(labels=labels)
        for name, (metric, text, buckets) in HISTOGRAMS.items():
            self.families[name] = kind(metric, text, kind.HISTOGRAM)
            self.metrics[name] = self.families[name].Metric(
                labels=labels, buckets=histogram_buckets(buckets)
            )
        self.aborted = QueuedCounter(self, "aborted")  # engine.py: aborted.increment(1)
        self.written: dict[str, float] = {}  # the gauges' values on /metrics
        self.failures = 0
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._logged_at = -LOG_EVERY_S
        self._thread = threading.Thread(target=self._write_loop, name="vllm-metrics", daemon=True)
        self._thread.start()

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Queue one of vLLM's stat records; called on the engine's loop, so it never waits."""
        self._queue.put(step_report(scheduler_stats, iteration_stats))

    def put(self, report: Pending) -> None:
        self._queue.put(report)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, end the writer thread, then let the metrics and their families
        go while the stub can still tell the server. (Left to the interpreter's exit, their
        destructors crashed the stub at unload: "Segfault encountered" after the engine stopped.
        While the writer thread lived, its frame kept them, so nothing was ever freed.)"""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.metrics.clear()  # a family must outlive its metrics
            self.families.clear()

    def logger_factory(self):
        """The stat logger class vLLM instantiates (``stat_loggers=[...]``)."""
        metrics = self

        class TritonStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                metrics.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return TritonStatLogger

    # -- the writer thread ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            pending, closing = self._take()
            try:
                self._write(pending)
            except Exception as exc:  # noqa: BLE001 (metrics must not end the writer, or the model)
                self.failures += 1
                now = time.monotonic()
                if now - self._logged_at >= LOG_EVERY_S:
                    self._logged_at = now
                    pb_utils.Logger.log_error(
                        f"vLLM metrics not written ({self.failures} time(s) so far): {exc!r}"
                    )
            if closing:
                return
            time.sleep(WRITE_EVERY_S)  # what comes meanwhile is folded into the next write

    def _take(self) -> tuple[Pending, bool]:
        """Wait for a report, then fold every report queued behind it into it."""
        pending = Pending()
        item = self._queue.get()
        while item is not None:
            pending.add(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return pending, False
        return pending, True

    def _write(self, pending: Pending) -> None:
        for name, value in pending.counts.items():
            if value:
                self.metrics[name].increment(value)
        for name, value in pending.gauges.items():
            if self.written.get(name) != value:
                self.metrics[name].set(value)
                self.written[name] = value
        for name, values in pending.observed.items():
            for value in values:
                self.metrics[name].observe(value)


@dataclass(frozen=True)
class QueuedCounter:
    """A counter whose increments go through the writer thread, as the engine's reports do."""

    metrics: EngineMetrics
    name: str

    def increment(self, value: float) -> None:
        report = Pending()
        report.counts[self.name] = value
        self.metrics.put(report)


@dataclass
class Pending:
    """What the engine reported since the last write: summed counts, the last gauge values and
    every observation."""

    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    gauges: dict[str, float] = field(default_factory=dict)
    observed: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in HISTOGRAMS})

    def add(self, report: Pending) -> None:
        for name, value in report.counts.items():
            self.counts[name] += value
        self.gauges.update(report.gauges)
        for name, values in report.observed.items():
            self.observed[name].extend(values)


def step_report(scheduler_stats, iteration_stats) -> Pending:
    """What one of vLLM's stat records adds to the metrics (the fields its own Prometheus logger
    reads in vLLM 0.32)."""
    report = Pending()
    if scheduler_stats is not None:
        report.gauges = {
            "running": scheduler_stats.num_running_reqs,
            # vLLM's own gauge counts the requests it put off too (num_skipped_waiting_reqs)
            "waiting": scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
            "kv_cache": scheduler_stats.kv_cache_usage,
        }
    if iteration_stats is not None:
        report.counts["prompt_tokens"] = iteration_stats.num_prompt_tokens
        report.counts["generation_tokens"] = iteration_stats.num_generation_tokens
        report.observed["ttft"] = list(iteration_stats.time_to_first_tokens_iter)
        report.observed["tpot"] = list(iteration_stats.inter_token_latencies_iter)
        report.observed["e2e"] = [r.e2e_latency for r in iteration_stats.finished_requests]
    return report
