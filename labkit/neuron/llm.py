"""A causal LM on inf2/trn1, served with the same ``text_input`` / ``text_output`` contract as the GPU model.

Built on optimum-neuron's ``NeuronModelForCausalLM`` rather than transformers-neuronx's per-model
``*ForSampling`` classes (the upstream guide's choice), because:

- one class and Hugging Face's own ``generate()`` serve every supported architecture (Llama,
  Mistral, OPT, GPT-2, ...), where transformers-neuronx needs a different import and a
  ``sample()`` call per model family;
- it exports with the four settings this model exposes (``num_cores`` = tensor-parallel degree,
  ``batch_size``, ``sequence_length``, ``auto_cast_type`` = precision) and saves the compiled
  artifacts with the tokenizer, so the server loads without recompiling;
- transformers-neuronx is superseded by NxD Inference in the Neuron SDK, which optimum-neuron
  tracks for us.

The settings live in ``config.pbtxt`` parameters; ``templates/neuron/llm_model.py`` reads them.
This module writes and validates them (tested everywhere); the model itself runs on Neuron hosts.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from labkit.errors import ConfigError, MissingDependencyError

TEMPLATE = Path(__file__).parent.parent / "templates" / "neuron" / "llm_model.py"
PRECISIONS = ("bf16", "fp16", "fp32")
#: Tensor-parallel degrees a model can be sharded over (NeuronCores of one instance).
TP_DEGREES = (1, 2, 4, 8, 12, 16, 24, 32, 64)


@dataclass(frozen=True)
class NeuronLLMConfig:
    """What the served LLM is and how it was (or is to be) compiled."""

    model: str  # Hugging Face id or local checkpoint: the tokenizer, and the source to export
    compiled_model: str | None = None  # a saved NeuronModelForCausalLM folder; None: export at load
    tp_degree: int = 2  # NeuronCores the model is sharded over (2 = one inf2.xlarge chip)
    batch_size: int = 4  # compiled batch: requests are run in groups of this many
    sequence_length: int = 2048  # prompt + generated tokens, compiled in
    precision: str = "bf16"
    max_new_tokens: int = 128  # default per request; a request may ask for fewer
    neuron_core_start: int = 0
    max_queue_delay_microseconds: int = 20000

    def validate(self) -> NeuronLLMConfig:
        if not self.model:
            raise ConfigError("model is empty; give a Hugging Face id or a checkpoint folder")
        if self.tp_degree not in TP_DEGREES:
            raise ConfigError(
                f"tp_degree {self.tp_degree} is not one of {TP_DEGREES}; use the number of "
                "NeuronCores to shard over (2 per inf2 chip: inf2.xlarge 2, inf2.48xlarge 24)"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for name in ("batch_size", "sequence_length", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens >= self.sequence_length:
            raise ConfigError(
                f"max_new_tokens {self.max_new_tokens} leaves no room for the prompt in "
                f"sequence_length {self.sequence_length}; lower it or compile a longer sequence"
            )
        if self.neuron_core_start < 0 or self.max_queue_delay_microseconds < 0:
            raise ConfigError("neuron_core_start and max_queue_delay_microseconds must be >= 0")
        return self

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt parameters (upper-case names), every value a string."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k.upper(): "" if v is None else str(v) for k, v in values.items()}

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> NeuronLLMConfig:
        """The inverse of :meth:`parameters`; missing keys take the defaults."""
        kwargs: dict = {}
        for f in fields(cls):
            raw = params.get(f.name.upper())
            if raw is None:
                continue
            if f.type == "int":
                try:
                    kwargs[f.name] = int(raw)
                except ValueError:
                    raise ConfigError(
                        f"parameter {f.name.upper()} must be an integer, got {raw!r}"
                    ) from None
            else:
                kwargs[f.name] = raw or None if f.type == "str | None" else raw
        return cls(**kwargs).validate()

    @property
    def visible_cores(self) -> str:
        last = self.neuron_core_start + self.tp_degree - 1
        return str(last) if last == self.neuron_core_start else f"{self.neuron_core_start}-{last}"


def build_llm_config(name: str, cfg: NeuronLLMConfig) -> mc.ModelConfig:
    """One instance (it owns ``tp_degree`` cores), dynamic batching up to the compiled batch."""
    cfg.validate()
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=cfg.batch_size)
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
    config.input.add(name="max_new_tokens", data_type=mc.TYPE_INT32, dims=[1], optional=True)
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_MODEL, count=1)
    config.dynamic_batching.max_queue_delay_microseconds = cfg.max_queue_delay_microseconds
    for key, value in cfg.parameters().items():
        config.parameters[key].string_value = value
    return config


def generate_llm_model(
    model_dir: str | os.PathLike, cfg: NeuronLLMConfig, version: int = 1
) -> Path:
    """Write ``config.pbtxt`` and ``<version>/model.py`` for the LLM; returns the model folder."""
    model_dir = Path(model_dir)
    config = build_llm_config(model_dir.resolve().name, cfg)
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    shutil.copy2(TEMPLATE, model_dir / str(version) / "model.py")
    return model_dir


def export_llm(cfg: NeuronLLMConfig, output_dir: str | os.PathLike) -> Path:
    """Compile ``cfg.model`` with optimum-neuron and save it (with its tokenizer) to ``output_dir``.

    Runs on an inf2/trn1 host (or any host with neuronx-cc, for compile-only). Set
    ``compiled_model`` to the returned folder so the server loads without compiling.
    """
    cfg.validate()
    try:
        from optimum.neuron import NeuronModelForCausalLM  # noqa: PLC0415 (Neuron hosts only)
        from transformers import AutoTokenizer  # noqa: PLC0415 (a model library: importing labkit loads none)
    except ImportError as exc:
        raise MissingDependencyError(
            "exporting for Neuron needs optimum-neuron (pip install 'optimum-neuron[neuronx]' from "
            "the Neuron pip repository); run scripts/setup-neuron-host.sh on the inf2 host"
        ) from exc
    model = NeuronModelForCausalLM.from_pretrained(
        cfg.model,
        export=True,
        batch_size=cfg.batch_size,
        sequence_length=cfg.sequence_length,
        num_cores=cfg.tp_degree,
        auto_cast_type=cfg.precision,
    )
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(cfg.model).save_pretrained(output_dir)
    return output_dir
