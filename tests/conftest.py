"""Shared fixtures and helpers: each exists once, here.

- :class:`ServerFactory` behind the ``start_server`` (per test) and ``start_module_server`` (per
  module) fixtures: every test module that starts a Triton server starts it through one of them,
  on free loopback ports, with its own log, a bounded start and a guaranteed stop;
- :func:`released_together` and :func:`sent_together`: requests released at once by a barrier,
  and what Triton's metrics counted for them, so a test that needs a batch can confirm it formed;
- :func:`wait_for`: every wait in the suite polls against a bound;
- ``--busy-core``: the whole session runs while a spinning process holds one CPU core
  (``make test-loaded``), which is how the next race shows up before CI finds it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from labkit import profiling
from labkit.server import TritonServer

#: A Python-backend model config with one string input and one string output, no batching.
TEXT_MODEL_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "text_input" data_type: TYPE_STRING dims: [-1] }]
output [{ name: "text_output" data_type: TYPE_STRING dims: [-1] }]
"""

#: A server environment without hub tokens: a gated model then fails to load for a known reason,
#: whatever the developer running the suite has exported.
NO_TOKEN = {"HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": "", "PRIVATE_REPO_TOKEN": ""}

#: The bound on a test server's start: tiny models load in seconds, the real LLM in about 20 s;
#: on two loaded cores everything takes several times longer.
STARTUP_TIMEOUT_S = 240

#: A queue delay that makes a batch certain for requests released together: far longer than the
#: spread of their arrivals even on a loaded machine. A batch that fills max_batch_size is
#: dispatched at once, so only a straggler ever waits this long.
JOIN_DELAY_MICROSECONDS = 2_000_000

# No test may reach a model hub: everything runs from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def write_python_model(repo, name, model_py, config=TEXT_MODEL_CONFIG):
    """Write ``repo/name/config.pbtxt`` and ``repo/name/1/model.py``."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py))


# -- a throwaway notebook ---------------------------------------------------------------------
def write_notebook(path: Path, *cells: str, parameters: str | None = None) -> Path:
    """A python3 notebook of code ``cells``; with ``parameters``, a markdown title and a cell
    tagged ``parameters`` come first, as in the shipped notebooks."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    head = []
    if parameters is not None:
        head = [
            new_markdown_cell("# a throwaway notebook"),
            new_code_cell(parameters, metadata={"tags": ["parameters"]}),
        ]
    nb = new_notebook(cells=[*head, *[new_code_cell(c) for c in cells]])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)
    return path


# -- a model whose every execute costs a fixed time ------------------------------------------
SLEEPY_MODEL = textwrap.dedent(
    '''
    """Sleeps a fixed time per execute, whatever the batch, then upper-cases each text."""
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.sleep_s = float({sleep_ms}) / 1000.0

        def execute(self, requests):
            time.sleep(self.sleep_s)
            responses = []
            for request in requests:
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
                upper = np.array([[t.upper() for t in row] for row in text], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", upper)]))
            return responses
    '''
)


def write_sleepy_model(
    repo: Path, name: str = "sleepy", *, sleep_ms: int = 20, batching: bool = True
) -> Path:
    """A model whose execute costs ``sleep_ms`` whatever its batch, so batching visibly helps."""
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(SLEEPY_MODEL.replace("{sleep_ms}", str(sleep_ms)))
    batching_block = "dynamic_batching { max_queue_delay_microseconds: 2000 }" if batching else ""
    (folder / "config.pbtxt").write_text(
        textwrap.dedent(
            f"""
            name: "{name}"
            backend: "python"
            max_batch_size: 8
            {batching_block}
            input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
            output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
            instance_group [ {{ count: 1 kind: KIND_CPU }} ]
            """
        )
    )
    return folder


# -- the server factory ------------------------------------------------------------------------
class ServerFactory:
    """Makes real Triton servers for tests and stops every one it made.

    ``factory(repository, **kwargs)`` starts a server and returns it once every endpoint and
    requested model is ready; ``factory.new(...)`` returns one not started yet (for a test that
    starts it itself, in a thread or under ``pytest.raises``). ``kwargs`` go to
    :class:`~labkit.server.TritonServer`; the defaults are free loopback ports, a log in the
    factory's folder, :data:`STARTUP_TIMEOUT_S` and no hub token in the server's environment
    (``env=`` adds to that).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.servers: list[TritonServer] = []

    def new(self, repository: str | os.PathLike, **kwargs: Any) -> TritonServer:
        for kind in ("http", "grpc", "metrics"):
            kwargs.setdefault(f"{kind}_port", 0)
        kwargs.setdefault("startup_timeout_s", STARTUP_TIMEOUT_S)
        name = f"tritonserver-{len(self.servers)}-{Path(repository).name}.log"
        kwargs.setdefault("log_path", self.log_dir / name)
        kwargs["env"] = {**NO_TOKEN, **(kwargs.get("env") or {})}
        server = TritonServer(repository, **kwargs)
        self.servers.append(server)
        return server

    def __call__(self, repository: str | os.PathLike, **kwargs: Any) -> TritonServer:
        return self.new(repository, **kwargs).start()

    def stop_all(self) -> None:
        """Stop every server made here (stop is idempotent); the first failure is raised last."""
        failures = []
        for server in reversed(self.servers):
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 (the others are stopped first)
                failures.append(exc)
        if failures:
            raise failures[0]


@pytest.fixture
def start_server(tmp_path):
    """Factory: ``start_server(repo, **kwargs)`` starts a real Triton, stopped after the test."""
    factory = ServerFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory):
    """Factory for a module's shared server: started by a module fixture, stopped after the
    module. Tests that share one must not depend on each other's effects."""
    factory = ServerFactory(tmp_path_factory.mktemp("servers"))
    yield factory
    factory.stop_all()


