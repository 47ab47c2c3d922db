"""Measuring a served model.

- :mod:`.perf`: perf_analyzer, the one place its command lines are built and run;
- :mod:`.metrics`: Triton's Prometheus metrics as DataFrames (a vLLM model's too);
- :mod:`.analyzer`: Model Analyzer, sized for the host, and its results;
- :mod:`.aiperf`: AIPerf, an LLM's figures (time to first token, inter-token latency, tokens/s).
"""

from .aiperf import (
    Workload,
    fixed_workload,
    locate_aiperf,
    mixed_workload,
    model_weights,
    request_records,
    run_aiperf,
    server_cpu_s,
)
from .metrics import cache_metrics, cache_totals, metrics, request_counts, scrape, vllm_metrics
from .perf import Tool, locate_perf_analyzer, perf_analyzer, repeated, report, write_perf_data

__all__ = [
    "Tool",
    "Workload",
    "cache_metrics",
    "cache_totals",
    "fixed_workload",
    "locate_aiperf",
    "locate_perf_analyzer",
    "metrics",
    "mixed_workload",
    "model_weights",
    "perf_analyzer",
    "repeated",
    "report",
    "request_counts",
    "request_records",
    "run_aiperf",
    "scrape",
    "server_cpu_s",
    "vllm_metrics",
    "write_perf_data",
]
