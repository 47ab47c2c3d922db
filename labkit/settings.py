"""Settings have one home. Precedence: explicit argument > environment variable > default.

Every environment variable labkit reads is named here, with its default.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Token variables, in order of preference. ``PRIVATE_REPO_TOKEN`` is the upstream tutorial's name.
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "PRIVATE_REPO_TOKEN")


def setting(explicit, env_name: str, default=None):
    """Return ``explicit`` if given, else ``$env_name`` if set and non-empty, else ``default``."""
    if explicit is not None:
        return explicit
    value = os.environ.get(env_name)
    if value not in (None, ""):
        return value
    return default


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Where labkit keeps built models, backend copies and compile caches (``LABKIT_CACHE``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "labkit"
    path = Path(setting(explicit, "LABKIT_CACHE", default)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def hf_home(explicit: str | os.PathLike | None = None) -> Path:
    """The Hugging Face cache root (``HF_HOME``), never the deprecated ``TRANSFORMERS_CACHE``."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(setting(explicit, "HF_HOME", default)).expanduser()


def token_variable() -> str | None:
    """The name of the first token variable that is set, or None. The value is never returned."""
    for name in TOKEN_VARIABLES:
        if os.environ.get(name):
            return name
    return None


def redact(text: str) -> str:
    """Replace the value of every token variable that is set with ``***``."""
    for name in TOKEN_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text
