"""Every short external command goes through :func:`run`, every long-running child through
:func:`spawn`; ports are chosen and checked here. A server's processes are walked here
(:func:`process_tree`, :func:`python_stubs`), leftovers found by their arguments
(:func:`processes_using`), and every "poll until a deadline" loop is :func:`wait_until`."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import psutil

from labkit.errors import MissingDependencyError, PortInUseError, ToolError, ToolTimeoutError
from labkit.settings import redact

log = logging.getLogger(__name__)

T = TypeVar("T")


def run(
    args: Sequence[str | os.PathLike],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
    cores: Collection[int] | None = None,
) -> subprocess.CompletedProcess:
    """Run a command (an argument list, never a shell string) and return its completed process.

    ``cores`` pins the command (and what it starts) to those CPU cores. Raises
    :class:`ToolError` with the command's own stderr when it fails, and :class:`ToolTimeoutError`
    when it runs past ``timeout_s`` (the process group is killed).
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
            preexec_fn=None if cores is None else functools.partial(_pin, frozenset(cores)),
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


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait (bounded) until no process of group ``pgid`` exists any more, so that "stopped" means
    gone: processes SIGKILLed with their group leader are reaped by init a moment later. Returns
    whether the group is gone; a group that outlives ``timeout_s`` is logged."""

    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        return False

    if wait_until(gone, timeout_s, 0.05):
        return True
    log.warning("process group %d still had members %g s after stop", pgid, timeout_s)
    return False


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.1,
    *,
    max_interval_s: float | None = None,
) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns something true, and return that;
    once ``timeout_s`` has passed, return its last (false) answer instead. It is called at least
    once, and its own errors are raised. With ``max_interval_s`` the pause grows by half at each
    call up to that bound (a readiness poll that answers fast at first and then stops hurrying).
    """
    deadline = time.monotonic() + timeout_s
    pause = interval_s
    while True:
        answer = predicate()
        if answer or time.monotonic() > deadline:
            return answer
        time.sleep(pause)
        if max_interval_s is not None:
            pause = min(pause * 1.5, max_interval_s)


# -- a server's processes ------------------------------------------------------------------------
def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants (a server and its stubs); raises
    :class:`psutil.NoSuchProcess` when ``pid`` is gone."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_total(pid: int, measure: Callable[[psutil.Process], float]) -> float:
    """``measure`` summed over :func:`process_tree` of ``pid``; a process that ends meanwhile
    counts nothing."""
    total = 0.0
    for process in process_tree(pid):
        try:
            total += measure(process)
        except psutil.Error:
            continue
    return total


STUB = "triton_python_backend_stub"


def python_stubs(pid: int) -> dict[str, list[psutil.Process]]:
    """The live Python-backend stubs of the tritonserver ``pid``: model name -> its processes.

    Each instance of a Python-backend model runs in its own stub, a child of ``tritonserver``
    whose command line names the ``model.py`` it runs (``<repo>/<model>/<version>/model.py``);
    a stub that has died (a zombie) or ended is not listed. Only children: what a stub starts
    itself (an engine's workers) is not a stub.
    """
    found: dict[str, list[psutil.Process]] = {}
    for child in psutil.Process(pid).children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE or not child.name().startswith(
                STUB[:15]  # the kernel keeps 15 characters of a process name
            ):
                continue
            args = child.cmdline()
        except psutil.Error:
            continue
        if len(args) > 1 and args[1].endswith(".py"):
            found.setdefault(Path(args[1]).parent.parent.name, []).append(child)
    return found


