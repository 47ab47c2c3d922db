"""Triton's OpenAI-compatible frontend, as NGC's tritonserver images ship it (docker mode only).

The frontend lives in Triton's server repository under ``python/openai``; NGC images copy it to
``/opt/tritonserver/python/openai`` and install its requirements (FastAPI, uvicorn, openai) and
Triton's ``tritonserver`` and ``tritonfrontend`` wheels. Its ``openai_frontend/main.py`` imports
``tritonserver`` and starts Triton *inside its own Python process* (``tritonserver.Server``), then
serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/metrics`` and
``/health/ready`` with uvicorn on ``--openai-port`` (default 9000). With
``--enable-kserve-frontends`` it also opens Triton's KServe HTTP and gRPC endpoints
(``tritonfrontend``) on ``--kserve-http-port`` and ``--kserve-grpc-port``: the lab starts them, so
its readiness checks and clients work unchanged beside the OpenAI API.

Which models it can drive: with ``--backend vllm`` every request it makes carries the tensors of
:data:`FRONTEND_INPUTS` (``engine/utils/triton.py``, ``_create_vllm_generate_request``), and a
model that does not declare one of them fails every request. The lab's vLLM model declares
``backend: "python"``, so the backend is named on the command line (without it the frontend falls
back to TensorRT-LLM's tensors). It shares one tokenizer, loaded with ``AutoTokenizer``, between
all the models it serves (``--tokenizer``), used for chat templates.

The local mode cannot run it: the Triton 2.51 bundled in the ``nvidia-pytriton`` wheel ships the
``tritonserver`` executable only, not the ``tritonserver`` Python package the frontend embeds
(``import tritonserver`` fails in the lab's environment), nor the frontend's own source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError, ServerError
from labkit.repository import Repository

#: Where NGC images keep the frontend's entry point (``cd /opt/tritonserver/python/openai`` in its
#: README); it imports its siblings (``engine``, ``frontend``) from its own folder.
FRONTEND_MAIN = "/opt/tritonserver/python/openai/openai_frontend/main.py"
#: The frontend's own default for ``--openai-port``.
DEFAULT_OPENAI_PORT = 9000
#: The tensors the frontend sends with every vLLM-format request.
FRONTEND_INPUTS = (
    "text_input",
    "stream",
    "sampling_parameters",
    "exclude_input_in_output",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_logprobs",
)
FRONTEND_OUTPUT = "text_output"

LOCAL_MODE_REFUSAL = (
    "Triton's OpenAI frontend cannot run in the local mode: its main.py "
    "(/opt/tritonserver/python/openai in NGC images) embeds Triton in its own Python process "
    "through the 'tritonserver' Python package, and the Triton 2.51 bundled in the "
    "nvidia-pytriton wheel has only the tritonserver executable (no such package, and not the "
    "frontend's source). Use the docker mode on a host with Docker and the NVIDIA Container "
    "Toolkit (labkit serve --mode docker --openai, or mode='docker'), or run the frontend inside "
    "an NGC tritonserver image; here, labkit serve without --openai serves the same models over "
    "KServe HTTP/gRPC"
)


@dataclass(frozen=True)
class OpenAIFrontend:
    """What the frontend serves: ``models`` (each takes its tensors) and the tokenizer of the
    first of them: ``tokenizer_folder``, a folder relative to the model repository (the lab's
    ``<model>/weights`` link), or else ``tokenizer_id``, a Hugging Face id."""

    models: tuple[str, ...]
    tokenizer_folder: str | None = None
    tokenizer_id: str | None = None

    def tokenizer(self, repository: str) -> str:
        """The ``--tokenizer`` value when the model repository is at ``repository``."""
        if self.tokenizer_folder is not None:
            return f"{repository.rstrip('/')}/{self.tokenizer_folder}"
        return str(self.tokenizer_id)

    def command(
        self,
        repository: str,
        *,
        host: str,
        openai_port: int,
        kserve_http_port: int,
        kserve_grpc_port: int,
    ) -> list[str]:
        """``python3 main.py ...`` serving ``repository`` (a path inside the container)."""
        return [
            "python3",
            FRONTEND_MAIN,
            f"--model-repository={repository}",
            "--model-control-mode=explicit",
            *[f"--load-model={name}" for name in self.models],
            f"--tokenizer={self.tokenizer(repository)}",
            "--backend=vllm",
            f"--host={host}",
            f"--openai-port={openai_port}",
            "--enable-kserve-frontends",
            f"--kserve-http-port={kserve_http_port}",
            f"--kserve-grpc-port={kserve_grpc_port}",
        ]


def check_port(port: object, what: str = "openai_port") -> int:
    """``port`` as an int in 0..65535 (0: a free one is picked), or :class:`ServerError`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServerError(
            f"{what}={port!r} is not a TCP port; give 1..65535 (the frontend's default is "
            f"{DEFAULT_OPENAI_PORT}) or 0 to pick a free one"
        )
    return port


