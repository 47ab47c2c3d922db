"""The docker mode's image: build the lab's image from ``docker/Dockerfile``, and check an image.

The tutorial's step 2 is ``docker build -t triton_transformer_server .`` from a Dockerfile that
adds ``transformers`` to an NGC ``tritonserver`` image; the plain NGC image has none, so every
text model fails to load in it. ``docker/Dockerfile`` is that image for the lab (NGC
:data:`~labkit.settings.TRITON_RELEASE`, plus what the lab's ``model.py`` files import, pinned in
``docker/requirements.txt``).

- :func:`build_command` is the ``docker build`` that ``labkit image build`` shows and runs
  (:func:`build`); ``day_zero=`` builds the tutorial's "Day Zero" variant, transformers from
  source at a git ref; ``base=`` builds FROM another image laid out as NGC's, such as the CPU
  stand-in of :mod:`labkit.server.base_image`, with the host's pip settings served to the build
  (:mod:`labkit.server.pip_server`);
- :func:`inspect_image` asks Docker whether an image exists and what its Python imports
  (``docker image inspect``, then a one-line ``docker run ... python3 -c``);
- :func:`require_image` is what the docker mode calls before it starts a container: it raises
  with the command that builds the image when the image is missing or has no transformers.

Triton's own vLLM image (``nvcr.io/nvidia/tritonserver:<yy.mm>-vllm-python-py3``) is the other
image the docker mode offers: it ships vLLM and Triton's ``vllm`` backend, so it needs no build.
That backend reads no ``model.py``: a model is ``config.pbtxt`` with ``backend: "vllm"`` and
``<version>/model.json`` holding vLLM's engine arguments (``AsyncEngineArgs`` fields), which
:func:`write_vllm_backend_model` writes and :func:`check_engine_args` checks.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from labkit import proc
from labkit.errors import ConfigError, MissingDependencyError, MissingFileError, ToolError
from labkit.repository import config_to_text, parse_config, validate
from labkit.server import pip_server
from labkit.server.base_image import BASE_IMAGE
from labkit.server.docker import require_client, require_daemon
from labkit.settings import DEFAULT_IMAGE, TRITON_RELEASE, project_root

log = logging.getLogger(__name__)

#: ``docker build``'s context: the Dockerfile and the requirements it copies, nothing else.
DOCKER_DIR = project_root() / "docker"
LAB_IMAGE_NAME = "triton_transformer_server"
#: The lab's image built on the CPU stand-in for NGC's (``labkit image build --base``
#: :data:`~labkit.server.base_image.BASE_IMAGE`): the image the docker mode runs on a host without
#: NGC's registry or a GPU. A build on a base is tagged with the base's tag.
ON_STAND_IN = f"{LAB_IMAGE_NAME}:{BASE_IMAGE.rpartition(':')[2]}"
DAY_ZERO_ARG = "TRANSFORMERS_REF"

#: Run inside the image: what the lab's model code imports, as one JSON line.
_PROBE = """
import json, sys
found = {"python": sys.version.split()[0]}
for name in ("numpy", "torch", "transformers"):
    try:
        found[name] = __import__(name).__version__
    except Exception as exc:
        found[name] = None
        found[name + "_error"] = f"{type(exc).__name__}: {exc}"
if found["torch"]:
    import torch
    found["torch_cuda"] = torch.version.cuda
