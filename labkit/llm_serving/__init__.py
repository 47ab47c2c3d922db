"""The LLM-serving study: the ways to serve the lab's text model, measured side by side in tokens.

- :mod:`.schedulers`: the ways (no batching, dynamic batching, in-flight batching, vLLM in
  float32 and bfloat16), the study's settings and workloads, and the model folders each way needs;
- :mod:`.measure`: one server, each way in turn under AIPerf; answers checked under load;
- :mod:`.standalone`: vLLM's own OpenAI server on the served model's settings (the reference);
- :mod:`.gpu`: the vLLM model's GPU configs, ours and Triton's ``vllm`` backend's;
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
from .gpu import GpuVllm, write_gpu_configs
from .schedulers import SCHEDULERS, WORKLOADS, StudySettings, workload, write_scheduler_folders
from .study import Headline, StudyResult, run

__all__ = [
    "SCHEDULERS",
    "TARGETS",
    "WORKLOADS",
    "GpuVllm",
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
    "write_gpu_configs",
    "write_scheduler_folders",
]
