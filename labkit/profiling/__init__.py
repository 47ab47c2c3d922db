"""Measuring a served model.

- :mod:`.perf`: perf_analyzer, the one place its command lines are built and run;
- :mod:`.metrics`: Triton's Prometheus metrics as DataFrames;
- :mod:`.analyzer`: Model Analyzer, sized for the host, and its results.
"""

from .metrics import metrics, request_counts, scrape
from .perf import Tool, locate_perf_analyzer, perf_analyzer, repeated, report, write_perf_data

__all__ = [
    "Tool",
    "locate_perf_analyzer",
    "metrics",
    "perf_analyzer",
    "repeated",
    "report",
    "request_counts",
    "scrape",
    "write_perf_data",
]
