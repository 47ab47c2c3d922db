"""Live changes to a running server through Triton's repository API (explicit model control).

:func:`index` shows every model's state and reason; :func:`reload` writes a configuration (when
given) and loads it without restarting the server, putting the previous file back when Triton
refuses the new one. (Unloading is :meth:`TritonServer.unload_model`, which waits.)
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from labkit.errors import ConfigError, MissingFileError, ServerError
from labkit.proc import python_stubs, wait_until
from labkit.repository import STREAM_SUFFIX, Repository, write_streaming_twin
from labkit.repository.config import ModelConfig, check_name
from labkit.repository.textgen import instance_count
from labkit.settings import redact

if TYPE_CHECKING:
    from labkit.server.process import TritonServer

log = logging.getLogger(__name__)


def index(server: TritonServer) -> pd.DataFrame:
    """Every model of the server's repository with its version, state and reason (a model that
    was simply never loaded gets a reason too: Triton gives none)."""

    rows = [
        {
            "name": m.get("name", ""),
            "version": m.get("version", ""),
            "state": m.get("state", "UNAVAILABLE"),
            "reason": m.get("reason", "")
            or (
                ""
                if m.get("state") == "READY"
                else "not loaded: the server loads only the "
                "models it was asked to (explicit model control); load it with reload()"
            ),
        }
        for m in server.model_index()
    ]
    frame = pd.DataFrame(rows, columns=["name", "version", "state", "reason"])
    return frame.sort_values(["name", "version"], ignore_index=True)


def served_config(server: TritonServer, name: str) -> dict:
    """The configuration the server reports for a loaded model (``/v2/models/<name>/config``)."""

    try:
        with server.client() as client:
            return client.get_model_config(check_name(name))
    except InferenceServerException as exc:
        raise ServerError(f"Triton has no configuration for {name!r}: {exc.message()}") from exc


def reload(
    server: TritonServer,
    name: str,
    config: ModelConfig | None = None,
    *,
    repository: str | os.PathLike | Repository | None = None,
    warm: bool = True,
) -> str:
    """Load (or reload) ``name`` on a running server, writing ``config`` first if given.

    The folder is checked first, so a bad model never reaches the server. If Triton refuses the
    model, the previous ``config.pbtxt`` is put back and :class:`ServerError` carries Triton's
    reason; the models already serving keep serving. Returns the diff that was written. The
    model is then warmed up (:func:`warm_up`), so a measurement that follows sees it warm.
    """
    if not isinstance(repository, Repository):
        repository = Repository(repository or server.model_repository)
    path = repository.config_path(name)
    before = path.read_bytes() if path.is_file() else None
    change = repository.write_config(name, config) if config is not None else ""
    log_start = _log_size(server)
    try:
        repository.check(name)
        server.load_model(name)
    except (ServerError, ConfigError, MissingFileError) as exc:
        if config is not None and before is not None:
            path.write_bytes(before)
            log.warning("Triton refused the new configuration of %s; restored the old one", name)
        detail = _logged_reason(server, name, log_start) if isinstance(exc, ServerError) else ""
        if detail and detail not in str(exc):
            raise ServerError(f"{exc}\nserver log: {detail}") from exc
        raise
    log.info("loaded %s", name)
    _wait_old_stubs_gone(server, name)
    if warm:
        warm_up(server, name)
    return change


def _wait_old_stubs_gone(server: TritonServer, name: str, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until a reloaded model runs only its new instances' stubs.

    Triton serves the new version once it is loaded, while the old instances' stubs are still
    finalizing: measured on 2 cores, such a stub took 40% of a core for seconds after the reload
    returned, and the first measurement of the new configuration ran a third slower."""
    if not getattr(server, "running", False):
        return  # a remote server's processes are not ours to see
    want = instance_count(served_config(server, name))
    if not wait_until(lambda: len(stubs(server).get(name, [])) <= want, timeout_s):
        log.warning(
            "%s: the old instances' stubs were still running %g s after the reload", name, timeout_s
        )


