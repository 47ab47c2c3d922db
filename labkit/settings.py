"""Settings have one home. Precedence: explicit argument > environment variable > default.

Every environment variable labkit reads is read here, with its default:

=========================  ===========================================================  =========
variable                   what it sets                                                 default
=========================  ===========================================================  =========
``LABKIT_CACHE``           built weights, backend copies, compile caches                ``~/.cache/labkit``
``LABKIT_RUNS``            where run folders go                                         ``<project>/runs``
``LABKIT_KERNEL``          the Jupyter kernel notebooks run in                          ``python3``
``LABKIT_TRITONSERVER``    a ``tritonserver`` executable to use                         found
``LABKIT_PERF_ANALYZER``   a ``perf_analyzer`` executable to use                        found
``LABKIT_SERVER_MODE``     ``local``, ``docker`` or ``remote``                          ``local``
``LABKIT_TRITON_IMAGE``    the docker mode's image (``labkit image build`` builds it)   ``triton_transformer_server:26.06``
``LABKIT_STARTUP_TIMEOUT_S`` the bound on a server start, seconds                       300
``VLLM_CACHE_ROOT``        vLLM's caches: its compiled graphs (vLLM reads it too)       ``~/.cache/vllm``
``HF_HOME``                the Hugging Face cache                                       ``~/.cache/huggingface``
``HF_TOKEN`` (and the two  the hub token, by name only; never shown                     unset
  names after it)
``HF_ENDPOINT``,           the hub address, and whether it may be reached               the hub
``HF_HUB_OFFLINE``
=========================  ===========================================================  =========

(``PATH``, ``LD_LIBRARY_PATH`` and ``PYTHONPATH`` are read only to extend them for a child
process.)
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


#: The NGC release the lab's image (docker/Dockerfile) is built FROM: the newest one the upstream
#: tutorial uses. 26.06 is Triton server 2.70.0 on Python 3.12 (the local mode bundles 2.51.0).
TRITON_RELEASE = "26.06"
NGC_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-py3"
#: The lab's image: the tutorial's tag, with the release it is built from.
DEFAULT_IMAGE = f"triton_transformer_server:{TRITON_RELEASE}"
DEFAULT_HUB = "https://huggingface.co"


def project_root() -> Path:
    """The checkout that holds ``notebooks/`` (labkit's parent folder), else the current folder."""
    candidate = Path(__file__).resolve().parent.parent
    return candidate if (candidate / "notebooks").is_dir() else Path.cwd()


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


def vllm_cache_root() -> Path:
    """Where vLLM keeps its caches, compiled graphs included (``VLLM_CACHE_ROOT``), as vLLM
    itself finds it: ``$XDG_CACHE_HOME/vllm``, by default ``~/.cache/vllm``."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm"
    return Path(setting(None, "VLLM_CACHE_ROOT", default)).expanduser()


def token_variable() -> str | None:
    """The name of the first token variable that is set, or None. The value is never returned."""
    for name in TOKEN_VARIABLES:
        if os.environ.get(name):
            return name
    return None


def token_variables_set() -> list[str]:
    """The names of every token variable that is set (to pass them on by name)."""
    return [name for name in TOKEN_VARIABLES if os.environ.get(name)]


def redact(text: str) -> str:
    """Replace the value of every token variable that is set with ``***``."""
    for name in TOKEN_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def runs_root(explicit: str | os.PathLike | None = None) -> Path:
    """Where run folders go: argument > ``LABKIT_RUNS`` > ``<project>/runs``."""
    return Path(setting(explicit, "LABKIT_RUNS", project_root() / "runs")).expanduser()


def kernel_name(explicit: str | None = None) -> str:
    """The Jupyter kernel notebooks run in: argument > ``LABKIT_KERNEL`` > ``python3``."""
    return setting(explicit, "LABKIT_KERNEL", "python3")


def tritonserver_path() -> str | None:
    """``LABKIT_TRITONSERVER``, the tritonserver executable a user named, if any."""
    return setting(None, "LABKIT_TRITONSERVER")


def perf_analyzer_path() -> str | None:
    """``LABKIT_PERF_ANALYZER``, the perf_analyzer executable a user named, if any."""
    return setting(None, "LABKIT_PERF_ANALYZER")


def server_mode(explicit: str | None, default: str) -> str:
    """The server mode: argument > ``LABKIT_SERVER_MODE`` > ``default``."""
    return setting(explicit, "LABKIT_SERVER_MODE", default)


def triton_image(explicit: str | None = None) -> str:
    """The docker mode's image: argument > ``LABKIT_TRITON_IMAGE`` > the lab's built image."""
    return setting(explicit, "LABKIT_TRITON_IMAGE", DEFAULT_IMAGE)


def startup_timeout_s(explicit: float | None = None) -> float:
    """The bound on a server start: argument > ``LABKIT_STARTUP_TIMEOUT_S`` > 300 s."""
    return float(setting(explicit, "LABKIT_STARTUP_TIMEOUT_S", 300))


def hub_endpoint() -> str:
    """The Hugging Face hub address (``HF_ENDPOINT``)."""
    return setting(None, "HF_ENDPOINT", DEFAULT_HUB).rstrip("/")


def hub_offline() -> bool:
    """Whether the user said the hub must not be reached (``HF_HUB_OFFLINE``)."""
    return str(setting(None, "HF_HUB_OFFLINE", "")).lower() in ("1", "true", "yes")
