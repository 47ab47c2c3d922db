"""The served vLLM model on a GPU host, written and checked here, served there.

Two ways, the same engine arguments: the lab's own Python-backend model (``smollm2_vllm``, its
config's parameters changed for a GPU: dtype, compiled as on the CPU, a share of GPU memory), and
Triton's own ``vllm`` backend in NGC's ``<yy.mm>-vllm-python-py3`` image (``config.pbtxt`` with
``backend: "vllm"`` and ``1/model.json``). Both are read back through Triton's ``ModelConfig`` and
validated; the engine arguments come from the model's own ``vllm_settings.py``, so the GPU twin
cannot drift from what the CPU model runs. Nothing here needs a GPU; serving it does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError
from labkit.repository import Repository, apply_edits, diff_configs
from labkit.server.image import vllm_run_command, write_vllm_backend_model

from .standalone import load_settings

#: What changes on a GPU: the checkpoint's dtype (bfloat16 for SmolLM2), CUDA graphs (compiled at
#: the first start), and the share of GPU memory vLLM takes for weights and KV cache.
GPU_PARAMETERS = {"dtype": "auto", "enforce_eager": "false", "gpu_memory_utilization": "0.9"}


@dataclass
class GpuVllm:
    """What :func:`write_gpu_configs` wrote."""

    model_dir: Path  # the lab's model's config.pbtxt with GPU parameters (its code is the same)
    diff: str  # its config.pbtxt against the CPU one
    backend_dir: Path  # Triton's vllm backend twin: config.pbtxt + 1/model.json
    engine_args: dict
    docker_command: list[str]  # NGC's vLLM image serving the twin (built, not run)


def write_gpu_configs(
    repo: Repository,
    model: str,
    out_dir: str | os.PathLike,
    *,
    hub_model: str | None = None,
    **parameters: str,
) -> GpuVllm:
    """Write ``model``'s GPU twin and Triton's ``vllm`` backend twin under ``out_dir``.

    ``parameters`` override :data:`GPU_PARAMETERS`; ``hub_model`` (e.g. ``facebook/opt-125m``)
    replaces the local weights in the backend twin's ``model.json``, for a host that downloads
    them (a local path here means nothing in the container).
    """
    if model not in repo.models():
        raise ConfigError(f"{repo.path} holds no model {model!r}")
    settings = load_settings(repo.model_dir(model))
    cpu = repo.config(model)
    gpu = apply_edits(cpu, parameters={**GPU_PARAMETERS, **parameters})
    params = {key: value.string_value for key, value in gpu.parameters.items()}
    try:
        options = settings.read_engine_options(params)
    except ValueError as exc:
        raise ConfigError(f"{model} on a GPU: {exc}") from None
    weights = hub_model or params.get("huggingface_model", "")
    engine_args = settings.engine_arguments(options, weights)
    out = Repository(Path(out_dir) / "gpu", create=True)
    (out.path / model).mkdir(exist_ok=True)
    out.write_config(model, gpu)  # validated: what Triton will parse
    backend_dir = write_vllm_backend_model(Path(out_dir) / "gpu_vllm_backend" / model, engine_args)
    return GpuVllm(
        model_dir=out.path / model,
        diff=diff_configs(cpu, gpu, model),
        backend_dir=backend_dir,
        engine_args=engine_args,
        docker_command=vllm_run_command(backend_dir.parent),
    )