def warm_up(server: TritonServer, name: str, *, count: int = 2, timeout_s: float = 120.0) -> int:
    """Send ``count`` small requests per instance of ``name`` and wait for the answers; return how
    many were sent. With several instances the requests go out together, one client per instance,
    so that Triton hands every instance some (sent one by one, they would all find the first
    instance free, and the others would meet their first request in the measurement).

    A model's first requests after a load pay for lazy initialisation (torch's kernels, caches):
    the lab's first measured request right after a reload was 3x slower than the rest. Inputs are
    made from the served config: ``"Hello"`` for a string tensor, zeros for a numeric one, each
    dim -1 taken as 1; a text model with a ``max_tokens`` parameter is asked for 2 tokens. A
    decoupled model (which HTTP ``/infer`` cannot serve, and ``/generate`` refuses when it sends one
    response per token) is warmed through ``/generate_stream`` when its one required input is
    ``text_input`` (vLLM's model has optional others), else left cold, with a log line.
    """
    config = served_config(server, name)
    instances = instance_count(config)
    inputs = config.get("input", [])
    decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
    parameters = {"max_tokens": 2} if "max_tokens" in config.get("parameters", {}) else {}
    if decoupled:
        required = [t.get("name") for t in inputs if not t.get("optional", False)]
        if required != ["text_input"]:
            log.info("not warming %s: a decoupled model that needs more than a text_input", name)
            return 0
        body = json.dumps({"text_input": "Hello", **parameters}).encode()
        url = f"http://{server.http_url}/v2/models/{name}/generate_stream"
        # generate_stream: a per-token model may send several responses
        return _together(instances, count, lambda: lambda: _post(url, body, timeout_s))
    import tritonclient.http as httpclient  # noqa: PLC0415 (each protocol's client pulls its own network stack; load the one in use)

    batched = int(config.get("max_batch_size", 0)) > 0
    tensors = []
    for spec in inputs:
        shape = ([1] if batched else []) + [1 if int(d) < 0 else int(d) for d in spec["dims"]]
        dtype = spec["data_type"].removeprefix("TYPE_")
        wire = "BYTES" if dtype == "STRING" else dtype
        tensor = httpclient.InferInput(spec["name"], shape, wire)
        if wire == "BYTES":
            tensor.set_data_from_numpy(np.full(shape, b"Hello", dtype=np.object_))
        else:
            tensor.set_data_from_numpy(np.zeros(shape, dtype=triton_to_np_dtype(wire)))
        tensors.append(tensor)
    clients = []

    def sender():  # one client per thread: a client is not shared between threads
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=timeout_s)
        clients.append(client)
        return lambda: client.infer(name, tensors, parameters=parameters or None)

    try:
        sent = _together(instances, count, sender)
    except InferenceServerException as exc:
        raise ServerError(f"warming up {name!r} failed: {redact(exc.message())}") from exc
    finally:
        for client in clients:
            client.close()
    log.info("warmed up %s (%d instances) with %d requests", name, instances, sent)
    return sent


def _together(threads: int, count: int, make_sender) -> int:
    """``count`` calls of a sender in each of ``threads`` threads at once (``make_sender()`` gives
    each thread its own); the first error is raised. Returns the calls made."""

    def run(_):
        send = make_sender()
        for _ in range(count):
            send()

    if threads == 1:
        run(0)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="warm-up") as pool:
            list(pool.map(run, range(threads)))
    return threads * count


def _post(url: str, body: bytes, timeout_s: float) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise ServerError(
            f"warming up at {url} failed: {exc.read().decode(errors='replace')}"
        ) from exc
    if '"error"' in answer:  # an SSE event that carries the model's error
        raise ServerError(f"warming up at {url} failed: {answer.strip()[-500:]}")


