"""Shared fixtures and helpers: each exists once, here.

- :class:`ServerFactory` behind the ``start_server`` (per test) and ``start_module_server`` (per
  module) fixtures: every test module that starts a Triton server starts it through one of them,
  on free loopback ports, with its own log, a bounded start and a guaranteed stop;
- :func:`released_together` and :func:`sent_together`: requests released at once by a barrier,
  and what Triton's metrics counted for them, so a test that needs a batch can confirm it formed;
- :func:`wait_for`: every wait in the suite polls against a bound;
- ``--busy-core``: the whole session runs while a spinning process holds one CPU core
  (``make test-loaded``), which is how the next race shows up before CI finds it;
- :class:`FastTierGuard`: the marker rule of the tiers (``make check`` runs the unmarked tests):
  an unmarked test that starts a process, or takes over :data:`FAST_TIER_LIMIT_S`, fails.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crashwatch
import psutil
import pytest

from labkit import profiling
from labkit.proc import wait_until
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

# numpy.testing runs lscpu when first imported: imported here, before any test, so that no
# unmarked test is charged with that process start (FastTierGuard).
importlib.import_module("numpy.testing")

# No test may reach a model hub: everything runs from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Each pytest-xdist worker runs its own servers on the same cores: the models they serve take
# their share of the cores (labkit's thread budget reads this variable), as replicas do. One
# worker's servers alone would take every core, and two workers' would then spin against each
# other (labkit bench threads: x0.03 to x0.65 at 8 clients on 2 cores, docs/benchmarks.md).
os.environ.setdefault("LABKIT_SERVERS_ON_HOST", os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


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
    value = wait_until(condition, timeout_s, interval_s)
    if not value:
        raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
    return value


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


# -- the notebooks carry the notebook marker; xdist hands out whole files, longest first -------
#: tests/test_vllm_lora.py (its own vLLM server) is left out on purpose: listed at 150 s it ran
#: early, beside notebook 06's and test_vllm_model.py's vLLM engines, and in that fresh-clone
#: run (2026-12-05) stubs crashed (error 7), two servers aborted (lock_exception) and a held stream
#: of smollm2_vllm never ended; by tier weight it runs late, beside the fast tests.
#: Seconds each file took on its worker in a fresh clone's ``make test`` (2026-12-04: 2 workers,
#: 2 cores, 26:34 in all), the files of 5 s or more. Only the order the workers get files in
#: depends on it: longest first, so that the two workers end together. Ordered by their tier
#: markers, the files left test_aiperf.py (86 s) to run last, alone, for 97 s after the other
#: worker had ended. Measure again (``--durations=0``, summed per file) when a file grows by a
#: minute or more.
FILE_SECONDS = {
    "notebooks/06_inflight_batching.ipynb": 378,
    "notebooks/04_model_analyzer.ipynb": 312,
    "notebooks/03_dynamic_batching.ipynb": 253,
    "notebooks/07_beyond_one_machine.ipynb": 330,  # 224 before its pods were rehearsed in docker
    "tests/test_docker_mode.py": 300,  # notebook 01 in docker mode is 200 of it
    "tests/test_rehearse.py": 150,
    "tests/test_stand_in.py": 180,  # a fresh machine builds both images here (or where the tier starts)
    "notebooks/08_pipelines_and_caching.ipynb": 140,  # measured alone (labkit run 08), not in make test
    "tests/test_vllm_model.py": 173,
    "tests/test_inflight.py": 144,
    "tests/test_analyzer.py": 119,
    "tests/test_gpu_check.py": 103,
    "tests/test_profiling.py": 97,
    "tests/test_secrets.py": 94,
    "tests/test_faults.py": 93,
    "tests/test_aiperf.py": 86,
    "tests/test_bad_input_matrix.py": 86,
    "tests/test_server.py": 85,
    "notebooks/02_multiple_models.ipynb": 83,
    "tests/test_threads_bench.py": 80,  # a 2-replica cluster, three twins, six measurements
    "tests/test_textgen_server.py": 72,
    "tests/test_pipeline.py": 70,  # measured alone, not in make test
    "tests/test_load.py": 64,
    "tests/test_neuron_serve.py": 60,
    "tests/test_cluster.py": 51,
    "tests/test_streaming.py": 50,
    "tests/test_browser.py": 49,
    "notebooks/01_deploy_transformer.ipynb": 47,
    "tests/test_embedding.py": 42,
    "notebooks/05_inferentia.ipynb": 40,
    "tests/test_headless.py": 37,
    "tests/test_doctor.py": 35,
    "tests/test_deploy.py": 24,
    "tests/test_capacity.py": 24,
    "tests/test_live_config.py": 23,
    "tests/test_image.py": 23,
    "tests/test_client.py": 20,
    "notebooks/00_setup_check.ipynb": 17,
    "tests/test_bench.py": 17,
    "tests/test_models.py": 12,
    "tests/test_widgets.py": 10,
    "tests/test_notebook_hygiene.py": 7,
    "tests/test_report.py": 5,
}

#: What a test of a file not in :data:`FILE_SECONDS` weighs, by its heaviest tier marker
#: (seconds, roughly): a new file is ordered by its markers until it is measured.
SCHEDULE_WEIGHT_S = {"notebook": 150.0, "slow": 40.0, "browser": 40.0, "integration": 5.0}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """nbmake's items (the shipped notebooks) get the ``notebook`` marker, so ``-m notebook``
    selects them.

    Under ``make test``'s ``--dist loadfile`` a file runs whole on one worker, so a module's
    shared server starts once. xdist queues the files in collection order; in a worker, that
    order is longest first (:func:`file_weights`), so that the long notebooks do not start
    last and leave one worker running alone at the end."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
    if hasattr(config, "workerinput"):  # an xdist worker: the order is the scheduler's queue
        weights = file_weights(items, config.rootpath)
        # sort is stable: the items of a file keep their order, files of equal weight theirs
        items.sort(key=lambda item: -weights[item.path])