def frontend_models(repository: str | os.PathLike, load_models: list[str]) -> list[str]:
    """The models of ``load_models`` (``"*"``: every model of ``repository``) that declare every
    tensor the frontend sends and the ``text_output`` it reads, in the order given."""
    repo = Repository(repository)
    present = repo.models()  # one listing of the repository, not one per name
    names = present if "*" in load_models else load_models
    return [name for name in names if name in present and _speaks_frontend(repo, name)]


def plan_frontend(
    repository: str | os.PathLike, load_models: list[str], *, mode: str
) -> OpenAIFrontend:
    """The frontend serving ``load_models`` of ``repository``, refused with the reason when the
    mode cannot run it, no model is one it can drive, a model is one it cannot, or the models
    need different tokenizers (the frontend loads one)."""
    if mode == "local":
        raise ServerError(LOCAL_MODE_REFUSAL)
    if mode != "docker":
        raise ServerError(
            f"the OpenAI frontend is started by the docker mode only, not the {mode} mode; a "
            "remote server's frontend, if it runs one, is reached at its own /v1 address"
        )
    repo = Repository(repository)
    capable = frontend_models(repository, ["*"])
    wanted = repo.models() if "*" in load_models else list(load_models)
    drivable = [name for name in wanted if name in capable]
    others = [name for name in wanted if name not in capable]
    speaks = f"inputs {', '.join(FRONTEND_INPUTS)} and the output {FRONTEND_OUTPUT}"
    if not drivable:
        offer = (
            f"load one that does: {', '.join(capable)} (--load-model {capable[0]})"
            if capable
            else f"{Path(repository)} has none"
        )
        raise ConfigError(
            f"the OpenAI frontend serves language models that take its tensors ({speaks}); "
            f"none of {', '.join(wanted) or 'no models'} does; {offer}"
        )
    if "*" not in load_models and others:
        raise ConfigError(
            f"the OpenAI frontend would list {', '.join(others)} at /v1/models and fail every "
            f"request to them: they lack its tensors ({speaks}); load only "
            f"{', '.join(drivable)}"
        )
    tokenizers = {name: _tokenizer(repo, name) for name in drivable}
    if len({_tokenizer_identity(repo, *t) for t in tokenizers.values()}) > 1:
        shown = {name: folder or hub_id for name, (folder, hub_id) in tokenizers.items()}
        raise ConfigError(
            "the OpenAI frontend loads one tokenizer for every model it serves, and these name "
            f"different ones: {shown}; load one of them"
        )
    folder, hub_id = tokenizers[drivable[0]]
    return OpenAIFrontend(models=tuple(drivable), tokenizer_folder=folder, tokenizer_id=hub_id)


def _speaks_frontend(repo: Repository, name: str) -> bool:
    config = repo.config(name)
    inputs = {tensor.name for tensor in config.input}
    outputs = {tensor.name for tensor in config.output}
    return set(FRONTEND_INPUTS) <= inputs and FRONTEND_OUTPUT in outputs


def _tokenizer(repo: Repository, name: str) -> tuple[str | None, str | None]:
    """(folder relative to the repository, None) or (None, Hugging Face id): the model's
    ``huggingface_model`` parameter. It is a folder inside the model's folder when the config
    also names ``labkit_weights`` (the lab links its offline weights there, see
    :func:`~labkit.repository.prepare_repository`) or when that folder exists; else a Hub id."""
    parameters = repo.config(name).parameters
    if "huggingface_model" not in parameters:
        raise ConfigError(
            f"model {name!r} names no huggingface_model parameter, so the OpenAI frontend has no "
            "tokenizer for its chat template; add one (a folder inside the model's folder, such "
            "as 'weights', or a Hugging Face id)"
        )
    value = parameters["huggingface_model"].string_value
    if Path(value).is_absolute() or ".." in Path(value).parts:
        raise ConfigError(
            f"model {name!r}: huggingface_model {value!r} is outside the model folder, which is "
            "all the container sees of it; use a folder inside it, such as 'weights'"
        )
    inside = repo.model_dir(name) / value
    if "labkit_weights" in parameters or inside.exists():
        return f"{name}/{value}", None
    return None, value


def _tokenizer_identity(repo: Repository, folder: str | None, hub_id: str | None) -> str:
    """Two models share a tokenizer when their folders resolve to the same weights."""
    if folder is None:
        return str(hub_id)
    return str((repo.path / folder).resolve())
