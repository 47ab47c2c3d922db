"""The Docker engine as the lab meets it: is there a client, does a daemon answer, may we use it.

Every docker-using path (the docker mode, ``labkit image``, the pod rehearsal) asks
:func:`require_daemon` first, so a missing engine is one sentence that names the fix, never a
traceback from ``docker run``.
"""

from __future__ import annotations

import shutil

from labkit import proc
from labkit.errors import MissingDependencyError, ToolTimeoutError

#: How a root Debian or Ubuntu host gets an engine (``make install`` does it there).
INSTALL_FIX = (
    "install Docker (Debian/Ubuntu as root: `apt-get install docker.io`, then start the engine: "
    "`dockerd --iptables=false --ip6tables=false &` where systemd does not run it), or use the "
    "local mode, which needs no Docker"
)


def require_client() -> str:
    """The ``docker`` command's path, or :class:`MissingDependencyError` naming the fix."""
    found = shutil.which("docker")
    if not found:
        raise MissingDependencyError(f"the docker command is not installed here; {INSTALL_FIX}")
    return found


def daemon_problem(timeout_s: float = 20.0) -> str | None:
    """Why the Docker engine cannot be used now, in a sentence with its fix; None when it can."""
    if not shutil.which("docker"):
        return f"the docker command is not installed here; {INSTALL_FIX}"
    try:
        done = proc.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            timeout_s=timeout_s,
            check=False,
        )
    except ToolTimeoutError:
        return f"the Docker engine did not answer within {timeout_s:g} s; check that dockerd runs"
    if done.returncode == 0 and done.stdout.strip():
        return None
    message = (done.stderr or done.stdout).strip().splitlines()
    said = message[-1] if message else f"status {done.returncode}"
    if "permission denied" in said.lower():
        return (
            f"this user may not use the Docker engine ({said}); add it to the docker group "
            "(`sudo usermod -aG docker $USER`, then log in again) or run as root"
        )
    if "cannot connect" in said.lower() or "is the docker daemon running" in said.lower():
        return (
            f"no Docker engine answers ({said}); start it (`sudo systemctl start docker`, or "
            "`sudo dockerd --iptables=false --ip6tables=false &` where systemd does not run), "
            "or use the local mode, which needs no Docker"
        )
    return f"the Docker engine is not usable: {said}"


def require_daemon() -> None:
    """Raise :class:`MissingDependencyError` with :func:`daemon_problem`'s sentence, if any."""
    problem = daemon_problem()
    if problem:
        raise MissingDependencyError(problem)
