"""A Triton model repository on disk: list, check, edit, add, remove and copy its models.

A model's ``config.pbtxt`` goes through :mod:`labkit.repository.config` (Triton's own
``ModelConfig`` protobuf, validated, written atomically). Adding a model is one job with one
implementation, :meth:`Repository.add_from_template`: it writes the config and copies a template's
model code (``labkit/templates/<kind>/``, the same files as the served ``model_repository/``).
Live changes to a running server are :mod:`labkit.server.live`'s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ConfigError, MissingDependencyError, MissingFileError
from ..settings import project_root
from .config import (
    CONFIG_FILE,
    ModelConfig,
    apply_edits,
    change_summary,
    check_name,
    config_to_text,
    diff_configs,
    read_config,
    validate,
    write_config,
)
from .models import (
    CATALOG,
    CatalogEntry,
    catalog_entry,
    embedding_config,
    prepare_repository,
    textgen_config,
)

log = logging.getLogger(__name__)

TEMPLATES_DIR = Path(__file__).parent.parent / "templates"
# Folders and files that hold weights: a copy links to them instead of copying them.
WEIGHT_NAMES = ("weights", "hf_cache")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".neff", ".onnx", ".plan")


class Repository:
    """A folder of models: ``<name>/config.pbtxt`` and ``<name>/<version>/...``."""

    def __init__(self, path: str | os.PathLike, *, create: bool = False) -> None:
        self.path = Path(path).expanduser().resolve()
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        if not self.path.is_dir():
            raise MissingFileError(
                f"model repository {str(self.path)!r} does not exist; pass an existing folder "
                "(the lab's is model_repository/) or create=True"
            )

    def __repr__(self) -> str:
        return f"Repository({str(self.path)!r})"

    def __fspath__(self) -> str:  # a Repository goes wherever a folder's path does
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __truediv__(self, part: str | os.PathLike) -> Path:
        """``repo / "smollm2" / "config.pbtxt"``: a path inside the repository, as with a Path."""
        return self.path / part

    def models(self) -> list[str]:
        """The names of the model folders, sorted."""
        return sorted(
            p.name
            for p in self.path.iterdir()
            if p.is_dir() and not p.name.startswith(".") and p.name != "__pycache__"
        )

    def model_dir(self, name: str) -> Path:
        """The folder of an existing model (the name is checked before any file is touched)."""
        folder = self.path / check_name(name)
        if not folder.is_dir():
            known = ", ".join(self.models()) or "none"
            raise MissingFileError(
                f"unknown model {name!r} in {str(self.path)!r} (models: {known}); "
                "check the name or add the model first"
            )
        return folder

    def config_path(self, name: str) -> Path:
        return self.model_dir(name) / CONFIG_FILE

    def versions(self, name: str) -> list[int]:
        """The model's version numbers; a model with no version folder is an error."""
        folder = self.model_dir(name)
        found = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
        if not found:
            raise MissingFileError(
                f"model {name!r} has no version folder in {str(folder)!r}; Triton serves "
                f"{name}/<number>/ (create {name}/1/ with the model's files)"
            )
        return found

    def config(self, name: str) -> ModelConfig:
        """The model's configuration, as Triton's ``ModelConfig`` protobuf."""
        return read_config(self.config_path(name))

    def validate(self, cfg: ModelConfig, name: str | None = None) -> None:
        validate(cfg, name=name)

    def check(self, name: str) -> ModelConfig:
        """Check a model folder as Triton will load it; return its configuration."""
        cfg = self.config(name)
        validate(cfg, name=name)
        versions = self.versions(name)
        if cfg.backend == "python":
            filename = cfg.default_model_filename or "model.py"
            for v in versions:
                if not (self.model_dir(name) / str(v) / filename).is_file():
                    raise MissingFileError(
                        f"model {name!r} version {v} has no {filename}; the python backend "
                        f"loads {name}/{v}/{filename}"
                    )
        return cfg

    def write_config(self, name: str, cfg: ModelConfig) -> str:
        """Validate and write ``cfg`` as the model's configuration; return the diff."""
        path = self.config_path(name)
        old = read_config(path) if path.is_file() else ModelConfig()
        change = diff_configs(old, cfg, name)
        write_config(path, cfg)
        log.info("wrote %s", path)
        return change

    def edit(self, name: str, *, dry_run: bool = False, brief: bool = False, **changes) -> str:
        """Change fields of a model's configuration (see :func:`apply_edits`); return the diff,
        or with ``brief`` one line per changed setting (:func:`change_summary`).

        Nothing is written when the result is invalid, when nothing changes, or with ``dry_run``.
        """
        old = self.config(name)
        new = apply_edits(old, **changes)
        validate(new, name=name)
        change = (change_summary if brief else diff_configs)(old, new, name)
        if change and not dry_run:
            self.write_config(name, new)
        return change

    def remove(self, name: str) -> None:
        """Delete a model folder (links to weights are removed, never what they point at)."""
        folder = self.model_dir(name)
        if not (folder / CONFIG_FILE).is_file() and not any(
            p.name.isdigit() for p in folder.iterdir()
        ):
            raise ConfigError(f"{str(folder)!r} does not look like a model folder; not removing it")
        shutil.rmtree(folder)
        log.info("removed model %s", name)

    def new_model_dir(self, name: str) -> Path:
        """The folder for a model about to be added; a name already taken is an error."""
        folder = self.path / check_name(name)
        if folder.exists() or folder.is_symlink():
            raise ConfigError(
                f"a model named {name!r} already exists in {str(self.path)!r}; choose another "
                "name or remove it first"
            )
        return folder

    def add_twin(self, model: str, twin: str, cfg: ModelConfig) -> Path:
        """``twin``: a copy of ``model``'s folder (links, to weights or shared code, stay links)
        served with ``cfg``; a ``twin`` already there is replaced."""
        if twin in self.models():
            self.remove(twin)
        folder = self.new_model_dir(twin)
        shutil.copytree(self.model_dir(model), folder, symlinks=True)
        cfg.name = twin
        self.write_config(twin, cfg)
        return folder

    def add_from_template(
        self, name: str, template: str, cfg: ModelConfig, *, version: int = 1
    ) -> Path:
        """Write ``<name>/config.pbtxt`` and copy the template's model code to ``<name>/<version>/``.

        The template's files are copied as real files (a template may link to the served
        repository's copy), so the new folder works wherever it is moved.
        """
        source = TEMPLATES_DIR / template
        if not (source / "model.py").is_file():
            known = ", ".join(sorted(p.name for p in TEMPLATES_DIR.iterdir() if p.is_dir()))
            raise MissingFileError(f"no model template {template!r} (templates: {known})")
        folder = self.new_model_dir(name)
        cfg.name = name
        validate(cfg, name=name)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.path))
        try:
            (staging / str(version)).mkdir()
            for code in sorted(source.glob("*.py")):
                shutil.copyfile(code, staging / str(version) / code.name)
            (staging / CONFIG_FILE).write_text(config_to_text(cfg), encoding="utf-8")
            staging.chmod(0o755)
            staging.rename(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("added model %s (template %s) in %s", name, template, self.path)
        return folder

    def add(
        self, name: str, source: str, *, template: str | None = None, **parameters: str
    ) -> Path:
        """Add a model from the catalog (``labkit.repository.CATALOG``), a local model folder or a Hub id.

        A catalog name goes to :func:`add_model`. A folder or a Hub id is served with a
        template's model.py (``textgen`` or ``embedding``; for a folder it is guessed from its
        ``config.json``) and the source in the ``huggingface_model`` parameter.
        """
        check_name(name)
        if Path(source).expanduser().is_dir():
            return self.add_local(name, source, template=template, **parameters)
        if source in CATALOG:
            folder = add_model(self.path, source, name=name, **parameters)
            self.check(name)
            return folder
        if "/" not in source or source.startswith(("/", ".")):
            raise ConfigError(
                f"model source {source!r} is not a folder, a catalog name "
                f"({', '.join(sorted(CATALOG))}) or a Hub id (org/name)"
            )
        return self._add_source(name, source, template or "textgen", parameters)

    def add_local(
        self, name: str, path: str | os.PathLike, *, template: str | None = None, **parameters: str
    ) -> Path:
        """Serve the transformers model saved in ``path`` with a template's model.py."""
        folder = Path(path).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise MissingFileError(
                f"{str(folder)!r} holds no config.json; pass a folder saved with save_pretrained"
            )
        return self._add_source(name, str(folder), template or _guess_template(folder), parameters)

    def _add_source(self, name: str, source: str, template: str, parameters: dict) -> Path:
        if template == "embedding":
            cfg = embedding_config(name, huggingface_model=source)
        elif template == "textgen":
            entry = CatalogEntry(name, source, f"added from {source}", 0.0)
            cfg = textgen_config(entry, name)
        else:
            raise ConfigError(f"unknown template {template!r}; use 'textgen' or 'embedding'")
        cfg = apply_edits(cfg, parameters=parameters)
        return self.add_from_template(name, template, cfg)

    def copy_to(self, dest: str | os.PathLike) -> Repository:
        """Copy the repository to ``dest`` (a run folder): links stay links, weights are linked."""
        dest = Path(dest).expanduser().resolve()
        if dest.exists() and any(dest.iterdir()):
            raise ConfigError(f"cannot copy the repository into {str(dest)!r}: it is not empty")
        dest.mkdir(parents=True, exist_ok=True)
        _copy_tree(self.path, dest, self.path)
        return Repository(dest)


def _guess_template(folder: Path) -> str:
    architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "textgen"
    return "embedding"


def _copy_tree(src: Path, dst: Path, root: Path) -> None:
    """Copy ``src`` into ``dst``. A relative link that stays inside ``root`` is kept as it is (so a
    copy mounted into a container still resolves); any other link points at the same place as
    before; weights are linked, not copied."""
    for entry in src.iterdir():
        if entry.name in ("__pycache__", ".ipynb_checkpoints"):
            continue
        target = dst / entry.name
        if entry.is_symlink():
            link = os.readlink(entry)
            inside = os.path.normpath(entry.parent / link)
            if not os.path.isabs(link) and not _within(Path(inside), root):
                link = inside  # keep it pointing at the same place from its new home
            target.symlink_to(link, target_is_directory=entry.is_dir())
        elif entry.name in WEIGHT_NAMES or entry.suffix in WEIGHT_SUFFIXES:
            target.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        elif entry.is_dir():
            target.mkdir()
            _copy_tree(entry, target, root)
        else:
            shutil.copy2(entry, target)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def add_model(
    repository: str | os.PathLike,
    catalog_name: str,
    name: str | None = None,
    *,
    version: int = 1,
    overwrite: bool = False,
    **overrides: object,
) -> Path:
    """Write ``<repository>/<name>/`` (config.pbtxt + ``<version>/``) for a catalog model.

    ``overrides`` go to :func:`~labkit.repository.models.textgen_config` (``max_batch_size=8,
    dynamic_batching=True, max_tokens=32``...). Offline models still need
    :func:`~labkit.repository.models.prepare_repository` before serving.
    """
    entry = catalog_entry(catalog_name)
    name = check_name(name or entry.name)
    repo = Repository(repository, create=True)
    folder = repo.path / name
    if folder.exists() and not overwrite:
        raise ConfigError(
            f"model folder {str(folder)!r} already exists; pass overwrite=True or "
            "choose another name="
        )
    config = textgen_config(entry, name, **overrides)
    if folder.exists():
        shutil.rmtree(folder)
    return repo.add_from_template(name, "textgen", config, version=version)


def prepare_run_repository(
    run_dir: str | os.PathLike,
    models: list[str] | None = None,
    source: str | os.PathLike | None = None,
    **overrides: object,
) -> Repository:
    """The run's own copy of a model repository, ready to serve: ``<run_dir>/model_repository``.

    ``source`` (default: the lab's ``model_repository/``) is copied once (weights linked, not
    copied); a run folder that already holds a copy keeps it, with its edits. ``models`` names
    folders of the repository or catalog entries (``falcon7b``, ``opt125m``...): a name the copy
    lacks is added from the catalog with ``overrides`` (for example ``max_batch_size=8``). Local
    weights are built and linked (:func:`~labkit.repository.models.prepare_repository`). The
    source is never touched.
    """
    src = Path(source) if source else project_root() / "model_repository"
    if not src.is_dir():
        raise MissingFileError(
            f"model repository {str(src)!r} does not exist; pass source= a folder of models"
        )
    target = Path(run_dir) / "model_repository"
    if target.is_dir() and any(target.iterdir()):
        repo = Repository(target)
    else:
        repo = Repository(src).copy_to(target)
    present = set(repo.models())
    for name in models or []:
        if name not in present:
            if name not in CATALOG:
                raise ConfigError(
                    f"model {name!r} is neither in the model repository "
                    f"({', '.join(sorted(present))}) nor in the catalog "
                    f"({', '.join(sorted(CATALOG))}); pick one of those"
                )
            add_model(repo.path, name, **overrides)
    prepare_repository(repo.path)
    set_execution_environments(repo, models or [])
    return repo


#: The Python environments a model may run in, by the name its config gives in the parameter
#: ``labkit_environment``: each is a folder of the checkout that ``make install`` creates
#: (``vllm``: ``.venv-vllm``, vLLM with the server's Python and numpy < 2).
ENVIRONMENTS = {"vllm": ".venv-vllm"}
ENVIRONMENT_PARAMETER = "labkit_environment"
#: The Python backend's config parameter: the stub of the model runs in this environment.
EXECUTION_ENV_PATH = "EXECUTION_ENV_PATH"


def environment_folder(name: str) -> Path:
    """The folder of environment ``name`` (see :data:`ENVIRONMENTS`) in this checkout."""
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"unknown {ENVIRONMENT_PARAMETER} {name!r}; use one of {', '.join(ENVIRONMENTS)}"
        )
    return project_root() / ENVIRONMENTS[name]


