"""A CPU stand-in for NGC's ``tritonserver`` image, built on this machine from nothing.

NGC's image (``nvcr.io/nvidia/tritonserver:<yy.mm>-py3``) cannot be pulled where no registry is
reachable, and needs a GPU host to be worth pulling. The stand-in lays out the Triton 2.51 server
that the ``nvidia-pytriton`` wheel bundles where NGC's image has its server:

- ``/opt/tritonserver/bin/tritonserver`` (on ``PATH``), its libraries found through its rpath;
- ``/opt/tritonserver/backends/python/``: ``libtriton_python.so``,
  ``triton_python_backend_utils.py`` and the stub built for the image's Python (3.11);
- ``/opt/tritonserver/caches/``: the ``local`` response-cache library;
- Python 3.11 with its shared libpython (the stub links it), pip and numpy<2, on Debian bookworm
  (``debootstrap --variant=minbase`` from this machine's apt mirror).

``docker/Dockerfile`` builds the lab's image FROM it (``labkit image build --base``) exactly as it
builds FROM NGC's image on a GPU host. What the stand-in does not check: CUDA and the GPU, and the
behaviour of NGC's own server release (2.70 on 26.06; the stand-in serves 2.51, NGC 24.10's).

:func:`build_base` runs the steps; :func:`plan` says what they are without running them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labkit import proc
from labkit.errors import MissingDependencyError, ToolError
from labkit.server.docker import require_daemon

log = logging.getLogger(__name__)

#: The stand-in's tag: the server release it carries, and that it is a CPU image.
BASE_IMAGE = "triton_labkit_base:2.51-cpu"
#: The Debian release and the Python its ``python3.11`` package gives; the stub must match it.
SUITE = "bookworm"
PYTHON = "3.11"
#: Debian packages of the rootfs: the Python the stub runs (with its shared libpython), pip for
#: the Dockerfile's installs, numpy for the backend's utilities, certificates for pip's HTTPS.
PACKAGES = ("python3.11", "libpython3.11", "python3-pip", "python3-numpy", "ca-certificates")
#: Where the wheel's server tree and its vendored libraries go in the image.
SITE = "/opt/pytriton-site"
TRITON = "/opt/tritonserver"
FALLBACK_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class BasePlan:
    """What :func:`build_base` will do: the mirror, the wheel's server tree, the tag."""

    tag: str
    mirror: str
    server_tree: Path  # site-packages/pytriton/tritonserver
    libraries: Path  # site-packages/nvidia_pytriton.libs
    stub: Path


def apt_mirror(sources: Path = Path("/etc/apt/sources.list.d/debian.sources")) -> str:
    """The first Debian mirror this machine's apt uses (deb822 ``URIs:`` or a ``deb`` line);
    ``deb.debian.org`` when none is found."""
    candidates = [sources, Path("/etc/apt/sources.list")]
    for path in candidates:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found = re.search(r"^URIs:\s*(\S+)", text, re.MULTILINE) or re.search(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)", text, re.MULTILINE
        )
        if found and "security" not in found[1]:
            return found[1]
    return FALLBACK_MIRROR


def plan(tag: str = BASE_IMAGE) -> BasePlan:
    """The build's inputs, checked: the wheel's server tree and its 3.11 stub."""
    try:
        import pytriton  # noqa: PLC0415 (only this build and the local mode need the wheel)
    except ImportError:
        raise MissingDependencyError(
            "the nvidia-pytriton wheel, which holds the Triton server the stand-in lays out, is "
            "not installed; run `make install`"
        ) from None
    tree = Path(pytriton.__file__).parent / "tritonserver"
    stub = tree / "python_backend_stubs" / PYTHON / "triton_python_backend_stub"
    libraries = tree.parent.parent / "nvidia_pytriton.libs"
    for needed in (tree / "bin" / "tritonserver", stub, libraries):
        if not needed.exists():
            raise MissingDependencyError(f"the nvidia-pytriton wheel lacks {needed}; reinstall it")
    return BasePlan(tag, apt_mirror(), tree, libraries, stub)


