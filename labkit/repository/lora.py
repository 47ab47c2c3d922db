"""LoRA adapters for the lab's offline SmolLM2, made offline with peft, and served by name.

A LoRA adapter adds ``scale * B @ A`` (rank ``r``) to some weight matrices of a model; vLLM serves
many adapters over one copy of the base weights, and a request picks one by name. The hub has
none here, so the lab makes one: :func:`make_adapter` wraps a model with peft (``LoraConfig``:
rank 8, ``q_proj`` and ``v_proj``), fills ``A`` and ``B`` with seeded random values (peft starts
``B`` at zero, an adapter that changes nothing) sized so that each update is a fixed share of the
weights it changes (:attr:`AdapterSpec.strength`: greedy answers change, and stay text), and saves
it in peft's format (``adapter_config.json``, ``adapter_model.safetensors``). It is built once
into the cache (``cache_dir()/adapters``), as the offline weights are (:func:`build_adapter`).

:func:`serve_adapters` makes a vLLM model of a repository (a run's copy) serve adapters: it
builds them, links each into the model's folder (``adapters/<name>``, beside ``weights``) and
names them in the config's ``lora_adapters`` parameter, which the model reads
(``model_repository/smollm2_vllm/1/vllm_settings.py``). The shipped config names none: LoRA is
off, and the model starts and runs as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .folder import Repository
from .models import Builder, build_once, build_weights

log = logging.getLogger(__name__)

#: The config parameter that names the adapters a vLLM model serves: ``{"name": "folder"}``.
ADAPTERS_PARAMETER = "lora_adapters"
#: Where :func:`serve_adapters` links each adapter, inside the model's folder (gitignored).
ADAPTERS_FOLDER = "adapters"


@dataclass(frozen=True)
class AdapterSpec:
    """How one adapter is made: peft's settings and the seed of its values."""

    rank: int = 8  # peft's r
    alpha: int = 16  # peft's lora_alpha: the update is scaled by alpha / rank
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    seed: int = 0
    # Each target's update (alpha / rank * B @ A) has this share of the standard deviation of
    # the weights it changes.
    strength: float = 0.1


#: The lab's adapter for SmolLM2 (builder ``smollm2-lora``).
SMOLLM2_ADAPTER = AdapterSpec()


def make_adapter(model, target: str | os.PathLike, spec: AdapterSpec = SMOLLM2_ADAPTER) -> Path:
    """Save a seeded LoRA adapter for ``model`` (a transformers model, changed in place by peft)
    into ``target`` in peft's format; return ``target``."""
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (a model library, as torch)

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,  # the values are set below, from the seed
    )
    with _transformers_5_with_peft():
        wrapped = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(spec.seed)
    scale = spec.alpha / spec.rank
    layers = [(n, m) for n, m in wrapped.named_modules() if hasattr(m, "lora_A")]
    if not layers:
        raise ConfigError(f"{type(model).__name__} has none of the LoRA targets {spec.targets}")
    with torch.no_grad():
        for _, layer in sorted(layers, key=lambda item: item[0]):
            a = layer.lora_A["default"].weight  # (rank, in)
            b = layer.lora_B["default"].weight  # (out, rank)
            inputs = a.shape[1]
            a.copy_(torch.randn(a.shape, generator=generator) / inputs**0.5)
            # std(B @ A) = std(B) * sqrt(rank / inputs): B's std gives the update its strength
            wanted = spec.strength * float(layer.base_layer.weight.std())
            spread = wanted / scale * (inputs / spec.rank) ** 0.5
            b.copy_(torch.randn(b.shape, generator=generator) * spread)
    wrapped.save_pretrained(target)
    return Path(target)


def merge_adapter(model, adapter: str | os.PathLike):
    """``model`` with the adapter in folder ``adapter`` merged into its weights (peft's
    ``merge_and_unload``): a plain transformers model whose answers are the adapter's."""
    from peft import PeftModel  # noqa: PLC0415 (a model library: importing labkit loads none)

    with _transformers_5_with_peft():
        return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@contextlib.contextmanager
def _transformers_5_with_peft() -> Iterator[None]:
    """peft 0.21 asks every model ``is_gradient_checkpointing``, which transformers 5 deprecates
    with a FutureWarning (an error under the lab's tests); that one warning is left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def build_smollm2_adapter(target: Path) -> None:
    """The ``smollm2-lora`` builder: :data:`SMOLLM2_ADAPTER` for the lab's SmolLM2 checkpoint."""
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (a model library, as torch)

    base = build_weights("smollm2")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    make_adapter(model, target, SMOLLM2_ADAPTER)


#: The adapters the lab can build, by name: each is built once (:func:`build_adapter`).
ADAPTER_BUILDERS: dict[str, Builder] = {
    "smollm2-lora": Builder(
        "smollm2-lora",
        "smollm2-lora-demo-v1",
        build_smollm2_adapter,
        "a seeded LoRA adapter for SmolLM2 (peft, rank 8, q_proj and v_proj)",
    ),
}


def build_adapter(name: str) -> Path:
    """The folder of adapter builder ``name``'s adapter, built first if needed (once)."""
    if name not in ADAPTER_BUILDERS:
        raise ConfigError(
            f"unknown LoRA adapter builder {name!r}; use one of {', '.join(ADAPTER_BUILDERS)}"
        )
    return build_once(ADAPTER_BUILDERS[name], "adapters")


def serve_adapters(
    repository: Repository | str | os.PathLike,
    model: str,
    adapters: Mapping[str, str] | None = None,
) -> dict[str, Path]:
    """Make ``model`` (a vLLM model of ``repository``) serve LoRA ``adapters``: request name ->
    builder (default ``{"demo": "smollm2-lora"}``). Each is built once (cache), linked at
    ``<model>/adapters/<name>`` and named in the config's ``lora_adapters``; return name ->
    folder. Meant for a run's copy (:func:`~labkit.repository.prepare_run_repository`): the
    model's start then loads each adapter once."""
    repo = repository if isinstance(repository, Repository) else Repository(repository)
    if model not in repo.models():
        raise ConfigError(f"{repo.path} holds no model {model!r}; pick one of {repo.models()}")
    adapters = dict(adapters or {"demo": "smollm2-lora"})
    config = repo.config(model)
    named = {}
    if ADAPTERS_PARAMETER in config.parameters:
        named = json.loads(config.parameters[ADAPTERS_PARAMETER].string_value or "{}")
    built = {}
    for name, builder in adapters.items():
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"adapter name {name!r} must be a plain name such as 'demo'")
        folder = build_adapter(builder)
        link = repo.model_dir(model) / ADAPTERS_FOLDER / name
        link.parent.mkdir(exist_ok=True)
        if link.is_symlink() and link.resolve() != folder.resolve():
            link.unlink()  # a link to another build
        if link.exists() and not link.is_symlink():
            log.warning("%s is a real folder; serving it as adapter %r", link, name)
        elif not link.is_symlink():
            link.symlink_to(folder, target_is_directory=True)
        named[name] = f"{ADAPTERS_FOLDER}/{name}"
        built[name] = folder
    config.parameters[ADAPTERS_PARAMETER].string_value = json.dumps(named)
    repo.write_config(model, config)
    log.info("%s serves the LoRA adapter(s) %s", model, ", ".join(named))
    return built