def processes_using(folder: str | os.PathLike) -> list[psutil.Process]:
    """Processes other than this one with a command-line argument that is ``folder`` or a path in
    it, alone or as an option's value (``--model-repository=<folder>/models``): the servers, stubs
    and tools a run in ``folder`` started. Arguments are compared as paths, not as a pattern, and
    a process that ends meanwhile is left out."""
    root = os.path.abspath(os.fspath(folder))
    inside = root.rstrip(os.sep) + os.sep

    def names(arg: str) -> bool:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        return value == root or value.startswith(inside)

    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and any(names(a) for a in process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _bound(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``port`` on ``host`` (0: the OS picks a free one)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except BaseException:
        s.close()
        raise
    return s


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """``count`` different ports free on ``host`` right now, none of them in ``avoid``.

    Every pick stays bound until all are made: picks closed one at a time can get the same port
    twice in a row (a fresh clone's suite once met a server's HTTP and metrics ports on one port).
    A pick that lands in ``avoid`` (ports asked for, checked free but not bound) is held too, so
    the loop ends after at most ``count + len(avoid)`` picks.
    """
    held: list[socket.socket] = []
    picked: list[int] = []
    try:
        while len(picked) < count:
            held.append(_bound(host))
            port = held[-1].getsockname()[1]
            if port not in avoid:
                picked.append(port)
    finally:
        for s in held:
            s.close()
    return picked


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


def _libc_prctl():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # not glibc Linux: no parent-death signal
        return None


# Looked up here, in the parent: a child between fork and exec must not dlopen (another thread
# of the parent may have held the loader's lock at the fork).
_PRCTL = _libc_prctl()


def set_parent_death_signal() -> None:
    """In a child, as ``preexec_fn``: receive SIGTERM when the parent dies (Linux), so no server
    or load balancer outlives the kernel that started it."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pin(cores: frozenset[int]) -> None:
    """In a child, as ``preexec_fn``: run on ``cores`` only (children inherit it)."""
    os.sched_setaffinity(0, cores)


def _in_child(cores: frozenset[int] | None) -> None:
    os.setpgid(0, 0)  # a process group of its own (Popen's process_group=0 needs Python 3.11)
    set_parent_death_signal()
    if cores is not None:
        _pin(cores)


def spawn(
    args: Sequence[str | os.PathLike], *, cores: Collection[int] | None = None, **popen_kwargs
) -> subprocess.Popen:
    """Start a long-running child (a server, a load balancer) in a process group of its own, set
    to receive SIGTERM when this process dies, and return it. ``cores`` pins it, and every process
    it starts, to those CPU cores.

    The child stays in this process's session (a new process group, not a new session): Linux's
    autogroup scheduling shares a busy CPU between sessions first, so a server per session gave
    N replicas N shares of the cores where one server got one, whenever other work competed for
    them (notebook 07 measured 2 replicas at x2.24 over 2 instances at load 6.3, and x0.98 on a
    quiet host). In one session, every server the lab starts gets the share one would.

    Linux ties PR_SET_PDEATHSIG to the *thread* that forked the child, not to the process: a
    server started from a worker thread got SIGTERM as soon as that thread ended (a cluster's
    supervisor that started a replacement replica, a ``ThreadPoolExecutor`` in a notebook). So
    every child is forked by one launcher thread that lives as long as the interpreter, whichever
    thread asks. ``popen_kwargs`` go to :class:`subprocess.Popen`; its errors are raised here.
    """
    future: Future[subprocess.Popen] = Future()
    pinned = None if cores is None else frozenset(cores)
    _launcher().put(([os.fspath(a) for a in args], pinned, popen_kwargs, future))
    try:
        return future.result()
    except BaseException as exc:
        if future.done() and future.exception() is exc:
            raise  # Popen's own error: nothing was started
        # Interrupted while the launcher forked: end the child the caller will never hold.
        with contextlib.suppress(BaseException):
            child = future.result(timeout=30)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        raise


_LAUNCH: queue.SimpleQueue | None = None
_LAUNCHER: threading.Thread | None = None
_LAUNCH_LOCK = threading.Lock()


def _launcher() -> queue.SimpleQueue:
    """The launcher's queue, starting the thread first if there is none (or, after a fork, if
    this process's copy of it does not run)."""
    global _LAUNCH, _LAUNCHER
    with _LAUNCH_LOCK:
        if _LAUNCHER is None or not _LAUNCHER.is_alive():
            _LAUNCH = queue.SimpleQueue()
            _LAUNCHER = threading.Thread(
                target=_launch_forever, args=(_LAUNCH,), name="labkit-launcher", daemon=True
            )
            _LAUNCHER.start()
        return _LAUNCH


def _launch_forever(requests: queue.SimpleQueue) -> None:
    while True:
        args, cores, popen_kwargs, future = requests.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            child = subprocess.Popen(
                args,
                preexec_fn=functools.partial(_in_child, cores),
                **{"stdin": subprocess.DEVNULL, **popen_kwargs},
            )
        except BaseException as exc:  # noqa: BLE001 (raised in the thread that asked)
            future.set_exception(exc)
        else:
            future.set_result(child)


def http_ok(url: str, timeout_s: float = 2) -> bool:
    """Whether ``url`` answers 200 (a health or readiness probe; any failure is False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False  # HTTPException: something else (not HTTP) answers on that port


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


class Child:
    """``pid`` and ``running`` of an object that runs one child process (``_process``, None
    before its start), as a server or a load balancer does."""

    _process: subprocess.Popen | None

    @property
    def pid(self) -> int | None:
        """The child's process ID, or None if it was never started here."""
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        """Whether the child was started and has not exited."""
        return self._process is not None and self._process.poll() is None
