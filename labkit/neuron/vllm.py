"""An LLM on inf2/trn1 through vLLM and AWS's vLLM Neuron plugin (``vllm-neuron``).

AWS sends new LLM inference on Neuron to vLLM with the ``vllm-neuron`` plugin: NxD Inference is
in maintenance and transformers-neuronx ended in 2025. So the Neuron LLM is the lab's vLLM model
(``model_repository/smollm2_vllm``: a Python-backend model on vLLM's AsyncLLM, its engine
arguments in ``config.pbtxt`` parameters, its Python in the venv ``EXECUTION_ENV_PATH`` names)
with Neuron engine arguments, and Triton's own ``backend: "vllm"`` twin of it
(:func:`labkit.server.image.write_vllm_backend_model`). Everything here is written and validated
offline; vLLM compiles and serves it only on an inf2/trn1 host with the plugin installed.

Sources (AWS Neuron documentation, "vLLM User Guide for NxD Inference", plugin 0.5.0 / Neuron
2.29 / vLLM 0.16, for Inf2, Trn1 and Trn2; and the vllm-neuron examples):

- install: ``pip install --extra-index-url=https://pip.repos.neuron.amazonaws.com -e .`` in a
  clone of github.com/vllm-project/vllm-neuron; the Neuron compiler and torch-neuronx come from
  the same pip repository or from the Neuron DLAMI's venv
  (``/opt/aws_neuronx_venv_pytorch_inference_vllm_*``);
- engine arguments: ``tensor_parallel_size`` (NeuronCores), ``max_num_seqs`` (the compiled
  batch), ``max_model_len``, ``block_size``, and NxD Inference's NeuronConfig overrides as
  ``additional_config={"override_neuron_config": {...}}``;
- environment: ``NEURON_RT_VISIBLE_CORES`` (which cores the engine takes: the Neuron platform's
  device-control variable in ``vllm.platforms.neuron``), ``VLLM_NEURON_FRAMEWORK=
  neuronx-distributed-inference`` (the same module's framework switch), ``VLLM_PLUGINS=neuron``
  and ``NEURON_COMPILED_ARTIFACTS`` (reuse compiled NEFFs instead of compiling at every start).

For inf2 and trn1 this is the plugin line built on NxD Inference; AWS's newer vLLM Neuron plugin
(Neuron 2.31+, no NxD Inference, ``additional_config={"neuron_config": ...}``) documents Trn2 and
Trn3 only. vLLM removed the ``device`` engine argument in v0.10: the plugin selects the platform.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tritonclient.grpc import model_config_pb2 as mc

from labkit.errors import ConfigError
from labkit.repository import (
    config_to_text,
    diff_configs,
    parse_config,
    read_config,
    validate,
)
from labkit.server.image import ENGINE_ARGS, check_engine_args, write_vllm_backend_model

#: NeuronCores per instance type (inf2: 2 per Inferentia2 chip; trn1: 2 per Trainium chip).
INSTANCE_CORES = {
    "inf2.xlarge": 2,
    "inf2.8xlarge": 2,
    "inf2.24xlarge": 12,
    "inf2.48xlarge": 24,
    "trn1.2xlarge": 2,
    "trn1.32xlarge": 32,
    "trn1n.32xlarge": 32,
}
DTYPES = ("bfloat16", "float16", "float32", "auto")
NEURON_PIP_REPO = "https://pip.repos.neuron.amazonaws.com"
PLUGIN_GIT = "https://github.com/vllm-project/vllm-neuron.git"
PLUGIN_REF = "0.5.0"  # the plugin release the NxD Inference vLLM guide pairs with Neuron 2.29
SETUP_TEMPLATE = Path(__file__).parent.parent / "templates" / "neuron" / "vllm_neuron_setup.sh"
#: smollm2_vllm's parameter for where the weights come from (the engine's ``model``): kept, so the
#: Neuron model serves the same checkpoint.
MODEL_SOURCE = "huggingface_model"
#: smollm2_vllm's settings of vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND):
#: meaningless on NeuronCores, so dropped.
CPU_ONLY = ("kv_cache_gib", "omp_threads_bind")
#: override_neuron_config keys that restate an engine argument: they must agree with it.
RESTATED = {
    "tp_degree": "tensor_parallel_size",
    "batch_size": "max_num_seqs",
    "seq_len": "max_model_len",
}


@dataclass(frozen=True)
class NeuronVllmConfig:
    """The vLLM engine on NeuronCores: what ``smollm2_vllm``'s parameters become on inf2/trn1."""

    model: str
    instance_type: str = "inf2.xlarge"
    tensor_parallel_size: int = 1  # NeuronCores the model is sharded over
    neuron_core_start: int = 0
    max_num_seqs: int = 4  # sequences decoded together: the compiled batch
    max_model_len: int = 2048  # prompt + generated tokens, compiled in
    block_size: int | None = None  # None: max_model_len, one contiguous KV block per sequence
    dtype: str = "bfloat16"
    override_neuron_config: Mapping = field(default_factory=dict)
    execution_env_path: str = "/opt/labkit/venv-vllm-neuron"
    compiled_artifacts: str | None = None  # NEURON_COMPILED_ARTIFACTS: reuse compiled NEFFs
    attention_heads: int | None = None  # the model's num_attention_heads, when known

    @property
    def cores(self) -> int:
        """NeuronCores on :attr:`instance_type`."""
        return INSTANCE_CORES[self.instance_type]

    @property
    def visible_cores(self) -> str:
        """``NEURON_RT_VISIBLE_CORES``: the cores this engine takes."""
        first, last = self.neuron_core_start, self.neuron_core_start + self.tensor_parallel_size - 1
        return str(first) if first == last else f"{first}-{last}"

    def validate(self) -> NeuronVllmConfig:
        """Raise :class:`ConfigError` naming the setting, its value and the fix; else ``self``."""
        if self.instance_type not in INSTANCE_CORES:
            raise ConfigError(
                f"instance type {self.instance_type!r} is not one the lab knows; use one of "
                f"{', '.join(INSTANCE_CORES)}"
            )
        tp, cores = self.tensor_parallel_size, self.cores
        fits = [d for d in range(1, cores + 1) if cores % d == 0]
        if tp not in fits:
            raise ConfigError(
                f"tensor_parallel_size {tp} does not divide the {cores} NeuronCores of "
                f"{self.instance_type}; use one of {fits}, or a larger instance type"
            )
        if not 0 <= self.neuron_core_start <= cores - tp:
            raise ConfigError(
                f"neuron_core_start {self.neuron_core_start} with tensor_parallel_size {tp} runs "
                f"past the {cores} cores of {self.instance_type} (0-{cores - 1}); start at "
                f"0..{cores - tp}"
            )
        if self.attention_heads and self.attention_heads % tp:
            fitting = [d for d in fits if self.attention_heads % d == 0]
            raise ConfigError(
                f"tensor_parallel_size {tp} does not divide the model's {self.attention_heads} "
                f"attention heads; use one of {fitting}"
            )
        for name in ("max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        self._check_block_size()
        self._check_overrides()
        return self

    def _check_block_size(self) -> None:
        block = self.block_size
        if block is None or block == self.max_model_len:
            return
        if block < 1 or self.max_model_len % block:
            raise ConfigError(
                f"block_size {block} must divide max_model_len {self.max_model_len}; leave it "
                "unset for one block per sequence"
            )
        if not self.override_neuron_config.get("is_block_kv_layout"):
            raise ConfigError(
                f"block_size {block} below max_model_len {self.max_model_len} needs NxD "
                "Inference's paged KV layout: add override_neuron_config={'is_block_kv_layout': "
                "True}, or leave block_size unset (one contiguous block per sequence)"
            )

    def _check_overrides(self) -> None:
        for key, engine_arg in RESTATED.items():
            if key in self.override_neuron_config:
                given, wanted = self.override_neuron_config[key], getattr(self, engine_arg)
                if given != wanted:
                    raise ConfigError(
                        f"override_neuron_config {key}={given!r} disagrees with {engine_arg}="
                        f"{wanted}; drop {key} (vLLM passes {engine_arg} on) or make them equal"
                    )
        try:
            json.dumps(dict(self.override_neuron_config))
        except TypeError as exc:
            raise ConfigError(f"override_neuron_config must hold JSON values: {exc}") from None

    def engine_args(self) -> dict:
        """``AsyncEngineArgs`` keyword arguments (checked against :data:`ENGINE_ARGS`)."""
        self.validate()
        args = {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size or self.max_model_len,
            "dtype": self.dtype,
        }
        if self.override_neuron_config:
            args["additional_config"] = {
                "override_neuron_config": dict(self.override_neuron_config)
            }
        return check_engine_args(args)

    def environment(self) -> dict[str, str]:
        """The variables the engine's process needs before vLLM is imported."""
        env = {
            "NEURON_RT_VISIBLE_CORES": self.visible_cores,
            "VLLM_PLUGINS": "neuron",
            "VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference",
        }
        if self.compiled_artifacts:
            env["NEURON_COMPILED_ARTIFACTS"] = self.compiled_artifacts
        return env


def base_vllm_config(name: str, model: str) -> mc.ModelConfig:
    """A stand-in for ``model_repository/smollm2_vllm``'s config where it is not in the checkout:
    text in, text out, decoupled (vLLM streams), engine arguments as lower-case parameters."""
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[1])
    config.model_transaction_policy.decoupled = True
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_MODEL, count=1)
    params = {
        MODEL_SOURCE: model,
        "max_model_len": "2048",
        "max_num_seqs": "4",
        "gpu_memory_utilization": "0.5",
        "dtype": "auto",
        "EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/../../.venv-vllm",
    }
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def neuron_vllm_config(base: mc.ModelConfig, cfg: NeuronVllmConfig) -> mc.ModelConfig:
    """``base`` (the lab's vLLM model, on the CPU) with its engine arguments replaced by ``cfg``'s.

    Inputs, outputs, the transaction policy and the model's own settings (sampling, the weights'
    source :data:`MODEL_SOURCE`) stay; parameters that name an engine argument (any case), a CPU
    backend setting (:data:`CPU_ONLY`) or a Neuron variable go, and ``cfg``'s come in: engine
    arguments lower-case (a dict as JSON), environment variables upper-case,
    ``EXECUTION_ENV_PATH`` the Neuron venv. One instance: the engine owns its NeuronCores.
    """
    args, env = cfg.engine_args(), cfg.environment()
    config = copy.deepcopy(base)
    if MODEL_SOURCE in config.parameters:
        del args["model"]  # the base names its weights; the Neuron engine loads the same
    for key in list(config.parameters):
        engine = key.lower() in ENGINE_ARGS and key != MODEL_SOURCE
        if engine or key in CPU_ONLY or key.upper() in env or key == "EXECUTION_ENV_PATH":
            del config.parameters[key]
    for key, value in args.items():
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        config.parameters[key].string_value = text
    for key, value in {**env, "EXECUTION_ENV_PATH": cfg.execution_env_path}.items():
        config.parameters[key].string_value = value
    del config.instance_group[:]
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_MODEL, count=1)
    return config


