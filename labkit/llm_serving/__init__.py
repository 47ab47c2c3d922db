"""The LLM-serving study: the ways to serve the lab's text model, measured side by side in tokens.

- :mod:`.schedulers`: the ways (no batching, dynamic batching, in-flight batching), the study's
  settings and workloads, and the model folders each way needs;
- :mod:`.measure`: one server, each way in turn under AIPerf; answers checked under load;
- :mod:`.inprocess`: the same engine without Triton (the limit), float32 against bfloat16;
- :mod:`.figures`: ratios, targets and the text table;
- :mod:`.study`: :func:`run`, the whole study in one call, and its :class:`StudyResult`;
- :mod:`.charts`: notebook 06's tables and charts.
"""

from .charts import (
    precision_figure,
    results_frame,
    schedulers_figure,
    targets_frame,
    timeline_figure,
)
from .figures import TARGETS, ratios, targets
from .schedulers import SCHEDULERS, WORKLOADS, StudySettings, workload, write_scheduler_folders
from .study import Headline, StudyResult, run

__all__ = [
    "SCHEDULERS",
    "TARGETS",
    "WORKLOADS",
    "Headline",
    "StudyResult",
    "StudySettings",
    "precision_figure",
    "ratios",
    "results_frame",
    "run",
    "schedulers_figure",
    "targets",
    "targets_frame",
    "timeline_figure",
    "workload",
    "write_scheduler_folders",
]