print("labkit-probe " + json.dumps(found))
"""
_PROBE_MARK = "labkit-probe "


@dataclass(frozen=True)
class ImageInfo:
    """What :func:`inspect_image` found in an image."""

    image: str
    id: str
    python: str | None = None
    numpy: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None  # None: a CPU-only torch build
    transformers: str | None = None
    problem: str = ""  # why a package would not import, if one would not


def build_command(
    tag: str | None = None,
    *,
    release: str | None = None,
    day_zero: str | None = None,
    torch_index_url: str | None = None,
    base: str | None = None,
    docker_dir: str | os.PathLike | None = None,
) -> list[str]:
    """The ``docker build`` of the lab's image.

    ``tag`` defaults to the docker mode's default image, ``triton_transformer_server:<release>``;
    ``release`` is the NGC release to build FROM (default :data:`~labkit.settings.TRITON_RELEASE`);
    ``day_zero`` a transformers git ref (``main``, a tag or a commit) to build from source;
    ``torch_index_url`` the pip index of the torch CUDA build to install; ``base`` another image
    to build FROM instead of NGC's (the tag then defaults to ``triton_transformer_server:<the
    base's tag>``, e.g. ``:2.51-cpu`` on the stand-in). A build on ``base`` runs with
    ``--network host``: pip in it reaches the indexes and :func:`build`'s pip settings there (a
    bridged build has no route out where the engine runs without iptables).
    """
    folder = Path(docker_dir) if docker_dir else DOCKER_DIR
    if not (folder / "Dockerfile").is_file():
        raise MissingFileError(
            f"no Dockerfile in {str(folder)!r}; run labkit image build from a checkout of "
            "triton-labkit (its docker/ folder holds the lab's Dockerfile)"
        )
    release = release or TRITON_RELEASE
    if tag is None and base:
        tag = f"{LAB_IMAGE_NAME}:{base.rpartition(':')[2] if ':' in base else 'latest'}"
    elif tag is None:
        tag = DEFAULT_IMAGE if release == TRITON_RELEASE else f"{LAB_IMAGE_NAME}:{release}"
    folder = _shown(folder)
    # --force-rm: a failed step's container goes too (the classic builder keeps it otherwise)
    cmd = ["docker", "build", "-t", tag, "--force-rm", "-f", str(folder / "Dockerfile")]
    if base:
        cmd += ["--network", "host", "--build-arg", f"BASE_IMAGE={base}"]
    if release != TRITON_RELEASE:
        cmd += ["--build-arg", f"TRITON_RELEASE={release}"]
    if day_zero:
        cmd += ["--build-arg", f"{DAY_ZERO_ARG}={day_zero}"]
    if torch_index_url:
        cmd += ["--build-arg", f"TORCH_INDEX_URL={torch_index_url}"]
    return [*cmd, str(folder)]


#: The tutorial's step-2 Dockerfile (triton-inference-server/tutorials,
#: Quick_Deploy/HuggingFaceTransformers/Dockerfile), as facts: the image it builds FROM and the
#: packages its one ``RUN pip install`` line pins. torch is not among them: accelerate pulls in
#: whichever torch PyPI has that day.
TUTORIAL_BASE_IMAGE = "nvcr.io/nvidia/tritonserver:23.12-py3"
TUTORIAL_PINS = {
    "transformers": "4.34.0",
    "protobuf": "3.20.3",
    "sentencepiece": "0.1.99",
    "accelerate": "0.23.0",
    "einops": "0.6.1",
}


def compare_with_tutorial(docker_dir: str | os.PathLike | None = None):
    """The tutorial's Dockerfile beside the lab's, as a table: the base image, the Hugging Face
    cache, the Day Zero variant, and every package either pins (``-`` where one does not).

    The lab's side is read from ``docker/Dockerfile`` and ``docker/requirements.txt``.
    """
    import pandas as pd  # noqa: PLC0415 (a notebook's table)

    folder = Path(docker_dir) if docker_dir else DOCKER_DIR
    dockerfile = (folder / "Dockerfile").read_text(encoding="utf-8")
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", dockerfile, re.MULTILINE))
    base = re.search(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    if base is None:
        raise ConfigError(f"{folder / 'Dockerfile'} has no FROM line")
    ours_base = base[1]
    for _ in range(len(args)):  # an ARG's default may name another ARG (BASE_IMAGE, the release)
        ours_base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), ours_base)
    pins = dict(
        re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", (folder / "requirements.txt").read_text(),
                   re.MULTILINE)
    )  # fmt: skip
    if "TORCH_VERSION" in args:
        pins["torch"] = args["TORCH_VERSION"]
    cache = "HF_HOME (ENV in the image)" if "HF_HOME=" in dockerfile else "not set"
    rows = [
        ("base image", TUTORIAL_BASE_IMAGE, ours_base),
        ("Hugging Face cache", "TRANSFORMERS_CACHE, set in model.py", cache),
        (
            "Day Zero transformers",
            "edit the RUN line: pip install git+https://github.com/huggingface/transformers.git",
            f"--build-arg {DAY_ZERO_ARG}=<git ref>" if DAY_ZERO_ARG in args else "not offered",
        ),
    ]
    names = sorted(set(TUTORIAL_PINS) | set(pins), key=str.lower)
    rows += [(n, TUTORIAL_PINS.get(n, "-"), pins.get(n, "-")) for n in names]
    return pd.DataFrame(rows, columns=["what", "the tutorial's Dockerfile", "docker/Dockerfile"])


def _shown(folder: Path) -> Path:
    """``folder`` relative to the current folder when it is inside it (``docker``), else as is."""
    try:
        return folder.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return folder


def build(command: list[str], *, timeout_s: float = 3600.0, stdout=None) -> None:
    """Run a :func:`build_command`; its output goes to ``stdout`` (default: this process's
    terminal), as it comes.

    A build on NGC's image pulls a multi-GB base and installs torch: minutes, not seconds. A
    build on another base (``--network host`` in the command) gets the host's pip settings
    (its local wheel folders and certificate bundle, :mod:`labkit.server.pip_server`) as
    ``HOST_PIP_URL`` for its length. It runs on Docker's classic builder (``DOCKER_BUILDKIT=0``): the Dockerfile needs
    nothing of BuildKit's, and a BuildKit without the buildx plugin refuses to build. Raises
    :class:`ToolError` naming the command when the build fails.
    """
    require_client()
    require_daemon()
    settings = pip_server.host_pip() if "--network" in command else pip_server.HostPip()
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    with pip_server.serving(settings) as url:
        if url:
            command = [*command[:-1], "--build-arg", f"HOST_PIP_URL={url}", command[-1]]
        log.info("running %s", shlex.join(command))
        try:
            done = subprocess.run(
                command, check=False, timeout=timeout_s, stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=subprocess.STDOUT if stdout else None, env=env,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ToolError(
                f"docker build ran past {timeout_s:g} s: {shlex.join(command)}"
            ) from None
    if done.returncode != 0:
        raise ToolError(
            f"docker build exited with status {done.returncode} (its output is above): "
            f"{shlex.join(command)}"
        )


def inspect_image(image: str, *, timeout_s: float = 180.0) -> ImageInfo | None:
    """What ``image`` holds, or None when Docker has no such image here (nothing is pulled)."""
    require_client()
    require_daemon()
    found = proc.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", image], timeout_s=60, check=False
    )
    if found.returncode != 0:
        message = (found.stderr or found.stdout).strip()
        if "no such image" in message.lower():
            return None
        raise ToolError(
            f"docker image inspect {image} failed: {message or 'no output'}; start the Docker "
            "engine (or use the local mode, which needs no Docker)"
        )
    image_id = found.stdout.strip()
    if image_id in _CHECKED:
        return _CHECKED[image_id]
    ran = proc.run(
        ["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", _PROBE],
        timeout_s=timeout_s,
        check=False,
    )
    line = next((ln for ln in ran.stdout.splitlines() if ln.startswith(_PROBE_MARK)), None)
    if line is None:
        reason = proc.tail((ran.stderr or ran.stdout).strip(), 5) or f"status {ran.returncode}"
        info = ImageInfo(image, image_id, problem=f"python3 did not run in the image: {reason}")
    else:
        values = json.loads(line.removeprefix(_PROBE_MARK))
        problems = [values[k] for k in sorted(values) if k.endswith("_error")]
        info = ImageInfo(
            image,
            image_id,
            python=values.get("python"),
            numpy=values.get("numpy"),
            torch=values.get("torch"),
            torch_cuda=values.get("torch_cuda"),
            transformers=values.get("transformers"),
            problem="; ".join(problems),
        )
    _CHECKED[image_id] = info
    return info


_CHECKED: dict[str, ImageInfo] = {}


def require_image(image: str) -> ImageInfo:
    """Check that ``image`` exists here and imports transformers and torch; else say how to fix.

    The docker mode calls this before ``docker run``, so a missing or plain NGC image is an
    error that names the build command, not a server whose every text model fails to load.
    """
    info = inspect_image(image)
    try:
        shown = f" (runs: {shlex.join(build_command())})"
    except MissingFileError:  # installed without the checkout's docker/ folder
        shown = ""
    fix = f"build the lab's image with `labkit image build`{shown}"
    if image != DEFAULT_IMAGE:
        fix += f" and use it: {DEFAULT_IMAGE} is the docker mode's default when neither image= nor LABKIT_TRITON_IMAGE names another"
    if info is None:
        pull = (
            "" if image == DEFAULT_IMAGE else f"`docker pull {image}` if it is a remote image, or "
        )
        on_cpu = ON_STAND_IN
        stand_in = (
            ""
            if image == on_cpu
            else f"; on a host without NGC's registry or a GPU, use the lab's image on the CPU "
            f"stand-in instead (image={on_cpu!r}, or LABKIT_TRITON_IMAGE)"
        ) + (
            f"; `labkit image base` then `labkit image build --base {BASE_IMAGE}` build "
            f"{on_cpu} (about 3 minutes, as root)"
        )
        raise MissingDependencyError(
            f"the docker mode's image {image!r} is not on this host; {pull}{fix}{stand_in}"
        )
    if not info.transformers or not info.torch:
        missing = " and ".join(n for n in ("transformers", "torch") if not getattr(info, n))
        raise MissingDependencyError(
            f"image {image!r} has no {missing} ({info.problem or 'not installed'}), so the "
            f"lab's text models cannot load in it (the plain NGC tritonserver image has "
            f"neither); {fix}"
        )
    if info.torch_cuda is None:
        log.warning(
            "torch %s in image %s is a CPU-only build: models run on the CPU", info.torch, image
        )
    if info.numpy and int(info.numpy.split(".")[0]) >= 2:
        log.warning(
            "image %s has numpy %s; the lab's model code is tested with numpy<2", image, info.numpy
        )
    return info


# -- Triton's vLLM image and its vllm backend ------------------------------------------------------
#: NGC's tag suffixes: the plain server, and the server with vLLM and the ``vllm`` backend.
FLAVOURS = {"python": "py3", "vllm": "vllm-python-py3"}

#: The ``AsyncEngineArgs`` fields a ``model.json`` may hold here: the engine arguments of vLLM's
#: documentation (docs.vllm.ai, "Engine Arguments") that the lab's models use or a learner is
#: likely to tune. A key outside this list is refused, with the nearest names, before Triton
#: reads it; tests check the list against ``vllm.engine.arg_utils.AsyncEngineArgs`` where vLLM
#: is installed (``.venv-vllm``).
ENGINE_ARGS = frozenset(
    {
        "model",
        "tokenizer",
        "tokenizer_mode",
        "trust_remote_code",
        "revision",
        "download_dir",
        "load_format",
        "dtype",
        "seed",
        "max_model_len",
        "served_model_name",
        "generation_config",
        "quantization",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "distributed_executor_backend",
        "block_size",
        "gpu_memory_utilization",
        "kv_cache_dtype",
        "num_gpu_blocks_override",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "enforce_eager",
        "disable_log_stats",
        "max_logprobs",
        "hf_overrides",
        "additional_config",
    }
)
#: Engine arguments that are no longer: what to do instead.
RETIRED_ENGINE_ARGS = {
    "device": (
        "vLLM removed the device engine argument in v0.10 (vllm-project/vllm#21349): the "
        "platform comes from what is installed (CUDA, or the vllm-neuron plugin with "
        "VLLM_PLUGINS=neuron); drop it"
    ),
    "override_neuron_config": (
        "with vLLM v1 and the vllm-neuron plugin, Neuron overrides go inside "
        'additional_config: {"additional_config": {"override_neuron_config": {...}}}'
    ),
}


def ngc_image(release: str | None = None, *, flavour: str = "python") -> str:
    """An NGC tritonserver image: ``flavour="vllm"`` is ``<release>-vllm-python-py3``."""
    release = release or TRITON_RELEASE
    if not re.fullmatch(r"\d{2}\.\d{2}", release):
        raise ConfigError(f"NGC release {release!r} is not <yy>.<mm>; e.g. {TRITON_RELEASE}")
    if flavour not in FLAVOURS:
        raise ConfigError(f"image flavour {flavour!r} is not one of {', '.join(FLAVOURS)}")
    return f"nvcr.io/nvidia/tritonserver:{release}-{FLAVOURS[flavour]}"


def check_engine_args(args: Mapping[str, object]) -> dict:
    """``args`` as a JSON-ready dict, or :class:`ConfigError` naming every key vLLM would refuse."""
    problems = []
    for key in args:
        if key in RETIRED_ENGINE_ARGS:
            problems.append(f"{key!r}: {RETIRED_ENGINE_ARGS[key]}")
        elif key not in ENGINE_ARGS:
            near = difflib.get_close_matches(key, ENGINE_ARGS, n=2)
            hint = f"did you mean {' or '.join(near)}?" if near else "see vLLM's Engine Arguments"
            problems.append(f"{key!r} is not an AsyncEngineArgs field ({hint})")
    if "model" not in args:
        problems.append("'model' is missing: give a Hugging Face id or a checkpoint folder")
    for key in ("tensor_parallel_size", "max_num_seqs", "max_model_len", "block_size"):
        value = args.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"{key!r} must be a whole number >= 1, got {value!r}")
    share = args.get("gpu_memory_utilization")
    if share is not None and not (isinstance(share, int | float) and 0 < share <= 1):
        problems.append(f"'gpu_memory_utilization' is a share of memory in (0, 1], got {share!r}")
    if problems:
        raise ConfigError("vLLM engine arguments: " + "; ".join(problems))
    try:
        return json.loads(json.dumps(dict(args)))
    except TypeError as exc:
        raise ConfigError(f"vLLM engine arguments must be JSON values: {exc}") from None


def vllm_backend_config(name: str, *, instance_count: int = 1) -> mc.ModelConfig:
    """Triton's vllm backend config: the backend fills in the inputs and outputs itself
    (``text_input``, ``stream``, ``sampling_parameters`` -> ``text_output``)."""
    config = mc.ModelConfig(name=name, backend="vllm")
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_MODEL, count=instance_count)
    return config


def write_vllm_backend_model(
    model_dir: str | os.PathLike, engine_args: Mapping[str, object], version: int = 1
) -> Path:
    """Write ``config.pbtxt`` (``backend: "vllm"``) and ``<version>/model.json``; checked first.

    The config is read back through Triton's ``ModelConfig`` protobuf and validated, so what is
    on disk is what Triton will parse.
    """
    model_dir = Path(model_dir)
    args = check_engine_args(engine_args)
    config = vllm_backend_config(model_dir.resolve().name)
    text = config_to_text(config)
    validate(parse_config(text), name=model_dir.resolve().name)
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text, encoding="utf-8")
    (model_dir / str(version) / "model.json").write_text(
        json.dumps(args, indent=2) + "\n", encoding="utf-8"
    )
    return model_dir


def loopback_ports(*ports: tuple[int, int]) -> list[str]:
    """``docker run``'s ``-p`` flags publishing each ``(host, container)`` port on 127.0.0.1 only,
    where labkit's own servers listen: a bare ``-p 8000:8000`` opens the port to every network
    the host is on. A host that serves other machines drops ``127.0.0.1:``."""
    return [flag for host, inside in ports for flag in ("-p", f"127.0.0.1:{host}:{inside}")]


def vllm_run_command(
    repository: str | os.PathLike,
    *,
    release: str | None = None,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
) -> list[str]:
    """The ``docker run`` of Triton's vLLM image serving ``repository`` on every GPU (built and
    shown, not run: it needs a Docker engine and a GPU), its ports on 127.0.0.1
    (:func:`loopback_ports`). It runs on the GPU host, from the folder that holds the copied
    ``repository``: the mount is ``$PWD/<its name>``, which the shell there expands (this
    machine's path to it would name nothing there)."""
    return [
        "docker",
        "run",
        "--rm",
        "--gpus=all",
        "--shm-size=1g",
        *loopback_ports((http_port, 8000), (grpc_port, 8001), (metrics_port, 8002)),
        "-v",
        f"$PWD/{Path(repository).resolve().name}:/models",
        ngc_image(release, flavour="vllm"),
        "tritonserver",
        "--model-repository=/models",
    ]