# -- waiting and processes ---------------------------------------------------------------------
def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll ``condition`` until it returns something true, and return that; fail after
    ``timeout_s`` naming ``what`` did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(interval_s)


def group_alive(pgid: int) -> list[psutil.Process]:
    """The processes of process group ``pgid`` that still run (zombies excluded)."""
    alive = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


# -- requests released together, and the batches they made ------------------------------------
def released_together(call: Callable[[Any], Any], items: Sequence[Any], timeout_s: float = 120):
    """``call(item)`` for every item, each in its own thread, all released at once by a barrier;
    the results in the order of ``items``."""
    barrier = threading.Barrier(len(items))

    def run(item):
        barrier.wait(timeout=timeout_s)
        return call(item)

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(run, items))


def model_counts(server: TritonServer, model: str, since=None):
    """Triton's counters for ``model`` (``labkit.profiling.metrics``), as one row."""
    frame = profiling.metrics(server, since=since)
    rows = frame[frame["model"] == model]
    assert len(rows) == 1, f"no single metrics row for {model!r}:\n{frame}"
    return rows.iloc[0]


def sent_together(server: TritonServer, model: str, call, items, settle_timeout_s: float = 30):
    """Release ``call(item)`` for every item at once (:func:`released_together`) and return
    ``(results, counts)``: ``counts`` (a dict) is what Triton's metrics counted for ``model``,
    read once every request is counted (a decoupled model's request is counted when the model
    releases it, a moment after its client read the final response)."""
    before = profiling.metrics(server)
    results = released_together(call, items)

    def counted():
        row = model_counts(server, model, since=before).to_dict()
        return row if row["request_success"] + row["request_failure"] >= len(items) else None

    counts = wait_for(counted, settle_timeout_s, f"Triton counting {len(items)} requests")
    return results, counts


# -- the upstream QA's add/sub model ------------------------------------------------------------
def add_sub():
    """The upstream Inferentia QA's model: ``OUTPUT__0 = a + b``, ``OUTPUT__1 = a - b``."""
    import torch  # a model library: only the tests that compile it pay for the import

    class AddSub(torch.nn.Module):
        def forward(self, a, b):
            return a + b, a - b

    return AddSub()


def compiled_add_sub(cache_dir: Path):
    """:func:`add_sub` compiled for the cpu target (TorchScript) with a ``[1, 4]`` int64 example."""
    import torch

    from labkit.neuron import compiler

    example = (torch.zeros(1, 4, dtype=torch.int64),) * 2
    return compiler.compile(add_sub(), example, "cpu", cache_dir=cache_dir)


# -- model code, imported as Triton imports it -------------------------------------------------
@contextlib.contextmanager
def imported_as_triton_does(version_dir: Path, module: str = "model"):
    """``version_dir/<module>.py`` imported the way the Python backend's stub imports model.py.

    The stub puts the model's folder on ``sys.path`` and imports ``<version>.model``: the version
    folder is a package, so the model's ``from . import ...`` finds its siblings. The server's own
    ``triton_python_backend_utils`` comes from the bundled backend. No ``__pycache__`` is left
    in the folder (a template's would be packaged).
    """
    import pytriton

    backend = str(Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python")
    package = version_dir.name
    saved_path, saved_bytecode = list(sys.path), sys.dont_write_bytecode
    sys.path[:0] = [str(version_dir.parent), backend]
    sys.dont_write_bytecode = True
    try:
        yield importlib.import_module(f"{package}.{module}")
    finally:
        sys.path[:], sys.dont_write_bytecode = saved_path, saved_bytecode
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]


# -- the notebooks carry the notebook marker ---------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """nbmake's items (the shipped notebooks) get the ``notebook`` marker, so ``-m notebook``
    selects them."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)


# -- a run under load: --busy-core -------------------------------------------------------------
#: The spinner's own bound: it ends by itself even if pytest is killed without a chance to stop
#: it (it also receives SIGKILL when pytest dies, on Linux).
BUSY_CORE_BOUND_S = 3 * 3600

SPINNER = """
import ctypes, os, signal, sys, time
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with pytest
except OSError:
    pass
parent, deadline = os.getppid(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


def pytest_addoption(parser):
    parser.addoption(
        "--busy-core",
        action="store_true",
        default=False,
        help="keep one CPU core busy with a spinning process for the whole session "
        "(make test-loaded): a race that a loaded machine shows fails here first",
    )


def pytest_sessionstart(session):
    config = session.config
    if not config.getoption("--busy-core", default=False):
        return
    spinner = subprocess.Popen(
        [sys.executable, "-c", SPINNER, str(BUSY_CORE_BOUND_S)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    config.stash[_SPINNER] = spinner


def pytest_report_header(config):
    if config.getoption("--busy-core", default=False):
        return "busy core: a spinning process holds one CPU core for the whole session"
    return None


def pytest_sessionfinish(session):
    spinner = session.config.stash.get(_SPINNER, None)
    if spinner is not None:
        session.config.stash[_SPINNER] = None
        spinner.send_signal(signal.SIGKILL)  # only the spinner this session started, by its pid
        spinner.wait(timeout=30)


_SPINNER = pytest.StashKey["subprocess.Popen | None"]()
