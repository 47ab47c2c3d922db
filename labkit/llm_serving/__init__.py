"""The LLM-serving study: the ways to serve the lab's text model, measured side by side in tokens.

- :mod:`.schedulers`: the ways (no batching, dynamic batching, in-flight batching, vLLM in
  float32 and bfloat16), the study's settings and workloads, and the model folders each way needs;
- :mod:`.measure`: one server, each way in turn under AIPerf; answers checked under load;
- :mod:`.standalone`: vLLM's own OpenAI server on the served model's settings (the reference);
- :mod:`.gpu`: the vLLM model's GPU configs, ours and Triton's ``vllm`` backend's;
- :mod:`.frontend` and :mod:`.startup`: ``labkit bench frontend`` (what Triton costs against vLLM's
  own server) and ``labkit bench vllm-start`` (eager and compiled starts);
- :mod:`.warm`: vLLM's compile cache filled for the shipped model (``labkit prepare --warm-vllm``);
- :mod:`.inprocess`: the same engine without Triton (the limit), float32 against bfloat16;
- :mod:`.figures`: the ratios the study's targets are about, and the targets;
- :mod:`.study`: :func:`run`, the benchmark's whole study in one call, its :class:`StudyResult`
  and its text table;
- :mod:`.rounds`: :func:`compare`, notebook 06's comparison: every way up at once, measured in
  rounds, and its :class:`Comparison`;
- :mod:`.apis`: one request through the ``openai`` client to vLLM's own server and through
  Triton's ``/generate`` to vLLM in Triton: text, finish reason, token counts;
- :mod:`.benchmark`: the benchmark's own measured figure, shipped as data with its provenance;
- :mod:`.source`: the in-flight engine's code as a learner reads it;
- :mod:`.charts`: notebook 06's table and charts.
"""

from . import apis, benchmark
from .apis import apis_frame
from .charts import precision_figure, results_frame, rounds_figure, timeline_figure
from .figures import TARGETS, ratios, targets
from .gpu import GpuVllm, write_gpu_configs
from .rounds import CompareSettings, Comparison, compare
from .schedulers import SCHEDULERS, WORKLOADS, StudySettings, workload, write_scheduler_folders
from .source import engine_code
from .study import Headline, StudyResult, run

__all__ = [
    "SCHEDULERS",
    "TARGETS",
    "WORKLOADS",
    "CompareSettings",
    "Comparison",
    "GpuVllm",
    "Headline",
    "StudyResult",
    "StudySettings",
    "apis",
    "apis_frame",
    "benchmark",
    "compare",
    "engine_code",
    "precision_figure",
    "ratios",
    "results_frame",
    "rounds_figure",
    "run",
    "targets",
    "timeline_figure",
    "workload",
    "write_gpu_configs",
    "write_scheduler_folders",
]
