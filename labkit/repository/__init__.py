"""A Triton model repository: the models' configurations, the models the lab knows, the folder.

- :mod:`.config`: ``config.pbtxt`` as Triton's ``ModelConfig`` protobuf (parse, validate, edit,
  diff, atomic write);
- :mod:`.models`: the catalog, each model kind's config, the offline weights and their links;
- :mod:`.folder`: the folder itself (list, check, add, remove, copy, a run's own copy).

Live changes to a running server (load, reload, unload, stubs, recover) are in
:mod:`labkit.server.live`.
"""

from .config import (
    CONFIG_FILE,
    KINDS,
    ModelConfig,
    apply_edits,
    change_summary,
    check_name,
    config_to_text,
    diff_configs,
    parse_config,
    read_config,
    validate,
    write_config,
)
from .folder import (
    ENVIRONMENTS,
    FIRST_MODELS,
    STREAM_SUFFIX,
    Repository,
    add_model,
    environment_folder,
    full_model,
    models_to_serve,
    prepare_run_repository,
    write_streaming_twin,
)
from .models import (
    CATALOG,
    CatalogEntry,
    build_weights,
    catalog,
    catalog_entry,
    embedding_config,
    prepare_repository,
    textgen_config,
)

__all__ = [
    "ENVIRONMENTS",
    "FIRST_MODELS",
    "environment_folder",
    "full_model",
    "models_to_serve",
    "CATALOG",
    "STREAM_SUFFIX",
    "CONFIG_FILE",
    "KINDS",
    "CatalogEntry",
    "ModelConfig",
    "Repository",
    "add_model",
    "apply_edits",
    "build_weights",
    "catalog",
    "catalog_entry",
    "check_name",
    "config_to_text",
    "change_summary",
    "diff_configs",
    "embedding_config",
    "parse_config",
    "prepare_repository",
    "prepare_run_repository",
    "read_config",
    "textgen_config",
    "validate",
    "write_config",
    "write_streaming_twin",
]