@dataclass
class NeuronVllmModel:
    """What :func:`write_neuron_vllm_model` wrote, and how it differs from the base."""

    path: Path  # the Python-backend model folder (config.pbtxt, and model.py when the base has one)
    vllm_backend_path: Path  # Triton's backend: "vllm" twin (config.pbtxt + 1/model.json)
    setup_script: Path
    engine_args: dict
    environment: dict[str, str]
    diff: str  # against the base config
    base_source: str  # where the base came from
    checks: list[str]  # what was validated offline
    changes: pd.DataFrame  # every setting that differs from the base, and why (config_changes)


def write_neuron_vllm_model(
    out_dir: str | os.PathLike,
    cfg: NeuronVllmConfig,
    *,
    name: str = "smollm2_vllm",
    base_dir: str | os.PathLike | None = None,
) -> NeuronVllmModel:
    """Write the Neuron model folder, its vllm-backend twin and the plugin's setup script.

    ``base_dir`` is the lab's vLLM model folder (``model_repository/smollm2_vllm``, the model
    notebook 06 serves on the CPU); without it, or when
    it has no config yet, :func:`base_vllm_config` stands in. Each config is read back through
    Triton's ``ModelConfig`` protobuf and validated before the call returns.
    """
    out_dir = Path(out_dir)
    base_config = Path(base_dir) / "config.pbtxt" if base_dir else None
    if base_config and base_config.is_file():
        base, source = read_config(base_config), str(base_config)
    else:
        base, source = base_vllm_config(name, cfg.model), "labkit's stand-in (no smollm2_vllm here)"
    neuron = neuron_vllm_config(base, cfg)
    text = config_to_text(neuron)
    validate(parse_config(text), name=name)
    model_dir = out_dir / "neuron" / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text, encoding="utf-8")
    base_version = Path(base_dir) / "1" if base_dir else None
    if base_version and (base_version / "model.py").is_file():
        # the whole version folder: model.py imports its engine, settings and the shared reader
        # (links in the checkout, copied as files so that the folder travels to the host alone)
        shutil.copytree(
            base_version,
            model_dir / "1",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    twin = write_vllm_backend_model(out_dir / "neuron_vllm_backend" / name, cfg.engine_args())
    script = out_dir / SETUP_TEMPLATE.name
    shutil.copy2(SETUP_TEMPLATE, script)
    script.chmod(0o755)
    split = cfg.tensor_parallel_size
    checks = [  # in a learner's words: they are printed as they are
        f"the model split over {split} NeuronCore{'s' if split > 1 else ''} fits the "
        f"{cfg.cores} of an {cfg.instance_type} (this engine takes core"
        f"{'s' if split > 1 else ''} {cfg.visible_cores})",
        f"each of its {len(cfg.engine_args())} engine arguments is one that vLLM's engine takes",
        f"{name}/config.pbtxt is a valid Triton model configuration",
        f"its twin for Triton's own vLLM backend (config.pbtxt and model.json, "
        f"{len(cfg.engine_args())} engine arguments) is valid too",
    ]
    return NeuronVllmModel(
        path=model_dir,
        vllm_backend_path=twin,
        setup_script=script,
        engine_args=cfg.engine_args(),
        environment=cfg.environment(),
        diff=diff_configs(base, neuron, name),
        base_source=source,
        checks=checks,
        changes=config_changes(base, neuron),
    )


#: Why a setting of the lab's vLLM model (on the CPU) changes on inf2/trn1, in a learner's words.
WHY = {
    "instances": "one instance: the engine owns its NeuronCores",
    "EXECUTION_ENV_PATH": "the model's Python: a venv with vLLM and the Neuron plugin, which the "
    "setup script below makes",
    "NEURON_COMPILED_ARTIFACTS": "where the graphs compiled for the NeuronCores are kept, and "
    "reused at the next start",
    "NEURON_RT_VISIBLE_CORES": "the NeuronCores this engine takes",
    "VLLM_PLUGINS": "loads vLLM's Neuron plugin, which picks the platform",
    "VLLM_NEURON_FRAMEWORK": "the plugin runs the model on NxD Inference",
    "block_size": "the KV cache in one block of max_model_len per sequence: NxD Inference's "
    "contiguous layout",
    "dtype": "NeuronCores compute in bfloat16 at full speed; the CPU model keeps float32",
    "enforce_eager": "a CPU and GPU setting (whether vLLM compiles the model as it starts); on "
    "Neuron the graphs are always compiled, ahead of time",
    "kv_cache_gib": "a setting of vLLM's CPU backend (its KV cache in host memory); on inf2 the "
    "cache lives on the device",
    "omp_threads_bind": "a setting of vLLM's CPU backend (which cores its threads use); no host "
    "thread runs the model on inf2",
    "max_num_batched_tokens": "the CPU scheduler's token budget per step, left to vLLM's default: "
    "the compiled shapes bound each step on Neuron",
    "max_model_len": "prompt plus answer, in tokens: compiled into the graphs",
    "max_num_seqs": "sequences decoded together: the batch the graphs are compiled for",
    "tensor_parallel_size": "NeuronCores the model is split over",
    "gpu_memory_utilization": "a GPU setting",
}


def config_changes(base: mc.ModelConfig, neuron: mc.ModelConfig) -> pd.DataFrame:
    """Every setting that differs between ``base`` (the lab's vLLM model on the CPU) and its
    Neuron config: the instances and each parameter, "(unset)" where one lacks it, and why it
    changes (:data:`WHY`); a learner reads this where a config diff would take 100 lines."""

    def instances(config: mc.ModelConfig) -> str:
        return (
            ", ".join(
                f"{g.count} ({mc.ModelInstanceGroup.Kind.Name(g.kind).removeprefix('KIND_').lower()})"
                for g in config.instance_group
            )
            or "Triton's default (1)"
        )

    rows = []
    if instances(base) != instances(neuron):
        rows.append(("instances", instances(base), instances(neuron)))
    for key in sorted(set(base.parameters) | set(neuron.parameters), key=str.lower):
        before = base.parameters[key].string_value if key in base.parameters else "(unset)"
        after = neuron.parameters[key].string_value if key in neuron.parameters else "(unset)"
        if before != after:
            rows.append((key, before, after))
    return pd.DataFrame(
        [{"setting": k, "on the CPU": b, "on inf2": a, "why": WHY.get(k, "")} for k, b, a in rows]
    )


def setup_command(model: NeuronVllmModel, cfg: NeuronVllmConfig) -> list[str]:
    """The setup script's command line for this model's venv, run on the inf2/trn1 host from the
    folder that holds the copied script (this machine's path to it names nothing there)."""
    return [
        f"./{model.setup_script.name}",
        "--venv",
        cfg.execution_env_path,
        "--plugin-ref",
        PLUGIN_REF,
    ]
