"""HAProxy in front of Triton replicas: its configuration, its process, and its runtime view.

Why HAProxy (Debian's ``haproxy`` package) and not nginx: open-source nginx has only *passive*
health checks (a server is skipped after failed requests), while HAProxy polls each server's
readiness endpoint (``option httpchk``), which is what a Kubernetes readiness probe does. It also
balances gRPC (HTTP/2 cleartext) next to HTTP, retries a request that failed before any answer on
another replica (``retry-on`` + ``option redispatch``), and shows every server's state on its
admin socket, so the pool can be read while it changes.

One frontend per protocol (HTTP, gRPC), one backend each, one ``server`` line per replica; the
gRPC servers ``track`` their HTTP twin, so one health check decides a replica for both. Each
answer carries the replica that served it in ``X-Labkit-Replica``.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from labkit import proc
from labkit.errors import MissingDependencyError, ServerError, ServerTimeoutError

log = logging.getLogger(__name__)

#: The response header that names the replica which answered (HAProxy's server name).
REPLICA_HEADER = "X-Labkit-Replica"
HTTP_BACKEND = "triton_http"
GRPC_BACKEND = "triton_grpc"
_INSTALL = "install HAProxy: `sudo apt-get install -y haproxy` (make install does it as root)"


@dataclass(frozen=True)
class Target:
    """One replica as the load balancer sees it: its name and the ports to send to and check."""

    name: str
    http_port: int
    grpc_port: int
    health_port: int


@dataclass(frozen=True)
class Checks:
    """How HAProxy decides that a replica is in the pool.

    ``interval_s``: time between two checks of a replica; ``connect_timeout_s`` also bounds the
    pause before a retry; ``fall``/``rise``: failed/passed checks
    in a row that take it out/put it back; ``retries``: how often a failed request is sent again,
    each time to another replica (``option redispatch 1``); ``retry_on``: which failures
    (HAProxy's ``retry-on`` keywords and statuses). The default retries a request that got no
    answer (refused or reset connection, empty or malformed answer) and one answered 500 or
    502-504: Triton 2.51 answers a request to a model whose Python stub died with
    ``500 Stub process '<model>_0' is not healthy.``, after about a second. A 4xx (a bad
    request) is never retried: it would fail on every replica.

    HAProxy retries only before any of the answer has gone to the client, so a stream under way
    is never retried (its client sees it cut). Retrying is right for what the lab serves: models
    without state, each request carrying its whole prompt and getting one answer, whose only
    side effect is compute; a 500 that the request itself causes (``generation failed``) is then
    run up to ``retries`` more times. It is wrong for a sequence-batched (stateful) model, whose
    sequence lives in the replica that started it (another replica refuses a sequence it did not
    start, and the first may have taken the step already), and for a model with side effects
    beyond its answer (a write, a charge), which a retry repeats: there pass ``retry_on=()``
    (HAProxy's ``none``) and send each sequence to one replica.
    """

    interval_s: float = 0.25
    fall: int = 2  # one slow check on a loaded host does not take a replica out
    rise: int = 1
    timeout_s: float = 2.0
    connect_timeout_s: float = 0.25
    retries: int = 3
    retry_on: tuple[str, ...] = (
        "conn-failure",
        "empty-response",
        "junk-response",
        "500",
        "502",
        "503",
        "504",
    )


def locate_haproxy(explicit: str | os.PathLike | None = None) -> Path:
    """The ``haproxy`` executable: the argument, else ``haproxy`` on PATH, else ``/usr/sbin``."""
    candidates = [explicit, shutil.which("haproxy"), "/usr/sbin/haproxy"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
        if candidate is explicit and explicit is not None:
            raise MissingDependencyError(f"haproxy={str(explicit)!r} is not an executable file")
    raise MissingDependencyError(f"haproxy was not found on PATH or in /usr/sbin; {_INSTALL}")


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def render_config(
    targets: list[Target],
    *,
    http_port: int,
    grpc_port: int,
    stats_port: int,
    socket_path: str | os.PathLike,
    checks: Checks = Checks(),
    host: str = "127.0.0.1",
) -> str:
    """HAProxy's configuration for ``targets`` behind one HTTP and one gRPC address on ``host``."""
    inter = _ms(checks.interval_s)
    lines = [
        "# Written by labkit.cluster: the replicas of one model repository behind one address.",
        "global",
        f"    stats socket {socket_path} mode 600 level admin",
        "    log stdout format raw local0 info",
        "    maxconn 2048",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlognull",
        # HAProxy waits min(timeout connect, 1 s) before a retry: loopback connects are instant.
        f"    timeout connect {_ms(checks.connect_timeout_s)}",
        "    timeout client 10m",
        "    timeout server 10m",
        f"    timeout check {_ms(checks.timeout_s)}",
        # A failed request goes to another replica, only before any answer reached the client.
        # Safe for the lab's models (no state, no side effect but compute); not for a stateful
        # (sequence-batched) model or one with side effects (see Checks). A request body up to
        # tune.bufsize, 16 kB, can be replayed.
        f"    retries {checks.retries}",
        "    option redispatch 1",
        # The whole request is read before it is sent, so a copy is kept for a retry; without it
        # a request whose body came in a second packet was seen not to be retried.
        "    option http-buffer-request",
        f"    retry-on {' '.join(checks.retry_on) or 'none'}",
        "",
        "frontend http",
        f"    bind {host}:{http_port}",
        # Statistics go to one replica (the first in the pool): a client that reads them before
        # and after a measurement (perf_analyzer) must read the same server's counters twice.
        r"    acl statistics path_reg ^/v2/models/.*stats$",
        f"    use_backend {HTTP_BACKEND}_first if statistics",
        f"    default_backend {HTTP_BACKEND}",
        "",
        "frontend grpc",
        f"    bind {host}:{grpc_port} proto h2",
        "    acl statistics path /inference.GRPCInferenceService/ModelStatistics",
        f"    use_backend {GRPC_BACKEND}_first if statistics",
        f"    default_backend {GRPC_BACKEND}",
        "",
        "frontend stats",
        f"    bind {host}:{stats_port}",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        "    stats enable",
        "    stats uri /stats",
        "    stats refresh 1s",
        "",
        f"backend {HTTP_BACKEND}",
        "    balance leastconn",
        "    option httpchk GET /ready",
        "    http-check expect status 200",
        f"    http-response set-header {REPLICA_HEADER} %s",
        f"    default-server inter {inter} fastinter {inter} downinter {inter} "
        f"rise {checks.rise} fall {checks.fall} observe layer4 error-limit 1 on-error mark-down",
    ]
    lines += [
        f"    server {t.name} {host}:{t.http_port} check port {t.health_port}" for t in targets
    ]
    lines += [
        "",
        f"backend {GRPC_BACKEND}",
        "    balance leastconn",
        f"    http-response set-header {REPLICA_HEADER} %s",
    ]
    lines += [
        f"    server {t.name} {host}:{t.grpc_port} proto h2 track {HTTP_BACKEND}/{t.name}"
        for t in targets
    ]
    for backend, port, proto in [
        (HTTP_BACKEND, "http_port", ""),
        (GRPC_BACKEND, "grpc_port", " proto h2"),
    ]:
        lines += ["", f"backend {backend}_first", "    balance first"]
        lines += [f"    http-response set-header {REPLICA_HEADER} %s"]
        lines += [
            f"    server {t.name} {host}:{getattr(t, port)}{proto} track {HTTP_BACKEND}/{t.name}"
            for t in targets
        ]
    return "\n".join(lines) + "\n"


class HAProxy(proc.Child):
    """One HAProxy process in its own process group, configured by :func:`render_config`."""

    def __init__(
        self,
        config_text: str,
        folder: str | os.PathLike,
        *,
        socket_path: str | os.PathLike,
        haproxy: str | os.PathLike | None = None,
        startup_timeout_s: float = 20.0,
    ) -> None:
        self.folder = Path(folder)
        self.config_path = self.folder / "haproxy.cfg"
        self.log_path = self.folder / "haproxy.log"
        self.socket_path = Path(socket_path)
        self.config_text = config_text
        self.startup_timeout_s = startup_timeout_s
        self._explicit = haproxy
        self._process: subprocess.Popen | None = None
        self._log_file = None

    def start(self) -> HAProxy:
        """Check the configuration (``haproxy -c``), start HAProxy, wait for its admin socket."""
        if self.running:
            return self
        binary = locate_haproxy(self._explicit)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text)
        proc.run([binary, "-c", "-q", "-f", self.config_path], timeout_s=30)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self._process = proc.spawn(
            [binary, "-db", "-f", self.config_path],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

        def answers() -> bool:
            if self._process.poll() is not None:
                code = self._process.returncode
                self.stop()
                raise ServerError(f"haproxy exited with status {code}.\n{self.log_tail()}")
            try:
                self.command("show info")
            except OSError:
                return False
            return True

        if not proc.wait_until(answers, self.startup_timeout_s, 0.05):
            self.stop()
            raise ServerTimeoutError(
                f"haproxy's admin socket {str(self.socket_path)!r} did not answer within "
                f"{self.startup_timeout_s:g} s.\n{self.log_tail()}"
            )
        return self

    def command(self, line: str, timeout_s: float = 5.0) -> str:
        """One command on the admin socket (``show stat``, ``set server ...``); its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.socket_path))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def servers(self, backend: str = HTTP_BACKEND) -> dict[str, dict[str, str]]:
        """Each server of ``backend`` and HAProxy's view of it: ``status`` (UP, DOWN, MAINT...),
        ``check_status``, ``check_desc``, ``scur`` (requests in flight), ``stot`` (sent so far)."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            row["svname"]: row
            for row in rows
            if row.get("pxname") == backend and row.get("svname") not in ("FRONTEND", "BACKEND")
        }

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.is_file():
            return "(no haproxy log)"
        return "haproxy log (last lines):\n" + proc.tail(
            self.log_path.read_text(errors="replace"), lines
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop HAProxy (its whole process group). Safe to call twice, or never started."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                proc.kill_group(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("haproxy did not stop within %s s; killing it", timeout_s)
            proc.kill_group(process.pid, signal.SIGKILL)
            process.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
