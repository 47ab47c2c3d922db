"""The docker tier's images: built once per machine, shared by every test that runs a container.

A test module calls :func:`lab_image` (or :func:`base_image`) for a tag. The first caller on a
machine builds the CPU stand-in for NGC's image (``labkit image base``) and the lab's image on
it (``labkit image build --base``); later callers, in any pytest-xdist worker, find them in
Docker's image store. A file lock keeps two workers from building at once. Without a usable
Docker engine the test is skipped with the reason and its fix (``make install`` starts the
engine where it runs as root on Debian or Ubuntu).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from labkit.server import base_image as stand_in
from labkit.server import image
from labkit.server.docker import daemon_problem

#: The lab's image built on the stand-in.
LAB_IMAGE = image.ON_STAND_IN
_LOCK = Path(tempfile.gettempdir()) / "labkit-docker-tier.lock"


def require_docker() -> None:
    """Skip the calling test, with the reason and its fix, where no Docker engine can be used."""
    problem = daemon_problem()
    if problem:
        pytest.skip(f"docker tier: {problem}")
    if os.geteuid() != 0 and not _present(stand_in.BASE_IMAGE):
        pytest.skip("docker tier: building the stand-in image needs root (debootstrap)")


def _present(tag: str) -> bool:
    done = subprocess.run(
        ["docker", "image", "inspect", tag], capture_output=True, timeout=60, check=False
    )
    return done.returncode == 0


def base_image() -> str:
    """The stand-in's tag, built first if this machine has none."""
    require_docker()
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _present(stand_in.BASE_IMAGE):
            stand_in.build_base()
    return stand_in.BASE_IMAGE


def lab_image() -> str:
    """The lab's image on the stand-in, built first (with the stand-in) if this machine has none."""
    base = base_image()
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _present(LAB_IMAGE):
            log = Path(tempfile.gettempdir()) / "labkit-docker-tier-build.log"
            with open(log, "wb") as sink:
                try:
                    image.build(image.build_command(base=base), stdout=sink)
                except Exception as exc:
                    tail = log.read_text(errors="replace").splitlines()[-20:]
                    raise RuntimeError(f"{exc}\n" + "\n".join(tail)) from exc
    return LAB_IMAGE
