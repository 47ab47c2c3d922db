"""The vLLM engine's settings: config.pbtxt parameters, checked, and what they become.

Standard library only (no vLLM, no Triton): the fast tests read configs with it, and the model
reads its parameters with it before vLLM is imported (some settings are environment variables
that vLLM reads when it starts). Defaults suit a CPU: float32 (greedy answers then equal
``smollm2``'s), eager mode (no compile at the first start), a small KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's config.pbtxt parameters (strings there), by the same names."""

    dtype: str = "float32"  # vLLM's dtype; "auto": the checkpoint's
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the CPU KV cache, in GiB
    max_num_seqs: int = 16  # sequences generating at once
    max_num_batched_tokens: int = 2048  # tokens one engine step may process
    max_model_len: int = 0  # 0: the model's context
    max_queue_size: int = 64  # requests waiting beyond max_num_seqs; one more is refused: busy
    # VLLM_CPU_OMP_THREADS_BIND: the cores of the engine's threads, one thread each. "auto": every
    # core but one (vLLM keeps one for the rest on x86: on 2 cores, 1 thread); "nobind": torch's
    # default; or a list such as "0" or "0-1".
    omp_threads_bind: str = "auto"
    enforce_eager: bool = True  # false: torch.compile at the first start (cached afterwards)
    gpu_memory_utilization: float = 0.9  # a GPU host's share of GPU memory for weights and KV
    # Devices with several cores per model (GPUs, NeuronCores): labkit.neuron.vllm writes these.
    tensor_parallel_size: int = 1  # devices (or NeuronCores) one copy of the model spans
    block_size: int = 0  # KV cache block, in tokens; 0: vLLM's default for the platform
    additional_config: str = ""  # a JSON object for the platform plugin (Neuron's overrides)
    # the engine's start (its processes, the weights, a first answer) may take this long; past
    # it the load fails and every process the engine started is ended
    start_timeout_s: int = 900
    # an unload lets the answers in flight finish for this long, then ends the rest with an error
    unload_drain_s: int = 30


MINIMUM = {
    "kv_cache_gib": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 16,
    "tensor_parallel_size": 1,
    "start_timeout_s": 1,
}
#: Upper-case parameters with these prefixes become the engine's environment variables (the
#: platform is chosen by them: VLLM_PLUGINS, NEURON_RT_VISIBLE_CORES, ...).
ENVIRONMENT_PREFIXES = ("VLLM_", "NEURON_")


def read_engine_options(params: Mapping[str, str]) -> EngineOptions:
    """The options config.pbtxt's parameters set, defaults for the others.

    Raises ``ValueError`` naming the parameter (the model reports it as a config error).
    """
    values = {
        option.name: _parse(option.name, str(params[option.name]).strip(), type(option.default))
        for option in fields(EngineOptions)
        if option.name in params
    }
    options = EngineOptions(**values)
    if options.dtype not in DTYPES:
        raise ValueError(
            f"parameter 'dtype' must be one of {', '.join(DTYPES)}, got {options.dtype!r}"
        )
    if options.additional_config:
        try:
            extra = json.loads(options.additional_config)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            raise ValueError(
                "parameter 'additional_config' must be a JSON object, got "
                f"{options.additional_config!r}"
            )
    if not options.omp_threads_bind:
        raise ValueError(
            "parameter 'omp_threads_bind' is empty; use auto, nobind or cores like 0-1"
        )
    return options


def _parse(name: str, text: str, kind: type) -> object:
    """One parameter's string as the option's type, checked."""
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"parameter {name!r} must be true or false, got {text!r}")
        return text.lower() == "true"
    if kind is int:
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"parameter {name!r} must be an integer, got {text!r}") from None
        least = MINIMUM.get(name, 0)
        if number < least:
            raise ValueError(f"parameter {name!r} must be >= {least}, got {number}")
        return number
    if kind is float:
        try:
            share = float(text)
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ValueError(f"parameter {name!r} must be in (0, 1], got {text!r}")
        return share
    return text


def engine_environment(options: EngineOptions) -> dict[str, str]:
    """The environment variables vLLM's CPU backend reads when its engine starts."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": options.omp_threads_bind,
    }


def device_environment(params: Mapping[str, str]) -> dict[str, str]:
    """The environment variables config.pbtxt names itself: upper-case ``VLLM_*`` and
    ``NEURON_*`` parameters (a Neuron host's ``VLLM_PLUGINS``, ``NEURON_RT_VISIBLE_CORES``)."""
    return {
        key: str(value)
        for key, value in params.items()
        if key.isupper() and key.startswith(ENVIRONMENT_PREFIXES)
    }


def instance_environment(
    options: EngineOptions, args: Mapping[str, str], visible: str | None = None
) -> dict[str, str]:
    """The environment that pins one model instance's engine to its device.

    ``args`` are what Triton passes to ``initialize``: ``model_instance_kind`` (``CPU``, ``GPU``
    or ``MODEL``) and ``model_instance_device_id``. Triton's default on a GPU host is one
    instance per GPU; each would start vLLM on GPU 0, asking for ``gpu_memory_utilization`` of
    its memory. A GPU instance therefore sees only its own GPU (``CUDA_VISIBLE_DEVICES``). The
    device id counts the GPUs the server sees: with ``visible``, the server's own
    ``CUDA_VISIBLE_DEVICES`` (``2,3``), id 0 is the first of those (``2``), not GPU 0. An
    engine spanning several devices (``tensor_parallel_size`` > 1) cannot live on one: it needs
    one instance of ``kind: KIND_MODEL``, which sees them all. Raises ``ValueError``.
    """
    kind = str(args.get("model_instance_kind", "")).upper()
    if kind != "GPU":
        return {}
    if options.tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={options.tensor_parallel_size} spans several GPUs, but Triton "
            f"gave this instance GPU {args.get('model_instance_device_id')} alone (kind "
            "KIND_GPU, Triton's default: one instance per GPU); set instance_group "
            "[{ count: 1, kind: KIND_MODEL }] in config.pbtxt"
        )
    device = str(args.get("model_instance_device_id", "0"))
    seen = [gpu.strip() for gpu in (visible or "").split(",") if gpu.strip()]
    if not seen:
        return {"CUDA_VISIBLE_DEVICES": device}
    if not device.isdigit() or int(device) >= len(seen):
        raise ValueError(
            f"Triton gave this instance GPU {device}, but the server sees only "
            f"CUDA_VISIBLE_DEVICES={visible}"
        )
    return {"CUDA_VISIBLE_DEVICES": seen[int(device)]}


def engine_arguments(options: EngineOptions, model: str) -> dict:
    """The keyword arguments of vLLM's ``AsyncEngineArgs`` for ``options`` and a weights folder."""
    arguments = {
        "model": model,
        "dtype": options.dtype,
        "max_num_seqs": options.max_num_seqs,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "enforce_eager": options.enforce_eager,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "disable_log_stats": False,  # the stat loggers feed the model's Triton metrics
    }
    if options.max_model_len:
        arguments["max_model_len"] = options.max_model_len
    if options.tensor_parallel_size > 1:
        arguments["tensor_parallel_size"] = options.tensor_parallel_size
    if options.block_size:
        arguments["block_size"] = options.block_size
    if options.additional_config:
        arguments["additional_config"] = json.loads(options.additional_config)
    return arguments


def queue_limit(options: EngineOptions) -> int:
    """How many requests the model holds at once (generating or waiting) before it says busy."""
    return options.max_num_seqs + options.max_queue_size
