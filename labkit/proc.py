"""Every short external command goes through :func:`run`; ports are chosen and checked here."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from labkit.errors import MissingDependencyError, PortInUseError, ToolError, ToolTimeoutError
from labkit.settings import redact

log = logging.getLogger(__name__)


def run(
    args: Sequence[str | os.PathLike],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run a command (an argument list, never a shell string) and return its completed process.

    Raises :class:`ToolError` with the command's own stderr when it fails, and
    :class:`ToolTimeoutError` when it runs past ``timeout_s`` (the process group is killed).
    """
    argv = [os.fspath(a) for a in args]
    shown = redact(" ".join(argv))
    log.debug("running %s", shown)
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise MissingDependencyError(f"command not found: {argv[0]!r} ({shown})") from exc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        raise ToolTimeoutError(
            f"{argv[0]} ran past its bound of {timeout_s:g} s and was stopped: {shown}\n"
            f"{tail(redact(err or out or ''))}"
        ) from None
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise ToolError(
            f"{os.path.basename(argv[0])} exited with status {proc.returncode}: {shown}\n"
            f"{tail(redact((err or '') + (out or '')))}"
        )
    return result


def kill_group(pid: int, sig: int = 9) -> None:
    """Send ``sig`` to the process group led by ``pid``; a group already gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(
    port: int, host: str = "127.0.0.1", what: str = "port", fix: str = "pass 0 to pick a free one"
) -> None:
    """Raise :class:`PortInUseError` naming ``port`` if something already listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"{what} {port} on {host} is in use by another process; {fix}"
            ) from exc


def set_parent_death_signal() -> None:
    """In a child, as ``preexec_fn``: receive SIGTERM when the parent dies (Linux), so no server
    or load balancer outlives the kernel that started it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def http_ok(url: str, timeout_s: float = 2) -> bool:
    """Whether ``url`` answers 200 (a health or readiness probe; any failure is False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Addresses:
    """``http_url`` and ``grpc_url`` (``host:port``, as tritonclient expects them) from the
    object's ``host`` and ``ports``; a service bound to every interface is reached on loopback."""

    host: str
    ports: dict[str, int]

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint, as tritonclient expects it."""
        return f"{self.client_host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.ports['grpc']}"

    @property
    def client_host(self) -> str:
        """Where a client on this machine connects: the loopback for a wildcard bind."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