def _log_size(server: TritonServer) -> int:
    path = getattr(server, "log_path", None)
    return Path(path).stat().st_size if path and Path(path).is_file() else 0


def _logged_reason(server: TritonServer, name: str, start: int) -> str:
    """The last error the server logged about ``name`` since ``start`` (the load API is terse)."""
    path = getattr(server, "log_path", None)
    if not path or not Path(path).is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(start, f.seek(0, 2) - 64_000))
        lines = f.read().decode("utf-8", "replace").splitlines()
    errors = [line for line in lines if line.startswith("E") and f"'{name}'" in line]
    return redact(errors[-1].split("] ", 1)[-1].strip().strip('"')) if errors else ""


# -- Python-backend stubs ----------------------------------------------------------------------
def stubs(server: TritonServer) -> dict[str, list[int]]:
    """The live Python-backend stub processes of a local server: model name -> sorted PIDs.

    Each model instance of a Python-backend model runs in its own ``triton_python_backend_stub``
    child of ``tritonserver``; a stub that has died is not listed.
    """

    if not getattr(server, "running", False):
        raise ServerError(
            f"{server!r} is not a running local server; stub processes can only be seen for a "
            "server this process started (mode='local')"
        )
    found = python_stubs(server.pid)
    return {name: sorted(p.pid for p in found[name]) for name in sorted(found)}


def unhealthy(server: TritonServer) -> dict[str, str]:
    """Python-backend models Triton still calls READY although a stub of theirs has died.

    Triton 2.51 does not restart a dead stub: the model stays READY and every request to it is
    refused with ``Stub process '<model>_0' is not healthy``. Returns model name -> what is wrong.
    """
    live = stubs(server)
    broken = {}
    for row in server.model_index():
        name = row.get("name", "")
        if row.get("state") != "READY":
            continue
        with server.client() as client:
            config = client.get_model_config(name)
        if config.get("backend") != "python":
            continue
        expected, running = instance_count(config), len(live.get(name, []))
        if running < expected:
            broken[name] = f"{running} of {expected} Python stub processes alive"
    return broken


def restart(server: TritonServer, name: str) -> None:
    """Reload ``name`` with new instances although nothing changed (``load`` alone is a no-op).

    The version folders get a new modification time, so Triton loads the model anew and moves
    requests to the new instances when they are ready; the old ones serve until then. (A newer
    ``config.pbtxt`` alone is not enough: Triton then updates the config of the running instances.)
    """
    folder = Path(server.model_repository) / check_name(name)
    versions = [p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()]
    if not versions:
        raise MissingFileError(f"model {name!r} has no version folder in {str(folder)!r}")
    for version in versions:
        for item in [version, *version.iterdir()]:
            if not item.is_symlink():
                os.utime(item)
    server.load_model(name)


def recover(server: TritonServer, models: list[str] | None = None) -> list[str]:
    """Restart every model whose stub died (see :func:`unhealthy`); return the names restarted."""
    names = models if models is not None else list(unhealthy(server))
    for name in names:
        log.warning("restarting %s: a Python stub process of it had died", name)
        restart(server, name)
    return names


def serve_streaming_twin(server: TritonServer, model: str) -> str | None:
    """Load ``<model>_stream``, the streaming twin of ``model``, and return its name.

    The lab's repository holds ``smollm2_stream`` beside ``smollm2``: the same code and weights,
    decoupled. A model without such a folder (a catalog model added to a run) gets one written
    beside it first: its config with ``decoupled: true`` and links to the model's own files.
    Returns None only for a remote server, whose repository cannot be written from here.
    """
    twin = model + STREAM_SUFFIX
    states = {m["name"]: m.get("state", "") for m in server.model_index()}
    if twin not in states:
        if server.mode == "remote":
            log.info("no %s on the remote server and its repository is not here", twin)
            return None
        write_streaming_twin(Repository(server.model_repository), model)
    if states.get(twin) != "READY":
        server.load_model(twin)
    return twin
