"""The host's pip settings, served to a ``docker build`` on loopback for the build's length.

A build sees nothing of the host's pip configuration, and two of its settings decide whether the
lab's image builds at all on this kind of host:

- ``find-links``: a local folder holds the CPU build of torch; PyPI's ``torch`` of the same
  version is the CUDA build, with gigabytes of NVIDIA libraries;
- ``cert``: the certificate bundle pip trusts; where the way out goes through a proxy that
  inspects TLS, pip in the build fails on every index (``CERTIFICATE_VERIFY_FAILED``) without it.

:func:`serving` serves, at ``http://127.0.0.1:<port>/``, ``wheels/`` (every wheel of those
folders on one page of links, pip's find-links format) and ``ca.pem`` (the bundle, when pip names
one). The build (``--network host``) gets that address as ``HOST_PIP_URL``; the Dockerfile's one
``RUN`` that installs fetches the bundle to a temporary file and removes it before the step ends.
So nothing of pip's configuration enters a layer: the address is dead once the build ends, and
the folders' paths never leave this machine.
"""

from __future__ import annotations

import contextlib
import html
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote


@dataclass(frozen=True)
class HostPip:
    """What of the host's pip configuration a build gets."""

    folders: tuple[Path, ...] = ()  # local find-links folders
    cert: Path | None = None  # the certificate bundle pip trusts


def host_pip(python: str | os.PathLike | None = None) -> HostPip:
    """The local folders among pip's ``find-links`` and its ``cert`` (its configuration files and
    ``PIP_*`` variables), as ``python -m pip config list`` reports them."""
    try:
        done = subprocess.run(
            [str(python or sys.executable), "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return HostPip()
    folders: list[Path] = []
    cert = None
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".cert") and Path(value).is_file():
            cert = Path(value)
        if not key.endswith(".find-links"):
            continue
        for item in value.split():
            path = Path(item.removeprefix("file://"))
            if path.is_dir() and path not in folders:
                folders.append(path)
    return HostPip(tuple(folders), cert)


def wheels(folders: tuple[Path, ...]) -> dict[str, Path]:
    """File name -> path of every wheel in ``folders`` (the first folder wins a name)."""
    found: dict[str, Path] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.whl")):
            found.setdefault(path.name, path)
    return found


@contextlib.contextmanager
def serving(settings: HostPip) -> Iterator[str | None]:
    """Serve ``settings`` on a free loopback port; yield its URL (None when there is nothing to
    serve). The server stops when the block ends."""
    files = wheels(settings.folders)
    if not files and settings.cert is None:
        yield None
        return
    page = "".join(
        f'<a href="{html.escape(name)}">{html.escape(name)}</a><br>\n' for name in sorted(files)
    ).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = unquote(self.path.lstrip("/").split("?", 1)[0])
            folder, _, name = name.partition("/")
            if folder == "wheels" and not name:
                self._send(page, "text/html")
            elif folder == "wheels" and name in files:
                self._send(files[name].read_bytes(), "application/octet-stream")
            elif folder == "ca.pem" and settings.cert is not None:
                self._send(settings.cert.read_bytes(), "application/x-pem-file")
            else:
                self.send_error(404)

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # pip's requests are not worth a line each
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="wheel-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
