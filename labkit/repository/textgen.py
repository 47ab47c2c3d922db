"""The text model's in-flight engine settings, as the served model reads them.

The model folder's ``engine_settings.py`` is their one home: the served model builds its engine
from it, and labkit's in-process benchmark builds the same engine from the same file, so the two
cannot drift apart. This module loads that file and gives labkit its view of it.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict, fields

from ..errors import ConfigError
from .config import ModelConfig
from .folder import TEMPLATES_DIR

SETTINGS_FILE = TEMPLATES_DIR / "textgen" / "engine_settings.py"


def _load_settings():
    # Loaded by path: a model version folder (``1/``) is not a package labkit can import (Triton
    # imports it as ``1``, a name that is no identifier and that every model folder shares). The
    # file imports only the standard library, so loading it here brings in no model library.
    name = "labkit.repository._textgen_engine_settings"
    spec = importlib.util.spec_from_file_location(name, SETTINGS_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


_settings = _load_settings()

#: The in-flight engine's limits (config.pbtxt parameters of an in-flight model) and defaults.
ENGINE_LIMITS: dict[str, int] = {f.name: f.default for f in fields(_settings.Limits)}


def engine_limits(config: ModelConfig) -> dict[str, int]:
    """The in-flight engine's limits that a model config sets (its parameters, else defaults),
    checked as the served model checks them."""
    params = {key: value.string_value for key, value in config.parameters.items()}
    try:
        return asdict(_settings.read_limits(params))
    except ValueError as exc:
        raise ConfigError(f"model {config.name!r}: {exc}; fix its config.pbtxt") from None


def engine_config(limits: dict[str, int]) -> dict:
    """transformers' ``ContinuousBatchingConfig`` arguments for ``limits``: the served engine's."""
    return _settings.engine_settings(_settings.Limits(**limits))


def serving_threads() -> int:
    """torch threads per served model on a CPU: one less than this host's usable cores (at least
    1), as the served in-flight model takes them. Every scheduler of the benchmark gets the same
    number, so that they compare fairly."""
    return _settings.serving_threads()


def thread_budget(instances: int = 1, servers: int | None = None, *, inflight: bool = False) -> int:
    """torch threads per instance that a served text model takes by default on this host when
    ``instances`` instances in each of ``servers`` servers (default: as the environment says,
    one) share its cores: the model folder's ``thread_budget`` (the in-flight engine's with
    ``inflight``)."""
    return _settings.thread_budget(instances, servers, inflight=inflight)


def instance_count(config: dict) -> int:
    """How many instances Triton runs for a served config (Triton's JSON form), as the model
    counts them for its thread budget."""
    return _settings.instance_count(config)


def usable_cores() -> int:
    """The cores this process may run on, as the served model counts them."""
    return _settings.usable_cores()
