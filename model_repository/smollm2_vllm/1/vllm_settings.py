"""The vLLM engine's settings: config.pbtxt parameters, checked, and what they become.

Standard library only (no vLLM, no Triton): the fast tests read configs with it, and the model
reads its parameters with it before vLLM is imported (some settings are environment variables
that vLLM reads when it starts). Defaults suit a CPU: float32 (greedy answers then equal
``smollm2``'s), compiled (vLLM's own default), a small KV cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

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
    # false (the default, as in vLLM's own server): vLLM compiles the model with torch.compile
    # as it starts, and keeps the compiled graphs (compile_environment) so that a later start
    # with the same settings loads them. true: eager, nothing compiled. On the lab's 2-core host
    # (labkit bench vllm-start, 2026-12-06, load average 0.5 to 2.3, to the first answer):
    # float32 compiled 133 s at its first start, 52 s at later ones, eager 40 s; bfloat16 164 s,
    # 41 s and 31 s. A compiled step served x1.08 to x1.24 the tokens/s of an eager one
    # (labkit bench frontend --defaults, 2026-12-05). `make install` compiles the shipped
    # settings once (labkit prepare --warm-vllm: 99 and 101 s); settings that change the graphs
    # (another dtype, say) compile again at their first start. The GPU configs compile too.
    enforce_eager: bool = False
    # vLLM's stream_interval: a streamed answer gets one response per this many tokens (its
    # last one at once). 1: a response per token. A request may ask for more in its
    # sampling_parameters, never fewer.
    stream_interval: int = 1
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
    # LoRA adapters served by name (a request's "lora_name"): a JSON object {"name": "folder"},
    # each folder in PEFT's format (adapter_config.json, adapter_model.safetensors), absolute or
    # relative to the model's folder. Empty: LoRA is off, and vLLM builds no LoRA layers (the
    # start and the speed of a model without adapters do not change).
    lora_adapters: str = ""


MINIMUM = {
    "kv_cache_gib": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 16,
    "tensor_parallel_size": 1,
    "start_timeout_s": 1,
    "stream_interval": 1,
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
    adapter_folders(options)  # a malformed lora_adapters is refused with the other settings
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


def engine_environment(
    options: EngineOptions, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment variables vLLM's CPU backend reads when its engine starts.

    A compiled engine also gets where its compiled graphs are kept, so that a later start loads
    them (:func:`compile_environment`).
    """
    environment = {
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": options.omp_threads_bind,
    }
    if not options.enforce_eager:
        environment.update(compile_environment(os.environ if environ is None else environ))
    return environment


