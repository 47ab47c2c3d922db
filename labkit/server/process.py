"""One object owns one Triton Inference Server: find it, start it, wait for it, stop it.

Three modes share one interface:

- ``local``: a ``tritonserver`` process on this machine (an explicit path, ``LABKIT_TRITONSERVER``,
  ``tritonserver`` on ``PATH``, ``/opt/tritonserver/bin/tritonserver``, or the binary inside the
  ``nvidia-pytriton`` wheel, which needs its Python-backend stub and libraries arranged first);
- ``docker``: the tutorial's ``docker run`` of the lab's image (``labkit image build``, checked
  before each start by :func:`~labkit.server.image.require_image`), tokens passed by name only.
  Its ports are published on the host's ``host`` (127.0.0.1 by default) under the same numbers,
  while the server binds every interface of the container's own network; ``--gpus all`` is
  passed where a GPU and Docker's NVIDIA runtime exist (``gpus=``). The container is removed
  by :meth:`TritonServer.stop`, when the start fails or is interrupted, and when the process
  that started it dies, however it dies (a guard of its own session removes it then). With
  ``openai_port`` the container runs Triton's OpenAI frontend instead of ``tritonserver``
  (:mod:`labkit.server.frontend`). A model that runs in one of the lab's own Python
  environments (``labkit_environment``, such as ``smollm2_vllm`` in ``.venv-vllm``) is refused
  unless the image has that environment's package (vLLM: Triton's vLLM image); then it is served
  from a copy of its config without ``EXECUTION_ENV_PATH`` (:meth:`TritonServer.container_configs`);
- ``remote``: attach to a server that runs elsewhere; start and stop never touch it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
import weakref
from pathlib import Path

import psutil
from tritonclient.utils import InferenceServerException

from labkit.errors import (
    MissingDependencyError,
    PortInUseError,
    ServerError,
    ServerTimeoutError,
    StalledStartError,
)
from labkit.hardware import has_gpu
from labkit.proc import (
    Addresses,
    Child,
    check_port_free,
    free_ports,
    http_ok,
    kill_group,
    spawn,
    tail,
    wait_group_gone,
    wait_until,
)
from labkit.repository import CONFIG_FILE, Repository, config_to_text
from labkit.repository.config import check_name
from labkit.repository.folder import ENVIRONMENT_PARAMETER, ENVIRONMENTS, EXECUTION_ENV_PATH
from labkit.server.frontend import OpenAIFrontend, check_port, plan_frontend
from labkit.server.image import loopback_ports, ngc_image, require_image
from labkit.server.locate import ServerBinary, locate_tritonserver
from labkit.server.stall import STALL_S, StallWatch, models_still_loading
from labkit.settings import (
    DEFAULT_IMAGE,
    TOKEN_VARIABLES,
    cache_dir,
    hf_home,
    redact,
    server_mode,
    token_variables_set,
    triton_image,
)
from labkit.settings import startup_timeout_s as startup_timeout_s_setting

log = logging.getLogger(__name__)

CONTAINER_REPOSITORY = "/opt/tritonserver/model_repository"
CONTAINER_CACHES = "/opt/tritonserver/caches"  # the NGC image's response-cache libraries
#: The server's address inside its container: the container's own interfaces, reached only
#: through the ports published on the host's address (``-p 127.0.0.1:P:P``).
CONTAINER_ADDRESS = "0.0.0.0"
MODES = ("local", "docker", "remote")
#: Starts tried with newly picked free ports when another process took one before Triton bound it.
PORT_ATTEMPTS = 3
#: What Triton 2.51 prints when it aborts starting a Python stub under load (see ``start``).
STARTUP_ABORT = "boost::interprocess::lock_exception"
_LIVE: weakref.WeakSet[TritonServer] = weakref.WeakSet()


class TritonServer(Child, Addresses):
    """A Triton server this object owns (local, docker) or attaches to (remote).

    >>> with TritonServer("model_repository", http_port=0) as server:
    ...     server.http_url

    ``cores`` pins the server, its model stubs and what they start to those CPU cores (a
    benchmark keeps its load generator off them).

    ``stall_s``: a local start that shows no work for this long (no log line, no CPU spent by
    the server or its stubs: :mod:`labkit.server.stall`) is stopped and started once more;
    ``None`` leaves only ``startup_timeout_s``.

    ``cache_size`` (bytes) turns on Triton's response cache (the ``local`` cache, that many
    bytes shared by every model whose config says ``response_cache { enable: true }``). The
    bundled server's cache library is found beside it (``--cache-directory``); in docker mode it
    is the NGC image's own ``/opt/tritonserver/caches``.

    ``openai_port`` (docker mode only; 0 picks a free port) runs Triton's OpenAI-compatible
    frontend in the container instead of ``tritonserver``: the OpenAI API at :attr:`openai_url`,
    Triton's KServe HTTP and gRPC beside it, its metrics at :attr:`metrics_url` on the same port
    (no metrics port). ``load_models`` must be models that take the frontend's tensors
    (:func:`~labkit.server.frontend.plan_frontend`); the image defaults to NGC's vLLM image
    unless ``image=`` or ``LABKIT_TRITON_IMAGE`` names another, and ``extra_args`` go to the
    frontend's ``main.py``.

    ``gpus`` (docker mode): ``--gpus all`` or not; None (the default) passes it where the NVIDIA
    driver lists a GPU and the Docker engine has NVIDIA's runtime (:func:`engine_gives_gpus`):
    without them, ``docker run --gpus all`` fails.

    In docker mode (with or without the frontend) a model whose config names a
    ``labkit_environment`` runs on the image's own Python: its ``EXECUTION_ENV_PATH`` names a
    virtualenv of this checkout (``.venv-vllm``, vLLM's CPU build), which the container neither
    mounts nor could run. Such a model is refused before any container starts unless the image
    imports the environment's package (``vllm``: Triton's vLLM image has it, the lab's image
    does not). Where it does, the container reads a copy of that model's config without the
    parameter, mounted over the repository's own (:meth:`container_configs`); the repository
    itself is never changed, and every other file of it stays the live folder.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike = "model_repository",
        *,
        mode: str | None = None,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        tritonserver: str | os.PathLike | None = None,
        image: str | None = None,
        url: str | None = None,
        load_models: str | list[str] = "*",
        startup_timeout_s: float | None = None,
        stop_timeout_s: float = 20.0,
        log_path: str | os.PathLike | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cores: tuple[int, ...] | None = None,
        cache_size: int | None = None,
        openai_port: int | None = None,
        stall_s: float | None = STALL_S,
        gpus: bool | None = None,
    ) -> None:
        self.mode = server_mode(mode, "remote" if url else "local")
        if self.mode not in MODES:
            raise ServerError(f"unknown server mode {self.mode!r}; use one of {', '.join(MODES)}")
        self.model_repository = Path(model_repository).resolve()
        self.host = host
        self.image = triton_image(image)
        self.load_models = [load_models] if isinstance(load_models, str) else list(load_models)
        self.startup_timeout_s = startup_timeout_s_setting(startup_timeout_s)
        self.stop_timeout_s = stop_timeout_s
        self.stall_s = stall_s  # a local start idle this long is started again; None: never
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(env or {})
        self.cores = tuple(cores) if cores else None  # pinned to these CPU cores, stubs included
        if cache_size is not None and (isinstance(cache_size, bool) or int(cache_size) < 1):
            raise ServerError(
                f"cache_size={cache_size!r}: the response cache needs a size of 1 byte or more "
                "(for example 16777216 for 16 MiB); pass None for no cache"
            )
        self.cache_size = int(cache_size) if cache_size is not None else None
        self._explicit_binary = tritonserver
        self._binary: ServerBinary | None = None
        self._process: subprocess.Popen | None = None
        self._shm_regions: set[str] = set()  # the stubs' shared memory, removed by stop()
        self._container: str | None = None  # the container running now, for docker stop
        self._guard: subprocess.Popen | None = None  # removes it if this process dies first
        self._started = False  # ready once: stop() lets it unload before the container goes
        self._gpus = gpus  # None: decided by the host and its engine, when first needed
        self.container_name = _new_container_name()  # the next docker start's --name
        self._log_file = None
        self._pump: threading.Thread | None = None
        self.log_path = Path(log_path) if log_path else None
        self._requested_ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.frontend: OpenAIFrontend | None = None
        if openai_port is not None:
            self._plan_frontend(check_port(openai_port))
        self.ports = dict(self._requested_ports)
        if self.mode == "remote":
            if not url:
                raise ServerError("remote mode needs url=, for example url='http://host:8000'")
            self._remote = url.split("://", 1)[-1].rstrip("/")
            self.host, _, port = self._remote.rpartition(":")
            self.ports["http"] = int(port or 80)
        elif self.mode == "local" and not self.model_repository.is_dir():
            raise ServerError(
                f"model repository {str(self.model_repository)!r} does not exist; "
                "pass model_repository= a folder of models (see model_repository/ in the lab)"
            )

    def _plan_frontend(self, openai_port: int) -> None:
        """Check that the OpenAI frontend can serve what was asked; its ports replace metrics'."""
        if self.cache_size is not None:
            raise ServerError(
                "the OpenAI frontend's main.py has no response-cache option; drop cache_size "
                "(--cache-size) or serve without the frontend"
            )
        self.frontend = plan_frontend(self.model_repository, self.load_models, mode=self.mode)
        self.load_models = list(self.frontend.models)
        if self.image == DEFAULT_IMAGE:  # nothing named another: the NGC image that has vLLM
            self.image = ngc_image(flavour="vllm")
        self._requested_ports = {
            "http": self._requested_ports["http"],
            "grpc": self._requested_ports["grpc"],
            "openai": openai_port,
        }

    @property
    def gpus(self) -> bool:
        """Whether the docker command passes ``--gpus all`` (see the class's ``gpus``)."""
        if self._gpus is None:
            self._gpus = engine_gives_gpus()
        return self._gpus

    def image_refuses(self, models: list[str] | None = None) -> dict[str, str]:
        """Model -> why the image cannot run it, for each of ``models`` (default: those to
        load; ``*`` is every model) whose stub needs a lab environment the image lacks: the
        environment's package (``vllm``) does not import in it (:func:`image_imports`)."""
        if self.mode != "docker" or not self.model_repository.is_dir():
            return {}
        repo = Repository(self.model_repository)
        present = repo.models()
        wanted = self.load_models if models is None else models
        refused = {}
        for model in present if "*" in wanted else wanted:
            if model not in present or not _runs_in_lab_environment(repo, model):
                continue
            package = repo.config(model).parameters[ENVIRONMENT_PARAMETER].string_value
            if not image_imports(self.image, package):
                refused[model] = (
                    f"{model} runs its stub in this checkout's {ENVIRONMENTS.get(package, package)}"
                    f" ({package}), which a container can neither mount nor run, and the image "
                    f"{self.image} has no {package} to run it on the image's own Python; serve it "
                    f"with Triton's vLLM image (image={ngc_image(flavour='vllm')!r}, or "
                    "LABKIT_TRITON_IMAGE), or leave it out of the models to load"
                )
        return refused

    def _check_image(self) -> None:
        """Before a container starts: the image is here and holds what the models need."""
        require_image(self.image)  # missing, or without transformers: say how to build it
        refused = self.image_refuses()
        if refused:
            raise MissingDependencyError("; ".join(refused.values()))

    # -- addresses (http_url and grpc_url come from Addresses) -----------------------------
    @property
    def metrics_url(self) -> str:
        if self.frontend is not None:  # the frontend serves Triton's metrics on its own port
            return f"http://{self.client_host}:{self.ports['openai']}/metrics"
        return f"http://{self.client_host}:{self.ports['metrics']}/metrics"

    @property
    def openai_url(self) -> str | None:
        """The OpenAI API's base URL (``http://host:port/v1``); None without the frontend."""
        if self.frontend is None:
            return None
        return f"http://{self.client_host}:{self.ports['openai']}/v1"

    def __repr__(self) -> str:
        return f"TritonServer(mode={self.mode!r}, http={self.http_url!r}, running={self.running})"

    # -- commands --------------------------------------------------------------------------
    def server_args(self, repository: str | os.PathLike, address: str | None = None) -> list[str]:
        """The tritonserver arguments (without the executable) for this object's settings,
        bound to ``address`` (default: :attr:`host`)."""
        address = address or self.host
        args = [
            f"--model-repository={repository}",
            "--model-control-mode=explicit",
            *[f"--load-model={name}" for name in self.load_models],
            f"--http-address={address}",
            f"--grpc-address={address}",
            f"--metrics-address={address}",
            f"--http-port={self.ports['http']}",
            f"--grpc-port={self.ports['grpc']}",
            f"--metrics-port={self.ports['metrics']}",
            "--allow-metrics=true",
            "--allow-cpu-metrics=true",
            "--exit-timeout-secs=10",
        ]
        return args + self.extra_args

    def cache_args(self, cache_directory: str | os.PathLike | None) -> list[str]:
        """The response cache's arguments: none without :attr:`cache_size`; else the ``local``
        cache of that many bytes, its library looked for in ``cache_directory`` (None: Triton's
        default, ``/opt/tritonserver/caches``)."""
        if self.cache_size is None:
            return []
        args = [f"--cache-config=local,size={self.cache_size}"]
        if cache_directory is not None:
            args.append(f"--cache-directory={cache_directory}")
        return args

    def local_command(self) -> list[str]:
        binary = self.binary
        args = [str(binary.path), *self.server_args(self.model_repository)]
        args += self.cache_args(binary.cache_directory)
        if binary.backend_directory:
            args.insert(1, f"--backend-directory={binary.backend_directory}")
        return args

    def docker_command(self, name: str | None = None) -> list[str]:
        """The tutorial's ``docker run``; tokens go in as ``-e NAME`` so no value is on the line.

        Without ``name`` it is exactly the command :meth:`start` runs (or ran, once started):
        same container name (:attr:`container_name`), ports, mounts and image. The ports are
        published on :attr:`host` under the same numbers (the tutorial's ``--net=host`` would
        put the server on the host's own network, every interface of it unless told otherwise);
        inside, the server binds the container's interfaces (:data:`CONTAINER_ADDRESS`).
        ``--gpus all`` and ``--ulimit memlock=-1`` come with :attr:`gpus` only.
        """
        name = name or self.container_name
        # Pinned host memory is CUDA's: without a GPU the server pins none, and an engine whose
        # own hard limit is lower refuses memlock=-1 (this machine's: 8 MiB, no right to raise it)
        gpus = ["--gpus", "all"] if self.gpus else []
        memlock = ["--ulimit", "memlock=-1"] if self.gpus else []
        ports = [(port, port) for port in self.ports.values()]
        if self.host == "127.0.0.1":
            published = loopback_ports(*ports)
        else:
            published = [flag for port, _ in ports for flag in ("-p", f"{self.host}:{port}:{port}")]
        cmd = [
            "docker",
            "run",
            *gpus,
            "--rm",
            *published,
            "--shm-size=1G",
            *memlock,
            "--ulimit",
            "stack=67108864",
        ]
        if name:
            cmd += ["--name", name]
        if self.cores:
            cmd += ["--cpuset-cpus", ",".join(map(str, self.cores))]
        for var in token_variables_set():
            cmd += ["-e", var]
        hf_cache = "/root/.cache/huggingface"
        cmd += ["-e", f"HF_HOME={hf_cache}"]
        cmd += ["-v", f"{self.model_repository}:{CONTAINER_REPOSITORY}"]
        for model, copy in self.container_configs(name).items():  # over the host venv's path
            cmd += ["-v", f"{copy}:{CONTAINER_REPOSITORY}/{model}/{CONFIG_FILE}:ro"]
        host_cache = hf_home()  # HF_HOME, else ~/.cache/huggingface: weights are downloaded once
        host_cache.mkdir(parents=True, exist_ok=True)
        cmd += ["-v", f"{host_cache.resolve()}:{hf_cache}"]
        labkit_cache = cache_dir()
        cmd += ["-v", f"{labkit_cache}:{labkit_cache}:ro"]  # local weights are linked from here
        if self.frontend is not None:
            cmd += [self.image, *self.frontend_args()]
            return cmd
        cmd += [
            self.image,
            "tritonserver",
            *self.server_args(CONTAINER_REPOSITORY, CONTAINER_ADDRESS),
        ]
        cmd += self.cache_args(CONTAINER_CACHES)
        return cmd

    def container_configs(self, name: str | None = None) -> dict[str, Path]:
        """Model -> the file the container ``name`` (default: :attr:`container_name`) reads as
        its ``config.pbtxt``, for each model of the repository whose config names a
        ``labkit_environment``: the model's config without ``EXECUTION_ENV_PATH``, so its stub
        runs on the image's own Python (and vLLM) instead of failing to find this checkout's
        virtualenv. Written by :meth:`start`, rewritten by :meth:`load_model` (a reload sees the
        repository's edits), removed by :meth:`stop`; nothing is written here."""
        if self.mode != "docker" or not self.model_repository.is_dir():
            return {}
        folder = _configs_folder(name or self.container_name)
        repo = Repository(self.model_repository)
        return {
            model: folder / model / CONFIG_FILE
            for model in repo.models()
            if _runs_in_lab_environment(repo, model)
        }

    def _write_container_configs(self) -> list[str]:
        """Write :meth:`container_configs` from the repository's configs as they are now, for
        the container about to start or running. A file is rewritten in place: a bind mount
        holds the file itself, so a new file would not reach the container."""
        repo = Repository(self.model_repository)
        written = []
        for model, copy in self.container_configs().items():
            cfg = repo.config(model)
            del cfg.parameters[EXECUTION_ENV_PATH]
            copy.parent.mkdir(parents=True, exist_ok=True)
            with open(copy, "w", encoding="utf-8") as file:  # same inode: see above
                file.write(config_to_text(cfg))
            written.append(model)
        return written

    def frontend_args(self) -> list[str]:
        """The OpenAI frontend's command in the container (``python3 main.py ...``)."""
        args = self.frontend.command(
            CONTAINER_REPOSITORY,
            host=CONTAINER_ADDRESS,
            openai_port=self.ports["openai"],
            kserve_http_port=self.ports["http"],
            kserve_grpc_port=self.ports["grpc"],
        )
        return args + self.extra_args

    @property
    def binary(self) -> ServerBinary:
        if self._binary is None:
            self._binary = locate_tritonserver(self._explicit_binary)
        return self._binary

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> TritonServer:
        """Start (or attach) and wait until the server and its models are ready."""
        if self.mode == "remote":
            self.wait_ready()
            return self
        if self.running:
            return self
        picked = all(port == 0 for port in self._requested_ports.values())
        aborted = stalled = False
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once()
            except StalledStartError as exc:
                # Seen once, in CI: Triton 2.51 stopped moving after every stub of a model had
                # initialised (labkit.server.stall). Start once more; a second stall is the user's.
                if stalled or attempt == PORT_ATTEMPTS:
                    raise
                stalled = True
                log.warning("%s; starting it again", str(exc).split("\n", 1)[0])
            except PortInUseError:
                # A free port was taken by another process between our pick and Triton's bind
                # (a busy machine starts kernels and servers all the time): pick again.
                if not picked or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("a port picked for tritonserver was taken before it bound; retrying")
            except ServerError as exc:
                # Triton 2.51 can abort while its Python backend starts a stub on a loaded host
                # ('terminate called after throwing ... boost::interprocess::lock_exception',
                # status -6): seen in fresh clones' make test, never twice in a row. Start once
                # more; any other failure, or a second abort, is the user's to see.
                if aborted or STARTUP_ABORT not in str(exc) or attempt == PORT_ATTEMPTS:
                    raise
                aborted = True
                log.warning(
                    "tritonserver aborted while starting (%s); starting it again", STARTUP_ABORT
                )
        raise AssertionError("unreachable")  # the loop returns or raises

    def _start_once(self) -> TritonServer:
        self._choose_ports()
        if self.mode == "local":
            cmd = self.local_command()
            env = {**os.environ, **self.binary.env, **self.extra_env}
        else:
            self._check_image()
            self._container = self.container_name
            cmd = self.docker_command()
            env = {**os.environ, **self.extra_env}
        if self.log_path is None:  # made once there is a command: a refused start leaves no file
            self.log_path = Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.command = cmd
        log.info("starting %s", redact(" ".join(cmd)))
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        secrets = [env[n].encode() for n in TOKEN_VARIABLES if len(env.get(n) or "") >= 4]
        try:
            if self.mode == "docker":
                self._guard = _guard_container(self._container)  # before the container exists
                for model in self._write_container_configs():
                    log.info(
                        "%s runs on the image's own Python: the container reads its config "
                        "without EXECUTION_ENV_PATH (a virtualenv of this checkout)",
                        model,
                    )
            self._process = spawn(
                cmd,
                cores=self.cores if self.mode == "local" else None,
                stdout=subprocess.PIPE if secrets else self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except FileNotFoundError as exc:
            self._close_log()
            self._remove_container()
            raise MissingDependencyError(f"cannot run {cmd[0]!r}: {exc}") from exc
        except BaseException:  # interrupted while the launcher started it: spawn ended it
            self._close_log()
            self._remove_container()
            raise
        if secrets:  # a token is set: the log goes through a filter that blanks it out
            self._pump = threading.Thread(
                target=_copy_redacted,
                args=(self._process.stdout, self._log_file, secrets),
                name="tritonserver-log",
                daemon=True,
            )
            self._pump.start()
        _LIVE.add(self)
        try:
            self.wait_ready()
        except BaseException:
            self._started = False  # nothing to unload gracefully: its container goes at once
            self.stop()
            raise
        self._started = True
        return self

    def _choose_ports(self) -> None:
        """The ports asked for (each checked free), then a free one for each asked as 0, apart
        from each other and from those asked for (:func:`labkit.proc.free_ports`)."""
        chosen = {kind: port for kind, port in self._requested_ports.items() if port != 0}
        if len(set(chosen.values())) != len(chosen):
            raise ServerError(f"the {', '.join(chosen)} ports must differ, got {chosen}")
        for kind, port in chosen.items():
            check_port_free(
                port,
                self.host,
                what=f"{kind} port",
                fix=f"pass {kind}_port=0 (labkit serve --{kind}-port 0) to pick a free one",
            )
        host = self.host if self.host != "0.0.0.0" else "127.0.0.1"
        to_pick = [kind for kind, port in self._requested_ports.items() if port == 0]
        picked = free_ports(len(to_pick), host, avoid=set(chosen.values()))
        chosen.update(zip(to_pick, picked, strict=True))
        self.ports = {kind: chosen[kind] for kind in self._requested_ports}

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll every endpoint this server was asked to open until all answer, against one deadline.

        Ready means: ``/v2/health/ready`` answers 200, every model named in ``load_models`` is
        ready, and, for a server this object started, gRPC answers and the metrics endpoint
        serves. Triton opens HTTP before its metrics service (about 40 ms apart), so HTTP
        readiness alone would let a caller read metrics from a port that is not listening yet.
        """
        bound = timeout_s or self.startup_timeout_s
        waiting_for: str | None = None
        # a local server's tree is visible here (docker's is the engine's, remote's elsewhere)
        local = self._process is not None and self.mode == "local" and self.stall_s
        watch = (
            StallWatch(self._process.pid, self.log_path, stall_s=self.stall_s) if local else None
        )

        def ready() -> bool:
            nonlocal waiting_for
            if self._process is not None:
                self._shm_regions.update(_shm_regions(self._process.pid))
                if self._process.poll() is not None:
                    self._raise_exited()
            waiting_for = self.not_ready()
            if waiting_for is not None and watch is not None and watch.stalled():
                self._raise_stalled(watch, waiting_for)
            return waiting_for is None

        if not wait_until(ready, bound, 0.05, max_interval_s=1.0):
            raise ServerTimeoutError(
                f"Triton at {self.http_url} was not ready within {bound:g} s (still waiting "
                f"for {waiting_for}); pass startup_timeout_s= a larger bound if models are "
                f"large.\n{self.log_tail()}"
            )

    def is_ready(self) -> bool:
        """Whether every endpoint and requested model is ready now (see :meth:`wait_ready`)."""
        return self.not_ready() is None

    def not_ready(self) -> str | None:
        """The first endpoint or model that is not ready yet, in words; None when all are."""
        if not http_ok(f"http://{self.http_url}/v2/health/ready"):
            return f"HTTP readiness at http://{self.http_url}/v2/health/ready"
        for name in self.load_models:
            if name != "*" and not http_ok(f"http://{self.http_url}/v2/models/{name}/ready"):
                return f"model {name!r}"
        if self.mode == "remote":
            return None  # only the HTTP address of a remote server is known
        if not _grpc_ready(self.grpc_url):
            return f"gRPC at {self.grpc_url}"
        if self.frontend is not None:  # it opens KServe first, then its own port
            ready = f"http://{self.client_host}:{self.ports['openai']}/health/ready"
            return None if http_ok(ready) else f"the OpenAI frontend at {ready}"
        if "--allow-metrics=false" not in self.extra_args and not http_ok(self.metrics_url):
            return f"metrics at {self.metrics_url}"
        return None

    def _raise_stalled(self, watch: StallWatch, waiting_for: str) -> None:
        text = ""
        if self.log_path and self.log_path.exists():
            text = self.log_path.read_bytes()[-256_000:].decode("utf-8", "replace")
        stuck = models_still_loading(text)
        raise StalledStartError(
            f"tritonserver stopped moving while starting: for {watch.idle_for_s():.0f} s it "
            f"wrote no log line and it and its stubs spent under {watch.idle_cpu_s:g} s of CPU"
            + (f", with {', '.join(map(repr, stuck))} still loading" if stuck else "")
            + f" (still waiting for {waiting_for})\n{self.log_tail()}"
        )

    def _raise_exited(self) -> None:
        code = self._process.returncode
        self._drain_log()
        text = self.log_tail()
        for kind, port in self.ports.items():
            if f":{port}" in text and ("in use" in text.lower() or "bind" in text.lower()):
                raise PortInUseError(
                    f"{kind} port {port} was taken before Triton could bind it; "
                    f"pass {kind}_port=0 to pick a free one.\n{text}"
                )
        raise ServerError(f"tritonserver exited with status {code} before it was ready.\n{text}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, tokens redacted."""
        if not self.log_path or not self.log_path.exists():
            return "(no server log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 64_000))
            data = f.read().decode("utf-8", "replace")
        return "server log (last lines):\n" + redact(tail(data, lines))

    def stop(self) -> None:
        """Stop the server and everything it started. Safe to call twice, or never started."""
        process, self._process = self._process, None
        if process is None:
            self._remove_container()  # a start interrupted before the client ran, if any
            return
        if self._container:
            self._remove_container(process)
        regions = sorted(self._shm_regions.union(_tree_shm(process.pid)))
        self._shm_regions = set()
        if process.poll() is None:
            loaded = self._loaded_versions()
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not _wait_exit(process, self.log_path, log_start, loaded, self.stop_timeout_s):
                log.warning(
                    "tritonserver did not stop within %s s; killing it", self.stop_timeout_s
                )
        kill_group(process.pid, signal.SIGKILL)  # stubs left behind by the server, if any
        process.wait()
        wait_group_gone(process.pid, timeout_s=5.0)
        _remove_files(regions)  # a killed stub or server leaves its shared memory behind
        self._drain_log()
        self._close_log()
        _LIVE.discard(self)

    def _remove_container(self, client: subprocess.Popen | None = None) -> None:
        """Stop and remove this object's container (if it has one now), and end its guard.

        For a server that was ready, ``docker stop`` gives it its exit timeout (10 s) to unload;
        the ``docker run`` ``client`` then ends once ``--rm`` has removed the container. ``docker
        rm -f`` removes what is left in any case: the container of a failed or interrupted start
        (a model still loading has nothing to unload), one whose client died, or one that
        another start's failure left created."""
        name, self._container = self._container, None
        if name is None:
            return
        bound = self.stop_timeout_s + 10
        if client is not None and client.poll() is None and self._started:
            _docker("stop", "-t", "10", name, timeout_s=bound)
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("docker run of %s did not end after docker stop; removing it", name)
        _docker("rm", "-f", name, timeout_s=bound)
        shutil.rmtree(_configs_folder(name), ignore_errors=True)
        guard, self._guard = self._guard, None
        if guard is not None:
            _release_guard(guard)
        self.container_name = _new_container_name()  # a restart gets a fresh name

    def _loaded_versions(self) -> set[tuple[str, str]] | None:
        """(name, version) of every model the server holds now, or None when it does not say.

        Asked just before SIGTERM (the HTTP endpoint closes at once on it), so that the stop can
        tell Triton's last real unload from the wait for a version that never loaded. Asked over
        gRPC: Triton's shutdown waits a second for any HTTP connection it still counts, and one
        just closed can still be counted."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415 (see _grpc_ready)

        try:
            with grpcclient.InferenceServerClient(self.grpc_url) as client:
                index = client.get_model_repository_index(as_json=True, client_timeout=2)
        except (InferenceServerException, OSError):  # wedged or dying: Triton's own timeout
            return None
        return {
            (m.get("name"), m.get("version"))
            for m in index.get("models", [])
            if m.get("state") in _HELD_STATES
        }

    def _drain_log(self) -> None:
        """Let the log filter write what the server printed last (its pipe ends with the server)."""
        if self._pump is not None:
            self._pump.join(timeout=5)
            if not self._pump.is_alive():
                self._pump = None

    def _close_log(self) -> None:
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            self.stop()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    # -- live model control (explicit mode) ------------------------------------------------
    def client(self):
        """A ``tritonclient.http.InferenceServerClient`` for this server; use it in a ``with``:
        Triton's shutdown waits its whole exit timeout (10 s) for any HTTP connection still open,
        and an exception's traceback keeps an unclosed client's connection alive."""
        import tritonclient.http as httpclient  # noqa: PLC0415 (each protocol's client pulls its own network stack; load the one in use)

        return httpclient.InferenceServerClient(self.http_url, network_timeout=600.0)

    def load_model(self, name: str, config: str | None = None) -> None:
        """Load (or reload) ``name``; raises with Triton's reason when it fails."""
        if self.mode == "docker":
            refused = self.image_refuses([name])
            if refused:
                raise MissingDependencyError(refused[name])
        if self.mode == "docker" and self.running:  # the container reads copies of some configs
            self._write_container_configs()  # with the edits made since: a reload sees them
        try:
            with self.client() as client:
                client.load_model(check_name(name), config=config)
        except InferenceServerException as exc:
            raise ServerError(
                f"Triton could not load model {name!r}: {redact(exc.message())}"
            ) from exc

    def unload_model(self, name: str, *, timeout_s: float = 60.0) -> None:
        """Unload ``name`` and wait until Triton has let it go (its unload API returns at once,
        while the model's instances are still finishing)."""
        try:
            with self.client() as client:
                client.unload_model(check_name(name))
        except InferenceServerException as exc:
            raise ServerError(
                f"Triton could not unload model {name!r}: {redact(exc.message())}"
            ) from exc
        state = None

        def unloaded() -> bool:
            nonlocal state
            state = {row["name"]: row.get("state", "") for row in self.model_index()}.get(name)
            return state not in ("READY", "UNLOADING")

        if not wait_until(unloaded, timeout_s):
            raise ServerTimeoutError(
                f"model {name!r} was still {state} {timeout_s:g} s after the unload request; a "
                "request in flight may hold it; pass timeout_s= a larger bound"
            )

    def model_index(self) -> list[dict]:
        """The repository index: each model's name, version, state and reason."""
        with self.client() as client:
            return client.get_model_repository_index()


@functools.cache
def engine_gives_gpus() -> bool:
    """Whether ``docker run --gpus all`` can work here: the NVIDIA driver lists a GPU, and the
    Docker engine has NVIDIA's runtime (``nvidia`` among ``docker info``'s runtimes, or the
    NVIDIA Container Toolkit's hook on ``PATH``). Asked once per process."""
    if not has_gpu():
        return False
    if shutil.which("nvidia-container-runtime-hook"):
        return True
    try:
        runtimes = _docker("info", "--format", "{{json .Runtimes}}", timeout_s=30).stdout
    except OSError:
        return False
    return "nvidia" in runtimes


#: (image, package) -> whether the package imports in the image (a ``docker run`` each).
_IMPORTS: dict[tuple[str, str], bool] = {}


def image_imports(image: str, package: str) -> bool:
    """Whether ``package`` is importable by the Python of ``image`` (asked once per process);
    an image that is not here, or an engine that does not answer, raises as
    :func:`~labkit.server.image.require_image` does."""
    if (image, package) not in _IMPORTS:
        check = f"import importlib.util as u; print(u.find_spec({package!r}) is not None)"
        done = _docker(
            "run", "--rm", "--pull", "never", "--entrypoint", "python3", image, "-c", check,
            timeout_s=180,
        )  # fmt: skip
        answer = done.stdout.strip().splitlines()[-1:]
        if done.returncode != 0 or answer not in (["True"], ["False"]):
            require_image(image)  # not here, no engine, no Python: its own sentence
            raise ServerError(
                f"could not ask image {image} for {package}: {tail(done.stderr.strip(), 5)}"
            )
        _IMPORTS[(image, package)] = answer == ["True"]
    return _IMPORTS[(image, package)]


def _docker(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``docker ARGS``, its output captured; a failure is the caller's to judge (no raise)."""
    try:
        return subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        log.warning("docker %s did not answer within %g s", args[0], timeout_s)
        return subprocess.CompletedProcess(["docker", *args], 124, "", "")


#: The guard's script: a line on its stdin (written by ``stop``) ends it quietly; end of file
#: (every writer gone: the process that started the container died) removes the container,
#: twice, in case the dying ``docker run`` had asked for it just before.
_GUARD_SCRIPT = 'read line || { docker rm -f "$0"; sleep 5; docker rm -f "$0"; } >/dev/null 2>&1'


def _guard_container(name: str) -> subprocess.Popen:
    """A shell in a session of its own that removes container ``name`` once this process dies.

    ``docker run`` gets SIGTERM when this process dies (:func:`labkit.proc.spawn`) and passes it
    to the server, and ``--rm`` removes the stopped container. That chain breaks where the client
    dies before it forwards signals (killed at the container's start) or is killed itself; the
    guard holds only a pipe whose write end this process alone keeps, so the kernel's end of it
    is the signal. Not started with :func:`~labkit.proc.spawn`: it must outlive this process."""
    return subprocess.Popen(
        ["sh", "-c", _GUARD_SCRIPT, name],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _release_guard(guard: subprocess.Popen) -> None:
    """End a guard whose container is already removed, without it removing anything."""
    try:
        guard.stdin.write(b"stopped\n")
        guard.stdin.close()
        guard.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        guard.kill()
        guard.wait()


def _new_container_name() -> str:
    return f"labkit-{uuid.uuid4().hex[:10]}"


def _configs_folder(container: str) -> Path:
    """Where the configs that container ``container`` reads instead of the repository's are."""
    return Path(tempfile.gettempdir()) / f"{container}-configs"


def _runs_in_lab_environment(repo: Repository, model: str) -> bool:
    """Whether ``model``'s stub is pointed at one of this checkout's Python environments."""
    parameters = repo.config(model).parameters
    return ENVIRONMENT_PARAMETER in parameters and EXECUTION_ENV_PATH in parameters


def _grpc_ready(address: str) -> bool:
    """Whether Triton's gRPC service at ``address`` answers ServerReady with true."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415 (grpc is heavy; only a started server needs it)

    try:
        with grpcclient.InferenceServerClient(address) as client:
            return bool(client.is_server_ready(client_timeout=2))
    except (InferenceServerException, OSError):
        return False


SHM_PREFIX = "/dev/shm/triton_python_backend_shm_region_"
#: Python's multiprocessing.shared_memory segments, which a model's engine may make: vLLM's
#: message queues between its engine and its workers (160-240 MiB each). An engine killed with
#: its server leaves them behind: one notebook 06 run left 240 MiB in /dev/shm.
ENGINE_SHM_PREFIX = "/dev/shm/psm_"


def _mapped(pid: int, prefixes: tuple[str, ...]) -> set[str]:
    """The files under ``prefixes`` that process ``pid`` has mapped (not those unlinked)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line}
    except OSError:
        return set()
    return {path for path in paths if path.startswith(prefixes) and " " not in path}


def _shm_regions(pid: int) -> list[str]:
    """The Python-backend shared-memory files that process ``pid`` has mapped."""
    return sorted(_mapped(pid, (SHM_PREFIX,)))


def _tree_shm(pid: int) -> list[str]:
    """The Python-backend regions and engine segments mapped by ``pid`` or any process under it
    (its stubs, and the engines they start)."""
    try:
        tree = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        tree = [pid]
    found: set[str] = set()
    for member in tree:
        found |= _mapped(member, (SHM_PREFIX, ENGINE_SHM_PREFIX))
    return sorted(found)


def _copy_redacted(stream, sink, secrets: list[bytes]) -> None:
    """Copy the server's output to its log, line by line, with every secret replaced by ***."""
    try:
        for line in iter(stream.readline, b""):
            for secret in secrets:
                line = line.replace(secret, b"***")
            sink.write(line)
            sink.flush()
    except (OSError, ValueError):  # the log was closed by stop() while a straggler still wrote
        pass
    finally:
        stream.close()


#: Index states of a version the server holds, and so unloads on its way out.
_HELD_STATES = {"READY", "LOADING", "UNLOADING"}

_UNLOADED = re.compile(rb"successfully unloaded '([^']+)' version (\d+)")
_LIVE_COUNT = re.compile(rb"Found (\d+) live models")


def _wait_exit(
    process: subprocess.Popen,
    log_path: Path,
    log_start: int,
    loaded: set[tuple[str, str]] | None,
    timeout_s: float,
) -> bool:
    """Wait (bounded) for a SIGTERMed tritonserver to end its shutdown; False when ``timeout_s``
    passed first. True means it exited, or it waits only for versions that never loaded.

    Triton 2.51 counts a version whose reload failed as a live model that never unloads, so its
    shutdown waits its whole exit timeout (10 s) for nothing. Once the log shows every version it
    held (``loaded``) unloaded and Triton still counting live models after that, only such
    versions are left: the wait ends there and the caller kills the process group."""

    def ended() -> bool:
        try:
            process.wait(timeout=0.2)  # the poll's pause
            return True
        except subprocess.TimeoutExpired:
            pass
        if loaded is not None and _only_failed_versions_left(log_path, log_start, loaded):
            log.debug("tritonserver waits only for versions that never loaded; ending it")
            return True
        return False

    return wait_until(ended, timeout_s, 0)


def _only_failed_versions_left(path: Path, start: int, loaded: set[tuple[str, str]]) -> bool:
    """Whether the log since ``start`` has every version of ``loaded`` unloaded, then a live-model
    count above zero."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read()
    except OSError:
        return False
    unloads = list(_UNLOADED.finditer(text))
    if not loaded <= {(m[1].decode(), m[2].decode()) for m in unloads}:
        return False
    last_unload = unloads[-1].end() if unloads else 0
    counts = [int(m[1]) for m in _LIVE_COUNT.finditer(text, last_unload)]
    return bool(counts) and counts[-1] > 0


def _remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
            log.debug("removed leftover shared memory %s", path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove leftover shared memory %s: %s", path, exc)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()