def set_execution_environments(repository: Repository, models: list[str]) -> dict[str, Path]:
    """Point each model whose config names a ``labkit_environment`` at that environment.

    Writes the environment's absolute path into the model's config (in a run's copy: never the
    lab's own folder) as ``EXECUTION_ENV_PATH``; Triton's Python backend then runs the model's
    stub in it. A missing environment raises :class:`MissingDependencyError` for a model named in
    ``models`` (about to be served); any other such model is left as it is, with a warning (if it
    is loaded anyway, its own load error names ``make install``). Returns model -> environment.
    """
    pointed = {}
    for name in repository.models():
        cfg = repository.config(name)
        if ENVIRONMENT_PARAMETER not in cfg.parameters:
            continue
        wanted = cfg.parameters[ENVIRONMENT_PARAMETER].string_value
        folder = environment_folder(wanted)
        if not (folder / "bin" / "python").is_file():
            message = (
                f"model {name!r} runs in the Python environment {str(folder)!r} "
                f"({ENVIRONMENT_PARAMETER} {wanted!r}), which does not exist; run `make install`"
            )
            if name in models:
                raise MissingDependencyError(message)
            log.warning("%s (needed only to serve %s)", message, name)
            continue
        if cfg.parameters[EXECUTION_ENV_PATH].string_value != str(folder):
            cfg.parameters[EXECUTION_ENV_PATH].string_value = str(folder)
            repository.write_config(name, cfg)
        pointed[name] = folder
    return pointed