def file_weights(items: list[pytest.Item], root: Path) -> dict[Path, float]:
    """How long each file of ``items`` is taken to run, for ordering only: its measured seconds
    (:data:`FILE_SECONDS`), else the sum of its tests' :func:`schedule_weight`."""
    weights: dict[Path, float] = {}
    for item in items:
        weights[item.path] = weights.get(item.path, 0.0) + schedule_weight(item)
    for path in weights:
        measured = FILE_SECONDS.get(
            path.relative_to(root).as_posix() if path.is_relative_to(root) else ""
        )
        if measured is not None:
            weights[path] = float(measured)
    return weights


def schedule_weight(item: pytest.Item) -> float:
    """How long ``item`` is taken to run by its markers, for ordering only
    (:data:`SCHEDULE_WEIGHT_S`)."""
    return max(
        (w for name, w in SCHEDULE_WEIGHT_S.items() if item.get_closest_marker(name)), default=0.1
    )


# -- the tiers: what an unmarked test may do --------------------------------------------------
#: The markers that take a test out of the fast tier (``make check``). The rule: a test that
#: starts a server, a kernel or any other process is ``integration`` (``notebook`` for a
#: notebook's kernel), one that takes over :data:`FAST_TIER_LIMIT_S` is ``slow``; the others are
#: unmarked, and :class:`FastTierGuard` fails an unmarked test that breaks the rule.
TIER_MARKERS = ("integration", "notebook", "slow", "browser")

#: The longest an unmarked test's setup or call may take, on two loaded cores.
FAST_TIER_LIMIT_S = 20.0

#: How many of the slowest unmarked tests a too-slow one's failure lists.
SLOWEST_SHOWN = 5


def in_fast_tier(item: pytest.Item) -> bool:
    """Whether ``item`` carries none of :data:`TIER_MARKERS` (``make check`` runs it)."""
    return not any(item.get_closest_marker(name) for name in TIER_MARKERS)


def marker_for(command: str) -> str:
    """The marker a test that starts ``command`` needs, as the failure names it."""
    if any(word in command for word in ("ipykernel", "papermill", "jupyter")):
        return "integration (notebook if it executes a shipped notebook)"
    return "integration"


def runs_a_fake(command: Any, path: str | None, folder: Path | None) -> bool:
    """Whether ``command`` (an argument list) runs a program under ``folder``, the test's own
    ``tmp_path``, found on ``path`` as the child would find it: a fake the test wrote to stand in
    for a tool this machine lacks (nvidia-smi, docker). It costs a shell's start and reaches
    nothing, so the fast tier allows it; every other process start is refused."""
    if folder is None or isinstance(command, (str, bytes, os.PathLike)) or not command:
        return False
    program = os.fsdecode(command[0])
    found = program if os.sep in program else shutil.which(program, path=path)
    return found is not None and Path(found).resolve().is_relative_to(Path(folder).resolve())


def looks_up_a_library(command: Any) -> bool:
    """Whether ``command`` is ``ldconfig -p``: ``ctypes.util.find_library`` runs it when a library
    (torch, on its first import) looks for a shared library. It reads the linker's cache and
    reaches nothing; which test imports torch first depends on the order the tests run in."""
    if isinstance(command, (str, bytes, os.PathLike)) or len(command) < 2:
        return False
    return Path(os.fsdecode(command[0])).name == "ldconfig" and os.fsdecode(command[1]) == "-p"


def process_fault(test: str, command: Any, thread: str = "MainThread") -> str:
    """What an unmarked ``test`` that starts ``command`` fails with."""
    if isinstance(command, (str, bytes, os.PathLike)):
        shown = os.fsdecode(command)
    else:
        shown = shlex.join(os.fsdecode(part) for part in command)
    where = "" if thread == "MainThread" else f" (from thread {thread!r})"
    marker = marker_for(shown)
    return (
        f"{test} is in the fast tier (no {'/'.join(TIER_MARKERS)} marker) and started a "
        f"process{where}: {shown[:300]}\n"
        f"Mark it @pytest.mark.{marker}: a test that starts a server, a kernel or any other "
        f"process is not run by `make check`."
    )


