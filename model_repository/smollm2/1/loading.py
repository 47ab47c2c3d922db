"""Where the weights come from and how they are loaded: a folder or a Hugging Face Hub id.

The hub token comes from ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN`` or ``PRIVATE_REPO_TOKEN`` (the
tutorial's name), in that order; it is never logged. Downloads are cached under ``HF_HOME``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .protocol import ConfigError, Options

TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "PRIVATE_REPO_TOKEN")


@dataclass(frozen=True)
class Loaded:
    """A model ready to generate, and what serving it needs to know."""

    tokenizer: object  # pads on the left: batched generation with a decoder-only model needs it
    model: object  # in eval mode on ``device``
    source: str  # what from_pretrained was given: a folder or a hub id
    device: torch.device
    dtype: torch.dtype
    eos_ids: set[int]  # the tokens that end an answer
    context: int | None  # the most tokens a prompt and its answer may have, if the model says


def load(options: Options, args: dict) -> Loaded:
    """The tokenizer and model that config.pbtxt names, on the device Triton gave the instance."""
    source, local = resolve_source(options.huggingface_model, Path(args["model_repository"]))
    token = None if local else require_token(source, options.gated, os.environ)
    device = choose_device(args)
    dtype = choose_dtype(options.dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, token=token, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(source, token=token, dtype=dtype)
    except OSError as exc:
        raise RuntimeError(explain_load_error(source, exc, os.environ)) from None
    model.to(device).eval()
    tokenizer.padding_side = "left"  # some tokenizers ignore the argument
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Loaded(
        tokenizer=tokenizer,
        model=model,
        source=source,
        device=device,
        dtype=dtype,
        eos_ids=end_of_sequence_ids(model, tokenizer),
        context=context_length(model, tokenizer),
    )


def choose_device(args: dict) -> torch.device:
    """The instance's GPU when Triton gave it one and CUDA works, else the CPU."""
    if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
        return torch.device(f"cuda:{int(args.get('model_instance_device_id', 0))}")
    return torch.device("cpu")


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise ConfigError(
        f"parameter 'dtype' {name!r} is not a torch dtype; use auto, float32, float16 or bfloat16"
    )


def end_of_sequence_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def context_length(model, tokenizer) -> int | None:
    """The longest sequence the model accepts (prompt plus new tokens), if it says."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


# -- the source and its token -------------------------------------------------------------------
class TokenError(RuntimeError):
    """A gated model was asked for without a hub token."""


def resolve_source(value: str, model_dir: Path) -> tuple[str, bool]:
    """``(what to pass to from_pretrained, is_local)`` for the ``huggingface_model`` parameter:
    a hub id, an absolute path, or a path relative to the model's folder (``weights``)."""
    value = value.strip()
    if not value:
        raise ConfigError("parameter 'huggingface_model' is empty; name a hub id or a folder")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = model_dir / path
    if path.exists():
        return str(path.resolve()), True
    if value.startswith(("/", ".", "~")) or value.count("/") > 1:
        raise ConfigError(
            f"huggingface_model {value!r}: folder {str(path)!r} does not exist; "
            "build it (labkit prepare) or fix the path"
        )
    return value, False


def hub_token(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(variable name, token)`` of the first token variable set, or ``(None, None)``."""
    for name in TOKEN_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None, None


def require_token(model_id: str, gated: bool, environ: Mapping[str, str]) -> str | None:
    """The token to use for ``model_id``; a gated model without one raises :class:`TokenError`."""
    _, token = hub_token(environ)
    if gated and token is None:
        raise TokenError(
            f"model {model_id!r} is gated on the Hugging Face Hub and needs an access token, but "
            "none of HF_TOKEN, HUGGING_FACE_HUB_TOKEN, PRIVATE_REPO_TOKEN is set in the server's "
            "environment; accept the model's license on huggingface.co, then export HF_TOKEN="
            "<your token> before starting the server"
        )
    return token


def explain_load_error(model_id: str, exc: BaseException, environ: Mapping[str, str]) -> str:
    """A message for a failed load that says what to do; never contains the token."""
    text = str(exc)
    name, token = hub_token(environ)
    if token:
        text = text.replace(token, "***")
    lowered = text.lower()
    if any(s in lowered for s in ("gated repo", "401", "403", "restricted", "access to model")):
        if name is None:
            hint = (
                "it looks gated or private and no token is set: export HF_TOKEN=<your token> "
                "(or PRIVATE_REPO_TOKEN) in the server's environment"
            )
        else:
            hint = (
                f"the token in {name} was refused: check that it is valid and that your "
                "account accepted the model's license on huggingface.co"
            )
        return f"cannot load {model_id!r}: {hint}. ({text})"
    return (
        f"cannot load {model_id!r}: it is neither a local folder nor reachable on the "
        f"Hugging Face Hub (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}). "
        f"({text})"
    )