def models_to_serve(repository: str | os.PathLike) -> list[str]:
    """Every model of ``repository`` that can load on this checkout: a model whose
    ``labkit_environment`` does not exist yet is left out, with a warning that names
    ``make install`` (``labkit serve`` loads these by default)."""
    repo = Repository(repository)
    chosen = []
    for name in repo.models():
        params = repo.config(name).parameters
        if ENVIRONMENT_PARAMETER in params:
            folder = environment_folder(params[ENVIRONMENT_PARAMETER].string_value)
            if not (folder / "bin" / "python").is_file():
                log.warning(
                    "not loading %s: its Python environment %s does not exist; run `make install`",
                    name,
                    folder,
                )
                continue
        chosen.append(name)
    return chosen


#: A streaming twin's name: ``<model>_stream`` (the lab's ``smollm2_stream`` is ``smollm2``'s).
STREAM_SUFFIX = "_stream"

#: The learner's first model (notebook 01: one short ``model.py``) -> the lab's full model of the
#: same weights, built on the same three methods, which also batches and streams.
FIRST_MODELS = {"smollm2_first": "smollm2"}


def full_model(model: str) -> str:
    """The model that serves ``model``'s weights with batching and streaming: the full model of
    a first model (:data:`FIRST_MODELS`), else ``model`` itself. A first model answers each
    request once, so its answer streams from the full model's streaming twin."""
    return FIRST_MODELS.get(model, model)


def write_streaming_twin(repository: Repository, model: str) -> Path:
    """Write ``<model>_stream``: ``model``'s config, decoupled, and relative links to its files."""
    if model in FIRST_MODELS:
        raise ConfigError(
            f"{model} answers each request once (its model.py does not stream); stream "
            f"{FIRST_MODELS[model]}{STREAM_SUFFIX}, the full model's streaming twin, instead"
        )
    source = repository.model_dir(model)
    twin = repository.new_model_dir(model + STREAM_SUFFIX)
    config = repository.config(model)
    config.name = twin.name
    config.model_transaction_policy.decoupled = True
    twin.mkdir()
    for entry in sorted(source.iterdir()):
        if entry.name == CONFIG_FILE or entry.name.startswith("."):
            continue
        if entry.is_dir() and entry.name.isdigit() and not entry.is_symlink():
            (twin / entry.name).mkdir()
            for item in sorted(entry.iterdir()):
                if item.name != "__pycache__":
                    (twin / entry.name / item.name).symlink_to(
                        os.path.relpath(item, twin / entry.name)
                    )
        else:
            (twin / entry.name).symlink_to(os.path.relpath(entry, twin))
    repository.write_config(twin.name, config)
    return twin