def build_base(tag: str = BASE_IMAGE, *, timeout_s: float = 1200.0) -> str:
    """Build the stand-in and tag it ``tag``; return the tag. Needs root, ``debootstrap`` and a
    Docker engine. The rootfs is made in a temporary folder and removed whatever happens."""
    steps = plan(tag)
    require_daemon()
    if os.geteuid() != 0:
        raise MissingDependencyError(
            "building the stand-in image runs debootstrap, which needs root; run it as root "
            "(sudo .venv/bin/labkit image base), or build the lab's image FROM NGC's on a GPU host"
        )
    if not shutil.which("debootstrap"):
        raise MissingDependencyError(
            "debootstrap is not installed; `apt-get install debootstrap` (make install does it as "
            "root on Debian and Ubuntu)"
        )
    work = Path(tempfile.mkdtemp(prefix="labkit-base-"))
    try:
        rootfs = work / "rootfs"
        _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
             str(rootfs), steps.mirror],
            "debootstrap", timeout_s,
        )  # fmt: skip
        _lay_out_server(rootfs, steps)
        _trim(rootfs)
        _import(rootfs, tag, timeout_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tag


def _lay_out_server(rootfs: Path, steps: BasePlan) -> None:
    """The wheel's server where NGC's image has it."""
    site = rootfs / SITE.lstrip("/")
    shutil.copytree(steps.server_tree, site / "pytriton" / "tritonserver", symlinks=True)
    shutil.copytree(steps.libraries, site / "nvidia_pytriton.libs", symlinks=True)
    triton = rootfs / TRITON.lstrip("/")
    (triton / "bin").mkdir(parents=True)
    (triton / "bin" / "tritonserver").symlink_to(f"{SITE}/pytriton/tritonserver/bin/tritonserver")
    backend = triton / "backends" / "python"
    backend.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(steps.server_tree / "backends" / "python" / name, backend / name)
    shutil.copy2(steps.stub, backend / "triton_python_backend_stub")
    (triton / "caches").symlink_to(f"{SITE}/pytriton/tritonserver/caches")
    # the other Python versions' stubs: 5 x ~2 MB the image never runs
    shutil.rmtree(site / "pytriton" / "tritonserver" / "python_backend_stubs")


def _trim(rootfs: Path) -> None:
    """Drop apt's downloaded packages and lists, as NGC's image does."""
    for folder in ("var/cache/apt/archives", "var/lib/apt/lists"):
        path = rootfs / folder
        for child in path.glob("*"):
            if child.is_file():
                child.unlink()


#: The image's environment: the server on PATH, the stub's libraries (found by no rpath), the
#: system Python's pip allowed to install beside Debian's packages (as in NGC's image).
ENV = {
    "PATH": f"{TRITON}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LD_LIBRARY_PATH": f"{SITE}/nvidia_pytriton.libs",
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "LANG": "C.UTF-8",
}


def import_changes() -> list[str]:
    """``docker import --change`` flags: the environment, the working folder, the labels."""
    changes = [f"ENV {name}={value}" for name, value in ENV.items()]
    changes += [
        "WORKDIR /opt/tritonserver",
        'LABEL org.opencontainers.image.description="CPU stand-in for NGC tritonserver: '
        'Triton 2.51 from nvidia-pytriton on Debian bookworm (triton-labkit)"',
    ]
    return [flag for change in changes for flag in ("--change", change)]


def _import(rootfs: Path, tag: str, timeout_s: float) -> None:
    with subprocess.Popen(
        ["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE
    ) as tar:
        try:
            done = subprocess.run(
                ["docker", "import", *import_changes(), "-", tag],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        finally:
            tar.stdout.close()
            tar.wait()
    if done.returncode != 0 or tar.returncode != 0:
        raise ToolError(f"docker import of the stand-in failed: {(done.stderr or '').strip()}")


def _run(command: list[str], what: str, timeout_s: float) -> None:
    log.info("running %s", " ".join(command))
    done = proc.run(command, timeout_s=timeout_s, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise ToolError(f"{what} exited with status {done.returncode}:\n{tail}")
