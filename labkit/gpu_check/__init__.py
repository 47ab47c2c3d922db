"""The GPU check: a self-contained run of the lab on a bare NVIDIA machine with no network.

Two halves, one on each machine:

- :mod:`.bundle` (here): :func:`build_bundle` packs what that machine lacks into one folder of
  at most 60 MiB (Triton 2.51 from the nvidia-pytriton wheel with the stub for its Python, a
  numpy<2 wheel for the stub, the lab's model code, a model config without weights);
- :mod:`.remote` (there, as ``run.py``): only the standard library, torch and transformers;
  starts Triton with ``KIND_GPU`` instances, checks batched against alone greedy answers per
  dtype, runs the batching benchmarks, reads the GPU from Triton's metrics, writes one JSON.

``scripts/gpu-check.sh --bundle DIR`` and ``scripts/gpu-check.sh --run DIR --out OUT`` are the
two commands; :func:`summary` turns the JSON that comes back into a table.
"""

from .bundle import SIZE_LIMIT_BYTES, BundleInfo, build_bundle, default_bundle_dir
from .remote import RESULT, parse_metrics

__all__ = [
    "RESULT",
    "SIZE_LIMIT_BYTES",
    "BundleInfo",
    "build_bundle",
    "default_bundle_dir",
    "parse_metrics",
]
