"""A readiness endpoint per replica, for HAProxy's health check.

Each replica gets a small HTTP endpoint, served by a thread of the process that owns the
replicas, which answers ``GET /ready`` with 200 when its probe says ready and 503 with the reason
otherwise. The probe is :meth:`Replica.probe <labkit.cluster.Replica.probe>`: the check of
:mod:`.ready_check` (every served model's ``/v2/models/<model>/ready``, every Python stub alive),
the same file a Kubernetes pod runs as its readiness probe.

Why not Triton's own ``/v2/health/ready``: Triton 2.51 keeps a model READY after its
``triton_python_backend_stub`` died, and that endpoint keeps answering 200 while every request to
that model is refused with ``Stub process '<model>_0' is not healthy``; and it answers 400 while
any other model of the server loads or unloads, which would take a replica out of the pool for a
model it does not serve.

A model-level check (HAProxy sending a real inference request) would also see a dead stub, but it
costs an inference per check, needs a request per model, and on a large model a check would wait
behind real traffic; this one reads process state and Triton's metadata.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

#: ``probe() -> (ready, reason)``.
Probe = Callable[[], tuple[bool, str]]


class ReadinessEndpoint:
    """``GET /ready`` on ``host:port`` (0: a free port) answers what ``probe`` says."""

    def __init__(
        self, probe: Probe, host: str = "127.0.0.1", port: int = 0, name: str = ""
    ) -> None:
        self.probe = probe
        self.name = name
        self.checks = 0
        handler = _handler(self)
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"labkit-readiness-{name}",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/ready"

    def close(self) -> None:
        """Stop answering; safe to call twice."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()


def _handler(endpoint: ReadinessEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            endpoint.checks += 1
            try:
                ready, reason = endpoint.probe()
            except Exception as exc:  # noqa: BLE001 (a probe that fails means not ready)
                ready, reason = False, f"readiness probe failed: {exc!r}"
            body = (reason + "\n").encode()
            self.send_response(200 if ready else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            try:
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # HAProxy gave up on this check (its timeout) and closed
                pass

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the API's name)
            log.debug("%s readiness: " + format, endpoint.name, *args)

    return Handler
