"""vLLM's engine statistics as Triton custom metrics (``/metrics``), labelled by model.

vLLM hands each engine step's statistics to the stat loggers given to ``AsyncLLM`` (its
``StatLoggerBase``); :meth:`EngineMetrics.logger_factory` makes one that writes them into Triton's
metric families through the Python backend's ``pb_utils.MetricFamily``. Imported after vLLM's
environment is set (model.py), as engine.py is.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils
from vllm.v1.metrics.loggers import StatLoggerBase


class EngineMetrics:
    """vLLM's scheduler counters as Triton custom metrics (``/metrics``), labelled by model."""

    FAMILIES = {
        "running": ("vllm_num_requests_running", "Sequences the vLLM engine is generating"),
        "waiting": ("vllm_num_requests_waiting", "Sequences waiting in the vLLM engine"),
        "kv_cache": ("vllm_kv_cache_usage_perc", "Share of the vLLM KV cache in use (0..1)"),
    }

    def __init__(self, model: str) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        self.families = [pb_utils.MetricFamily(n, d, gauge) for n, d in self.FAMILIES.values()]
        labels = {"model": model}
        self.gauges = dict(
            zip(self.FAMILIES, (f.Metric(labels=labels) for f in self.families), strict=True)
        )
        self.aborted_family = pb_utils.MetricFamily(
            "vllm_requests_aborted_total",
            "Requests aborted in the vLLM engine because their client went away",
            pb_utils.MetricFamily.COUNTER,
        )
        self.aborted = self.aborted_family.Metric(labels=labels)

    def update(self, running: int, waiting: int, kv_cache: float) -> None:
        self.gauges["running"].set(running)
        self.gauges["waiting"].set(waiting)
        self.gauges["kv_cache"].set(kv_cache)

    def logger_factory(self):
        metrics = self

        class TritonStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    metrics.update(
                        scheduler_stats.num_running_reqs,
                        scheduler_stats.num_waiting_reqs,
                        scheduler_stats.kv_cache_usage,
                    )

            def log_engine_initialized(self) -> None:
                pass

        return TritonStatLogger
