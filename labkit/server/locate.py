"""Find a ``tritonserver`` and arrange what it needs to serve Python-backend models.

Order: explicit argument > ``LABKIT_TRITONSERVER`` > ``tritonserver`` on ``PATH`` >
``/opt/tritonserver/bin/tritonserver`` > the binary inside the ``nvidia-pytriton`` wheel. The
bundled binary needs a backend directory holding this Python's stub, this interpreter's ``bin/``
first on ``PATH`` and its shared libpython first on ``LD_LIBRARY_PATH`` (DESIGN.md, part 1).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from labkit.errors import MissingDependencyError
from labkit.settings import cache_dir, tritonserver_path


@dataclass(frozen=True)
class ServerBinary:
    """A located ``tritonserver`` and what it needs to serve Python-backend models."""

    path: Path
    source: str  # "argument", "LABKIT_TRITONSERVER", "PATH", "/opt/tritonserver", "nvidia-pytriton"
    backend_directory: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: Where the response cache's libraries are (``caches/local/libtritoncache_local.so``);
    #: None: the server's own default, ``/opt/tritonserver/caches``.
    cache_directory: Path | None = None


def locate_tritonserver(explicit: str | os.PathLike | None = None) -> ServerBinary:
    """Find a ``tritonserver``: argument > ``LABKIT_TRITONSERVER`` > PATH > /opt > the wheel."""
    candidates = [
        (explicit, "argument"),
        (tritonserver_path(), "LABKIT_TRITONSERVER"),
    ]
    for value, source in candidates:
        if value is not None:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise MissingDependencyError(
                    f"tritonserver given by {source} is not an executable file: {str(path)!r}; "
                    "fix the path or unset it to use the server bundled with nvidia-pytriton"
                )
            return ServerBinary(path, source, cache_directory=cache_directory(path))
    on_path = shutil.which("tritonserver")
    if on_path and not _is_labkit_wrapper(Path(on_path)):
        return ServerBinary(Path(on_path), "PATH", cache_directory=cache_directory(Path(on_path)))
    opt = Path("/opt/tritonserver/bin/tritonserver")
    if opt.is_file():
        return ServerBinary(opt, "/opt/tritonserver")
    return bundled_tritonserver()


def _is_labkit_wrapper(path: Path) -> bool:
    """The Model Analyzer wrapper that labkit writes calls back into labkit; skip it here."""
    try:
        return b"labkit-tritonserver-wrapper" in path.read_bytes()[:4096]
    except OSError:
        return False


def bundled_tritonserver() -> ServerBinary:
    """The server inside the ``nvidia-pytriton`` wheel, with a backend directory and environment."""
    try:
        import pytriton  # noqa: PLC0415 (only the bundled server needs the nvidia-pytriton wheel)
    except ImportError as exc:
        raise MissingDependencyError(
            "no tritonserver found (LABKIT_TRITONSERVER, PATH, /opt/tritonserver) and the "
            "nvidia-pytriton wheel is not installed; run `make install` or "
            "`pip install nvidia-pytriton==0.7.0`"
        ) from exc
    root = Path(pytriton.__file__).parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise MissingDependencyError(
            f"nvidia-pytriton has no Python-backend stub for Python {version}; "
            "use Python 3.8 to 3.13"
        )
    libs = [str(root.parent.parent / "nvidia_pytriton.libs")]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libs.insert(0, sysconfig.get_config_var("LIBDIR"))
    else:
        raise MissingDependencyError(
            f"this Python ({sys.executable}) has no shared libpython, which the Triton Python "
            "backend stub needs; use a Python built with --enable-shared (conda, Debian's python3, "
            "or pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared)"
        )
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "LD_LIBRARY_PATH": os.pathsep.join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]),
    }
    backend = _backend_copy(root, stub, version)
    return ServerBinary(binary, "nvidia-pytriton", backend, env, cache_directory(binary))


def cache_directory(binary: Path) -> Path | None:
    """The ``caches/`` folder beside a server's ``bin/`` (the bundled server's, or an install's
    under another prefix), when it holds a cache; None otherwise. Triton itself looks only in
    ``/opt/tritonserver/caches``, so a server installed elsewhere needs ``--cache-directory``."""
    folder = Path(binary).resolve().parent.parent / "caches"
    return folder if any(folder.glob("*/libtritoncache_*.so")) else None


def _backend_copy(root: Path, stub: Path, version: str) -> Path:
    """A backend directory of our own: the wheel's python backend plus this Python's stub."""
    target = cache_dir() / "backends" / f"pytriton-{_stamp(stub)}-py{version}"
    if (target / "python" / "triton_python_backend_stub").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="backend-", dir=target.parent))
    shutil.copytree(root / "backends" / "python", staging / "python")
    shutil.copy2(stub, staging / "python" / "triton_python_backend_stub")
    try:
        staging.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size:x}{int(st.st_mtime):x}"