def compile_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Where a compiled CPU engine keeps what it compiled, and how it finds it again.

    - ``VLLM_USE_AOT_COMPILE=0``: vLLM 0.32 on torch 2.13 saves its ahead-of-time compile cache
      but cannot load it back ("'function' object has no attribute 'finalize_loading'", then
      "Compiling model again due to a load failure"): with it on, every start compiled again
      (168-239 s on 2 cores, 2026-12-06).
    - Off, vLLM's CPU engine compiles through torch.compile, and inductor keeps the compiled
      graphs in its own cache, ``TORCHINDUCTOR_CACHE_DIR``: by default a folder in the system's
      temporary folder, which a reboot may empty. It goes beside vLLM's other caches instead:
      ``torchinductor`` under ``VLLM_CACHE_ROOT`` (vLLM's default: ``$XDG_CACHE_HOME/vllm``,
      ``~/.cache/vllm``).

    A variable already set in ``environ`` is kept, and a config.pbtxt parameter of the same name
    wins over both (:func:`device_environment` is applied after).
    """
    root = environ.get("VLLM_CACHE_ROOT") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm"
    )
    return {
        "VLLM_USE_AOT_COMPILE": environ.get("VLLM_USE_AOT_COMPILE") or "0",
        "TORCHINDUCTOR_CACHE_DIR": environ.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(root, "torchinductor"),
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


def engine_arguments(options: EngineOptions, model: str, adapters: Sequence[Adapter] = ()) -> dict:
    """The keyword arguments of vLLM's ``AsyncEngineArgs`` for ``options``, a weights folder and
    the LoRA ``adapters`` the model serves (:func:`read_adapters`; none: LoRA off)."""
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
    if options.stream_interval > 1:
        arguments["stream_interval"] = options.stream_interval
    if options.additional_config:
        arguments["additional_config"] = json.loads(options.additional_config)
    if adapters:
        arguments["enable_lora"] = True
        # One slot more than the adapters, never filled: vLLM 0.32's CPU LoRA ops (torch_ops,
        # PunicaWrapperCPU) look up a request without an adapter at slot index -1, the last slot,
        # so with every slot filled a base request that shares an engine step with an adapter's
        # got the last adapter's answer (measured: "I am going" answered as the adapter's). vLLM
        # fills the lowest free slot first; the last one stays zero and adds nothing.
        arguments["max_loras"] = len(adapters) + 1
        arguments["max_lora_rank"] = lora_rank(max(adapter.rank for adapter in adapters))
    return arguments


def queue_limit(options: EngineOptions) -> int:
    """How many requests the model holds at once (generating or waiting) before it says busy."""
    return options.max_num_seqs + options.max_queue_size


# -- LoRA adapters ------------------------------------------------------------------------------
#: The ranks vLLM 0.32 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The files of an adapter in PEFT's format (``save_pretrained``), which vLLM loads.
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter the model serves: its name in requests, its folder, its rank."""

    name: str
    path: str  # absolute
    rank: int  # its largest rank (PEFT's ``r``, or a larger one in its ``rank_pattern``)


def adapter_folders(options: EngineOptions) -> dict[str, str]:
    """``lora_adapters`` read: name -> folder as written, in the order given. Raises
    ``ValueError`` naming the parameter."""
    if not options.lora_adapters.strip():
        return {}
    example = 'e.g. {"demo": "adapters/demo"}'
    try:
        named = json.loads(options.lora_adapters)
    except ValueError:
        named = None
    if not isinstance(named, dict) or not named:
        raise ValueError(
            "parameter 'lora_adapters' must be a JSON object of adapter names and folders, "
            f"{example}; got {options.lora_adapters!r}"
        )
    for name, folder in named.items():
        if not name.strip() or not isinstance(folder, str) or not folder.strip():
            raise ValueError(
                f"parameter 'lora_adapters': adapter {name!r} -> {folder!r} needs a name and a "
                f"folder, {example}"
            )
    return named


def read_adapters(options: EngineOptions, model_dir: str | Path) -> list[Adapter]:
    """The adapters ``lora_adapters`` names, each folder resolved against ``model_dir`` (the
    model's folder) and its rank read from PEFT's ``adapter_config.json``. Raises ``ValueError``
    naming the adapter and the folder (the model reports it as a config error)."""
    adapters = []
    for name, folder in adapter_folders(options).items():
        path = Path(folder).expanduser()
        if not path.is_absolute():
            path = Path(model_dir) / path
        config = path / ADAPTER_CONFIG
        if not config.is_file():
            raise ValueError(
                f"parameter 'lora_adapters': adapter {name!r} is {str(path)!r}, which holds no "
                f"{ADAPTER_CONFIG} (a LoRA adapter in PEFT's format); build it (labkit models "
                "lora) or fix the path"
            )
        try:
            saved = json.loads(config.read_text())
            ranks = [int(saved["r"]), *map(int, (saved.get("rank_pattern") or {}).values())]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"adapter {name!r}: {str(config)!r} has no LoRA rank 'r' ({exc!r})"
            ) from None
        adapters.append(Adapter(name, str(path.resolve()), max(ranks)))
    return adapters


def lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"a LoRA adapter of rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]})"
    )