def duration_fault(
    test: str, phase: str, seconds: float, slowest: Sequence[tuple[str, float]], limit_s: float
) -> str | None:
    """What an unmarked ``test`` whose ``phase`` took ``seconds`` fails with; None within
    ``limit_s``. ``slowest``: (test, seconds) of the slowest unmarked tests so far."""
    if seconds <= limit_s:
        return None
    listed = "\n".join(f"  {s:6.1f} s  {name}" for name, s in slowest[:SLOWEST_SHOWN])
    return (
        f"{test}'s {phase} took {seconds:.1f} s, over the fast tier's {limit_s:g} s.\n"
        f"Mark it @pytest.mark.slow (and integration if it starts a process): `make check` "
        f"runs only tests that are fast on two cores.\nThe slowest unmarked tests so far:\n"
        f"{listed}"
    )


class FastTierGuard:
    """The marker rule, held while an unmarked test's setup and call run (a plugin).

    Every process start goes through :class:`subprocess.Popen` (labkit's ``proc.run`` and
    ``proc.spawn``, papermill's and jupyter_client's kernels, pip, perf_analyzer), or else
    ``os.system`` or ``os.fork`` (multiprocessing, pty): all three refuse, with the test, the
    command and the marker to add; only a fake the test wrote into its own ``tmp_path`` runs
    (:func:`runs_a_fake`). The refusal is a :func:`pytest.fail`, which no ``except
    Exception`` swallows, and the test fails even where something caught it. Teardown is not
    held: a module's fixture ends after whichever test came last, marked or not. A setup or call
    over ``limit_s`` fails its test too, with the slowest unmarked tests so far.
    """

    def __init__(self, limit_s: float = FAST_TIER_LIMIT_S) -> None:
        self.limit_s = limit_s
        self.durations: dict[str, float] = {}

    def _held(self, item: pytest.Item):
        if not in_fast_tier(item):
            # the real ones, even under another guard: in a pytest run inside a test
            # (tests/test_tiers.py), the inner run's rule holds for its tests
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(subprocess.Popen, "__init__", _REAL_POPEN_INIT)
                patch.setattr(os, "system", _REAL_SYSTEM)
                patch.setattr(os, "fork", _REAL_FORK)
                return (yield)
        faults = item.stash.setdefault(_PROCESS_FAULTS, [])

        def refuse(command: Any) -> None:
            fault = process_fault(item.nodeid, command, threading.current_thread().name)
            faults.append(fault)
            pytest.fail(fault)

        def guarded_popen_init(popen, args, *rest, **kwargs):
            env = kwargs.get("env")
            path = (env if env is not None else os.environ).get("PATH")
            fakes = getattr(item, "funcargs", {}).get("tmp_path")
            if not kwargs.get("shell") and (
                runs_a_fake(args, path, fakes) or looks_up_a_library(args)
            ):
                return _REAL_POPEN_INIT(popen, args, *rest, **kwargs)
            refuse(args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(subprocess.Popen, "__init__", guarded_popen_init)
            patch.setattr(os, "system", refuse)
            patch.setattr(os, "fork", lambda: refuse("os.fork()"))
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._held(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._held(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if report.when == "teardown" or not in_fast_tier(item):
            return report
        faults = item.stash.get(_PROCESS_FAULTS, [])
        if faults and report.passed:  # the refusal was caught: the test still fails
            report.outcome, report.longrepr = "failed", "\n".join(faults)
        self.durations[item.nodeid] = self.durations.get(item.nodeid, 0.0) + report.duration
        slowest = sorted(self.durations.items(), key=lambda pair: -pair[1])
        fault = duration_fault(item.nodeid, report.when, report.duration, slowest, self.limit_s)
        if fault and report.passed:
            report.outcome, report.longrepr = "failed", fault
        elif fault:  # failed or skipped for its own reason: that stays, and this is shown too
            report.sections.append(("fast tier", fault))
        return report


_PROCESS_FAULTS = pytest.StashKey[list]()
_REAL_POPEN_INIT, _REAL_SYSTEM, _REAL_FORK = subprocess.Popen.__init__, os.system, os.fork


def pytest_configure(config):
    _warm_font_cache()
    config.pluginmanager.register(FastTierGuard(), "fast-tier-guard")
    crashwatch.configure(config)


def _warm_font_cache() -> None:
    """matplotlib lists the system's fonts with ``fc-list`` the first time it is imported on a
    machine, then keeps the list in its cache. A table styled by pandas imports it, so on a
    fresh machine where Chromium brought fontconfig, the first fast-tier test to style one
    started a process and failed the guard. The list is made here, before any test runs."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401


def pytest_terminal_summary(terminalreporter, config):
    crashwatch.terminal_summary(terminalreporter, config)


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
    if hasattr(config, "workerinput"):  # under xdist the controller spins, once for the run
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
