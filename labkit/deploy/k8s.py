"""The lab's model repository on Kubernetes: plain manifests, or a KServe InferenceService.

What :func:`write_manifests` writes into ``out`` (one resource per file, so each validates alone):

- ``pvc.yaml``: the model repository on shared storage (a ReadOnlyMany PersistentVolumeClaim that
  every replica mounts read-only at ``/models``; copy the repository into it with weights
  resolved, ``cp -rL``);
- ``configmap.yaml``: :mod:`labkit.cluster.ready_check`, the check the lab's balancer runs on each
  replica, as a file the pod mounts at ``/opt/labkit/ready_check.py``;
- plain (default): ``deployment.yaml`` (Triton with its probes, resource requests, node selector
  and tolerations for the accelerator, the ``/dev/shm`` memory volume the Python backend needs,
  ``HF_TOKEN`` from a Secret reference), ``service.yaml`` (HTTP, gRPC, metrics), ``hpa.yaml``
  (autoscaling/v2 on
  Triton's average queue time per request, a custom pod metric) and beside it
  ``prometheus-adapter-values.yaml`` (the prometheus-adapter rule that computes that metric from
  ``nv_inference_queue_duration_us`` and ``nv_inference_request_success``);
- ``--kserve``: ``inferenceservice.yaml`` (``serving.kserve.io/v1beta1``, runtime
  ``kserve-tritonserver``, ``storageUri`` the same claim) instead of the Deployment and Service;
  the HPA then targets the predictor Deployment KServe creates in RawDeployment mode;
- ``requirements.txt``: the Python packages the deployed models import, at the versions this
  environment has (what the image must contain; with the NGC image they are installed at start);
- ``README.md``: how to apply them, the exact copy of the deployed models into the claim, and the
  Secret to create.

Which models: those named in ``DeploySettings.models``, or by default every model of the
repository the image can run (:func:`deployed_models`). A model whose stub runs in one of the
lab's own Python environments (``labkit_environment``, such as ``smollm2_vllm`` in
``.venv-vllm``) or in a venv its config names (``EXECUTION_ENV_PATH``) is left out, with a
warning that says where it goes instead: Triton's vLLM image with its ``backend: "vllm"`` twin
(:func:`labkit.server.image.write_vllm_backend_model`). A pipeline travels whole: an ensemble with
its steps, and a BLS model (``ask``) with the models its ``*_model`` parameters name. Triton
starts with ``--model-control-mode=explicit`` and one ``--load-model`` per deployed model, so a pod
loads exactly those even when the claim holds more. :func:`copy_repository` copies exactly those
models with their links resolved (what the README's ``cp -rL`` does), and refuses a config that
names a folder of this machine. The response cache: ``cache_size`` (bytes; ``labkit deploy k8s --cache-size``) starts
Triton with the ``local`` cache of that size from the image's own ``/opt/tritonserver/caches``
(NGC's image, and the lab's built on it). A repository with a model whose config enables
``response_cache`` gets :data:`DEFAULT_CACHE_BYTES` unless a size is given: without a cache,
such a model loads and answers but caches nothing. The cache lives in the container's memory, so
it must fit inside the memory limit.

The probes: startup on ``/v2/health/ready`` (up to 20 minutes for the models to load); readiness
runs ``ready_check.py`` (every model's ``/v2/models/<model>/ready`` and every Python stub alive,
the lab balancer's own check), so a pod whose stub died leaves the Service as a replica leaves the
lab's pool; liveness runs it with ``--live`` (the server answers and every stub is alive), so the
kubelet restarts a container whose stub died, since nothing else brings that stub back. Triton's
``/v2/health/ready`` stays 200 after a stub died: as a readiness probe it would keep that pod in
the Service while it fails every request to the model.

No secret value is ever written: the token is a ``secretKeyRef`` to ``Secret/<hf_secret>``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

import yaml

from labkit.cluster import ready_check
from labkit.errors import ConfigError, MissingFileError
from labkit.repository import Repository
from labkit.repository.config import CONFIG_FILE
from labkit.repository.folder import ENVIRONMENT_PARAMETER, ENVIRONMENTS, EXECUTION_ENV_PATH
from labkit.server.image import ngc_image as flavoured_image
from labkit.settings import NGC_IMAGE, triton_image

from .portable import find_machine_paths

log = logging.getLogger(__name__)

# NGC's Triton image (--ngc, settings.NGC_IMAGE) lacks the models' Python packages; they are then
# installed when the container starts. The default image is the lab's own (LABKIT_TRITON_IMAGE,
# see labkit.settings.triton_image), built from docker/Dockerfile and pushed to a registry.
ACCELERATORS = ("cpu", "gpu", "neuron")
MODEL_DIR = "/models"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
#: KServe's ``kserve-tritonserver`` runtime starts Triton with ``--http-port=8080``.
KSERVE_HTTP_PORT = 8080
#: Where the pod mounts the readiness check (a ConfigMap holding :mod:`labkit.cluster.ready_check`).
CHECK_DIR = "/opt/labkit"
CHECK_FILE = "ready_check.py"
#: The custom pod metric the HPA scales on (microseconds a request waited in Triton's queue).
QUEUE_METRIC = "triton_queue_us_per_request"
_RESOURCE = {"gpu": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuron"}
_NODE_SELECTOR = {
    "cpu": {"kubernetes.io/os": "linux"},
    "gpu": {"nvidia.com/gpu.present": "true"},  # NVIDIA GPU feature discovery's label
    "neuron": {"node.kubernetes.io/instance-type": "inf2.xlarge"},
}
#: Where the NGC image (and the lab's image, built FROM it) keeps its response-cache libraries.
IMAGE_CACHES = "/opt/tritonserver/caches"
#: The cache a repository gets when a model enables ``response_cache`` and no size was given.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
#: Kubernetes' quantity suffixes (binary, then decimal; ``m`` is a thousandth).
_MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                 "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                 "P": 10**15, "E": 10**18}  # fmt: skip
_QUANTITY = re.compile(
    r"(\d+(?:\.\d*)?|\.\d+)(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E))?"
)
#: Distributions a model imports under another name, and ones the server itself provides.
_SERVER_PROVIDED = {"triton_python_backend_utils"}
#: A Python model's parameters that name a model it calls (BLS): ``ask``'s ``embedding_model`` and
#: ``llm_model``. The repository declares no other list of callees; ``huggingface_model`` names
#: weights, not a model.
CALLEE_SUFFIX = "_model"
_NOT_CALLEES = {"huggingface_model"}


@dataclass(frozen=True)
class DeploySettings:
    """What to deploy and how; every field has a default that suits a small GPU cluster."""

    name: str = "triton"
    namespace: str | None = None
    accelerator: str = "cpu"
    kserve: bool = False
    image: str = field(default_factory=triton_image)
    replicas: int = 1
    max_replicas: int = 4
    accelerators_per_replica: int = 1
    cpu: str = "2"
    memory: str = "8Gi"
    shm_size: str = "1Gi"
    storage: str = "20Gi"
    storage_class: str | None = None
    storage_uri: str | None = None  # KServe: default pvc://<name>-model-repository
    hf_secret: str = "hf-token"
    queue_target_us: int = 50_000
    service_type: str = "ClusterIP"
    node_selector: dict[str, str] = field(default_factory=dict)
    requirements: tuple[str, ...] = ()
    cache_size: int | None = None  # bytes of Triton's response cache; None: no cache
    #: the models to deploy (with what their pipelines call); empty: every model the image runs
    models: tuple[str, ...] = ()

    def check(self) -> DeploySettings:
        if self.accelerator not in ACCELERATORS:
            raise ConfigError(
                f"accelerator={self.accelerator!r}; use one of {', '.join(ACCELERATORS)}"
            )
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", self.name):
            raise ConfigError(
                f"name={self.name!r} is not a Kubernetes name (lower-case letters, digits, '-')"
            )
        if not 1 <= self.replicas <= self.max_replicas:
            raise ConfigError(
                f"replicas={self.replicas} must be between 1 and max_replicas={self.max_replicas}"
            )
        if self.cache_size is not None:
            if (
                not isinstance(self.cache_size, int)
                or isinstance(self.cache_size, bool)
                or (self.cache_size < 1)
            ):
                raise ConfigError(
                    f"cache_size={self.cache_size!r}: the response cache needs 1 byte or more "
                    "(for example 268435456 for 256 MiB); pass None for no cache"
                )
            limit = memory_bytes(self.memory)
            if self.cache_size >= limit:
                raise ConfigError(
                    f"cache_size={self.cache_size} bytes does not fit in memory={self.memory!r} "
                    f"({limit} bytes), the container's limit, which also holds the models; "
                    "give a smaller cache or more memory"
                )
        return self

    @property
    def claim(self) -> str:
        return f"{self.name}-model-repository"

    @property
    def uses_ngc_image(self) -> bool:
        return self.image.startswith("nvcr.io/nvidia/tritonserver")


def memory_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity (``8Gi``, ``1.5Gi``, ``512Mi``, ``1G``, ``129e6``,
    ``1000``), rounded up as Kubernetes rounds a quantity to whole bytes."""
    match = _QUANTITY.fullmatch(str(quantity).strip())
    if not match:
        raise ConfigError(
            f"memory={quantity!r} is not a Kubernetes memory quantity such as 8Gi, 1.5Gi or "
            "512Mi (suffixes: Ki Mi Gi Ti Pi Ei, or k M G T P E)"
        )
    number, exponent, unit = match.groups()
    value = Decimal(number) * (Decimal(10) ** int(exponent[1:]) if exponent else 1)
    return math.ceil(value * _MEMORY_UNITS.get(unit or "", 1))


def cached_models(repository: str | os.PathLike, models: Sequence[str] | None = None) -> list[str]:
    """The models (of ``models``, default every one of the repository) whose config enables
    Triton's response cache."""
    repo = Repository(repository)
    names = repo.models() if models is None else list(models)
    return [name for name in names if repo.config(name).response_cache.enable]


# -- which models ------------------------------------------------------------------------------
def deployed_models(repository: str | os.PathLike, models: Sequence[str] = ()) -> list[str]:
    """The models the manifests deploy, in the repository's order: ``models`` with every model
    their pipelines need, or by default every model the image can run.

    A pipeline travels whole: an ensemble's steps (``ensemble_scheduling``), and the models a
    Python model calls (BLS), which the repository names in its ``*_model`` parameters
    (:data:`CALLEE_SUFFIX`; ``ask``: ``embedding_model``, ``llm_model``), each with what it needs
    in turn. A model whose stub needs a Python environment the image lacks (:func:`runs_elsewhere`)
    is left out by default with a warning that says where it goes instead; naming it, or a
    pipeline that needs it, is a :class:`ConfigError` saying the same. An unknown name is a
    :class:`ConfigError` listing the repository's models.
    """
    repo = Repository(repository)
    known = repo.models()
    unknown = [m for m in models if m not in known]
    if unknown:
        raise ConfigError(
            f"no model {', '.join(map(repr, unknown))} in the repository {repo.path.name!r}; "
            f"its models: {', '.join(known) or 'none'}"
        )
    chosen: set[str] = set()
    for model in models or known:
        needed = _with_callees(repo, model, known)
        elsewhere = {m: why for m in sorted(needed) if (why := runs_elsewhere(repo, m))}
        if not elsewhere:
            chosen |= needed
            continue
        reason = "; ".join(
            (why if m == model else f"it needs {m}, and {m}: {why}") for m, why in elsewhere.items()
        )
        if models:
            raise ConfigError(f"{model} cannot be deployed in this image: {reason}")
        log.warning("leaving %s out of the manifests: %s", model, reason)
    return [m for m in known if m in chosen]


def runs_elsewhere(repository: Repository, model: str) -> str | None:
    """Why ``model`` cannot run in the lab's Triton image, and where it goes instead; ``None``
    when it can. Its stub runs in one of the lab's environments (``labkit_environment``: vLLM in
    ``.venv-vllm``) or in the venv its ``EXECUTION_ENV_PATH`` names: neither is in the image, and
    the config's path is one of the machine that wrote it."""
    parameters = repository.config(model).parameters
    if ENVIRONMENT_PARAMETER in parameters:
        environment = parameters[ENVIRONMENT_PARAMETER].string_value
        folder = ENVIRONMENTS.get(environment, environment)
        return (
            f"its stub runs in the lab's {environment!r} environment ({folder} of the checkout, "
            "named in its config), which the image does not have; serve it with Triton's vLLM "
            f'image ({flavoured_image(flavour="vllm")}) and its backend: "vllm" twin '
            "(labkit.server.image.write_vllm_backend_model; labkit.llm_serving.write_gpu_configs "
            "writes both)"
        )
    if EXECUTION_ENV_PATH in parameters:
        return (
            f"its stub runs in the Python environment {EXECUTION_ENV_PATH} names "
            f"({parameters[EXECUTION_ENV_PATH].string_value!r}), which the image does not have; "
            "serve it on a host or image that has that environment"
        )
    return None


def _with_callees(repo: Repository, model: str, known: list[str]) -> set[str]:
    """``model`` and every model it needs: ensemble steps and BLS callees, transitively."""
    needed, todo = set(), [model]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        config = repo.config(name)
        steps = [step.model_name for step in config.ensemble_scheduling.step]
        missing = [s for s in steps if s not in known]
        if missing:
            raise ConfigError(
                f"the ensemble {name} has steps {', '.join(missing)} that are not in the "
                f"repository {repo.path.name!r}; add them or leave {name} out"
            )
        callees = [
            parameter.string_value
            for key, parameter in config.parameters.items()
            if key.endswith(CALLEE_SUFFIX) and key not in _NOT_CALLEES
        ]
        for callee in callees:
            if callee not in known:
                log.warning(
                    "%s names %r, which is not a model of the repository: a request that "
                    "calls it fails",
                    name,
                    callee,
                )
        todo += steps + [c for c in callees if c in known]
    return needed


def cache_args(s: DeploySettings) -> list[str]:
    """Triton's response-cache arguments: none without ``cache_size``."""
    if s.cache_size is None:
        return []
    return [f"--cache-config=local,size={int(s.cache_size)}", f"--cache-directory={IMAGE_CACHES}"]


def ngc_image() -> str:
    """NGC's Triton image (the models' Python packages are installed when it starts)."""
    return NGC_IMAGE


# -- the repository's Python dependencies -----------------------------------------------------
def python_requirements(
    repository: str | os.PathLike, models: Sequence[str] | None = None
) -> list[str]:
    """``name==version`` for every distribution the code of ``models`` (default: every model of
    the repository) imports, at the versions installed here, plus weight packages named by
    ``package:`` parameters. numpy is pinned below 2, which Triton 2.51's Python backend needs."""
    repo = Repository(repository)
    modules: set[str] = set()
    for name in repo.models() if models is None else models:
        for path in sorted((repo.path / name).rglob("*.py")):
            modules |= _imported_modules(path)
        config = repo.config(name)
        for parameter in config.parameters.values():
            if parameter.string_value.startswith("package:"):
                modules.add(parameter.string_value.removeprefix("package:"))
    owners = importlib.metadata.packages_distributions()
    requirements = set()
    for module in sorted(modules - set(sys.stdlib_module_names) - _SERVER_PROVIDED):
        for dist in owners.get(module, []):
            requirements.add(_pin(dist))
    return sorted(requirements, key=str.lower)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def _pin(dist: str) -> str:
    version = importlib.metadata.version(dist)
    if dist.lower() == "numpy":
        return f"numpy=={version}" if version.startswith("1.") else "numpy<2"
    if dist.lower() == "torch":
        return f"torch=={version.split('+')[0]}"  # the image's own build (CUDA), same release
    return f"{dist}=={version}"


# -- resources ---------------------------------------------------------------------------------
def _labels(s: DeploySettings) -> dict[str, str]:
    return {"app.kubernetes.io/name": s.name, "app.kubernetes.io/part-of": "triton-labkit"}


def _metadata(s: DeploySettings, name: str | None = None, **extra) -> dict:
    meta = {"name": name or s.name, "labels": _labels(s), **extra}
    if s.namespace:
        meta["namespace"] = s.namespace
    return meta


def _resources(s: DeploySettings) -> dict:
    requests = {"cpu": s.cpu, "memory": s.memory}
    limits = {"memory": s.memory}
    if s.accelerator in _RESOURCE:  # an extended resource: request and limit must be equal
        count = str(s.accelerators_per_replica)
        requests[_RESOURCE[s.accelerator]] = count
        limits[_RESOURCE[s.accelerator]] = count
    return {"requests": requests, "limits": limits}


def _tolerations(s: DeploySettings) -> list[dict]:
    if s.accelerator not in _RESOURCE:
        return []
    return [{"key": _RESOURCE[s.accelerator], "operator": "Exists", "effect": "NoSchedule"}]


def _env(s: DeploySettings) -> list[dict]:
    return [
        {"name": "HF_HOME", "value": "/cache/huggingface"},
        {
            "name": "HF_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": s.hf_secret, "key": "HF_TOKEN", "optional": True}
            },
        },
    ]


def load_args(s: DeploySettings) -> list[str]:
    """``--model-control-mode=explicit`` and one ``--load-model`` per deployed model: the pod
    loads exactly these at start, whatever else the claim holds."""
    return ["--model-control-mode=explicit", *(f"--load-model={m}" for m in s.models)]


def _server_args(s: DeploySettings, repository: str = MODEL_DIR) -> list[str]:
    return [
        f"--model-repository={repository}",
        *load_args(s),
        f"--http-port={PORTS['http']}",
        f"--grpc-port={PORTS['grpc']}",
        f"--metrics-port={PORTS['metrics']}",
        "--allow-metrics=true",
        "--allow-cpu-metrics=true",
        f"--allow-gpu-metrics={'true' if s.accelerator == 'gpu' else 'false'}",
        "--exit-timeout-secs=30",
        *cache_args(s),
    ]


def _command(s: DeploySettings) -> tuple[list[str], list[str]]:
    """(command, args) of the Triton container. The NGC image lacks the models' Python packages:
    they are installed before the server starts (the lab image has them built in)."""
    if s.uses_ngc_image and s.requirements:
        script = (
            f"pip install --no-cache-dir {' '.join(repr(r) for r in s.requirements)} "
            f"&& exec tritonserver {' '.join(_server_args(s))}"
        )
        return ["/bin/sh", "-c"], [script]
    return ["tritonserver"], _server_args(s)


def _probes(port: int | str = "http", http_port: int = PORTS["http"]) -> dict:
    """The container's probes; ``port`` is the startup probe's (a port name or number),
    ``http_port`` the one the check asks Triton on inside the pod."""
    check = [
        "python3",
        f"{CHECK_DIR}/{CHECK_FILE}",
        f"--url=http://127.0.0.1:{http_port}",
        "--timeout-s=3",
    ]

    def run(command: list[str], period: int, failures: int) -> dict:
        # the check asks Triton up to three times per model: a python3 start and loopback calls
        return {
            "exec": {"command": command},
            "periodSeconds": period,
            "timeoutSeconds": 10,
            "failureThreshold": failures,
        }

    return {
        # Model loads take minutes (weights from shared storage or the hub): the startup probe
        # allows 20 minutes before liveness and readiness take over. With the deployed models
        # loaded at start (--load-model, each), /v2/health/ready is right here.
        "startupProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 120,
        },
        # A dead stub is never restarted by Triton: the container is, after 3 checks (30 s).
        "livenessProbe": run([*check, "--live"], 10, 3),
        # Out of the Service after two failed checks, as a replica leaves the lab's pool.
        "readinessProbe": run(check, 5, 2),
    }


def _volumes(s: DeploySettings, with_repository: bool = True) -> list[dict]:
    volumes = [
        # The Python backend moves tensors through /dev/shm; a container's default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s.shm_size}},
        {"name": "cache", "emptyDir": {}},
        {"name": "ready-check", "configMap": {"name": _check_name(s), "defaultMode": 0o444}},
    ]
    if with_repository:
        volumes.insert(
            0,
            {
                "name": "model-repository",
                "persistentVolumeClaim": {"claimName": s.claim, "readOnly": True},
            },
        )
    return volumes


def _mounts(with_repository: bool = True) -> list[dict]:
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "ready-check", "mountPath": CHECK_DIR, "readOnly": True},
    ]
    if with_repository:
        mounts.insert(0, {"name": "model-repository", "mountPath": MODEL_DIR, "readOnly": True})
    return mounts


def _node_selector(s: DeploySettings) -> dict[str, str]:
    return {**_NODE_SELECTOR[s.accelerator], **s.node_selector}


def _check_name(s: DeploySettings) -> str:
    return f"{s.name}-ready-check"


def check_config_map(s: DeploySettings) -> dict:
    """The ConfigMap that holds the readiness check, :mod:`labkit.cluster.ready_check` (the
    standard library only: the image's ``python3`` runs it)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(s, _check_name(s)),
        "data": {CHECK_FILE: Path(ready_check.__file__).read_text(encoding="utf-8")},
    }


def persistent_volume_claim(s: DeploySettings) -> dict:
    spec: dict = {
        "accessModes": ["ReadOnlyMany"],
        "resources": {"requests": {"storage": s.storage}},
    }
    if s.storage_class:
        spec["storageClassName"] = s.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(s, s.claim),
        "spec": spec,
    }


def deployment(s: DeploySettings) -> dict:
    command, args = _command(s)
    container = {
        "name": "tritonserver",
        "image": s.image,
        "command": command,
        "args": args,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in PORTS.items()],
        "env": _env(s),
        "resources": _resources(s),
        **_probes(),
        "volumeMounts": _mounts(),
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORTS["metrics"]),
        "prometheus.io/path": "/metrics",
    }
    pod: dict = {
        "containers": [container],
        "nodeSelector": _node_selector(s),
        "volumes": _volumes(s),
        "terminationGracePeriodSeconds": 40,
    }
    if _tolerations(s):
        pod["tolerations"] = _tolerations(s)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(
            s, annotations={"labkit/python-requirements": " ".join(s.requirements)}
        ),
        "spec": {
            "replicas": s.replicas,
            "selector": {"matchLabels": _labels(s)},
            "template": {
                "metadata": {"labels": _labels(s), "annotations": annotations},
                "spec": pod,
            },
        },
    }


def service(s: DeploySettings) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(s),
        "spec": {
            "type": s.service_type,
            "selector": _labels(s),
            "ports": [
                {"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in PORTS.items()
            ],
        },
    }


def autoscaler(s: DeploySettings) -> dict:
    """An HPA that adds replicas when requests wait in Triton's queue longer than the target."""
    target = f"{s.name}-predictor" if s.kserve else s.name
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(s),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicas": s.replicas,
            "maxReplicas": s.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": QUEUE_METRIC},
                        "target": {"type": "AverageValue", "averageValue": str(s.queue_target_us)},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def prometheus_adapter_values() -> dict:
    """Helm values for prometheus-community/prometheus-adapter: the rule behind the HPA's metric,
    Triton's queue time per successful request over the last minute, per pod."""
    query = (
        "sum(rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>) / "
        "clamp_min(sum(rate(nv_inference_request_success{<<.LabelMatchers>>}[1m])) "
        "by (<<.GroupBy>>), 1e-9)"
    )
    return {
        "rules": {
            "default": False,
            "custom": [
                {
                    "seriesQuery": 'nv_inference_queue_duration_us{namespace!="",pod!=""}',
                    "resources": {
                        "overrides": {
                            "namespace": {"resource": "namespace"},
                            "pod": {"resource": "pod"},
                        }
                    },
                    "name": {"matches": "^nv_inference_queue_duration_us$", "as": QUEUE_METRIC},
                    "metricsQuery": query,
                }
            ],
        }
    }


def inference_service(s: DeploySettings) -> dict:
    """A KServe InferenceService on the ``kserve-tritonserver`` runtime, the same repository."""
    model: dict = {
        "modelFormat": {"name": "triton"},
        "runtime": "kserve-tritonserver",
        "storageUri": s.storage_uri or f"pvc://{s.claim}",
        "args": [
            *load_args(s),
            "--allow-metrics=true",
            "--allow-cpu-metrics=true",
            *cache_args(s),
        ],
        "env": _env(s),
        "resources": _resources(s),
        **_probes(KSERVE_HTTP_PORT, KSERVE_HTTP_PORT),
        "volumeMounts": _mounts(with_repository=False),
    }
    if s.uses_ngc_image:  # the runtime's own image (nvcr.io/nvidia/tritonserver), this tag
        model["runtimeVersion"] = s.image.rsplit(":", 1)[-1]
    else:  # the lab image, which has the models' Python packages built in
        model["image"] = s.image
    predictor: dict = {
        "minReplicas": s.replicas,
        "maxReplicas": s.max_replicas,
        "nodeSelector": _node_selector(s),
        "volumes": _volumes(s, with_repository=False),
        "model": model,
    }
    if _tolerations(s):
        predictor["tolerations"] = _tolerations(s)
    annotations = {
        "serving.kserve.io/deploymentMode": "RawDeployment",  # a Deployment the HPA can scale
        "serving.kserve.io/autoscalerClass": "external",  # scaled by hpa.yaml, on queue time
        "labkit/python-requirements": " ".join(s.requirements),
    }
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": _metadata(s, annotations=annotations),
        "spec": {"predictor": predictor},
    }


# -- writing -----------------------------------------------------------------------------------
def manifests(s: DeploySettings) -> dict[str, dict]:
    """File name -> resource, for these settings (``s.models`` named: :func:`write_manifests`
    picks them from a repository)."""
    s.check()
    if not s.models:
        raise ConfigError(
            "the manifests need the models to deploy: give DeploySettings(models=(...)), or let "
            "write_manifests(repository, ...) pick them from the repository"
        )
    files = {"pvc.yaml": persistent_volume_claim(s), "configmap.yaml": check_config_map(s)}
    if s.kserve:
        files["inferenceservice.yaml"] = inference_service(s)
    else:
        files["deployment.yaml"] = deployment(s)
        files["service.yaml"] = service(s)
    files["hpa.yaml"] = autoscaler(s)
    return files


def settings_for(
    repository: str | os.PathLike, settings: DeploySettings | None = None
) -> DeploySettings:
    """``settings`` completed from ``repository``: the models to deploy (:func:`deployed_models`),
    the packages they import (unless given) and, when one of them enables the response cache
    and no size was given, :data:`DEFAULT_CACHE_BYTES`."""
    repo = Path(repository)
    if not repo.is_dir():
        raise MissingFileError(
            f"model repository {str(repo)!r} does not exist; pass --model-repository a folder of models"
        )
    settings = settings or DeploySettings()
    models = tuple(deployed_models(repo, settings.models))
    if not models:
        raise ConfigError(
            f"the repository {repo.name!r} holds no model this image can run; name the models "
            "to deploy, or add one"
        )
    settings = replace(settings, models=models)
    if not settings.requirements:
        settings = replace(settings, requirements=tuple(python_requirements(repo, models)))
    if settings.cache_size is None and cached_models(repo, models):
        settings = replace(settings, cache_size=DEFAULT_CACHE_BYTES)
    return settings


def write_manifests(
    repository: str | os.PathLike, out: str | os.PathLike, settings: DeploySettings | None = None
) -> list[Path]:
    """Write the manifests for ``repository`` into ``out`` (:func:`settings_for` picks the
    models); return the paths written."""
    repo = Path(repository)
    settings = settings_for(repo, settings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, resource in manifests(settings).items():
        path = out / name
        path.write_text(_yaml(resource))
        written.append(path)
    values = out / "prometheus-adapter-values.yaml"
    values.write_text(
        "# helm install prometheus-adapter prometheus-community/prometheus-adapter -f this file\n"
        + _yaml(prometheus_adapter_values())
    )
    requirements = out / "requirements.txt"
    requirements.write_text("\n".join(settings.requirements) + "\n")
    readme = out / "README.md"
    readme.write_text(_readme(settings, repo))
    return [*written, values, requirements, readme]


def copy_repository(
    repository: str | os.PathLike,
    dest: str | os.PathLike,
    settings: DeploySettings | None = None,
) -> Path:
    """Copy exactly the deployed models (:func:`settings_for`) of ``repository`` into ``dest``
    with every link resolved, as the README's ``cp -rL`` does; return ``dest``.

    ``dest`` must be empty or missing. A copied config that names a folder of this machine
    (:func:`~labkit.deploy.portable.find_machine_paths`) is an error: the pod cannot reach it.
    Nothing is left in ``dest`` when the copy fails.
    """
    settings = settings_for(repository, settings)
    source, dest = Path(repository), Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"cannot copy the models into {str(dest)!r}: it is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        for model in settings.models:
            shutil.copytree(
                source / model,
                dest / model,
                symlinks=False,
                ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"),
            )
            config = dest / model / CONFIG_FILE
            named = find_machine_paths(config.read_text(encoding="utf-8"))
            if named:
                raise ConfigError(
                    f"{model}/{CONFIG_FILE} names {', '.join(p for _, p in named)}, a path of "
                    "this machine that the pod cannot reach (line "
                    f"{', '.join(str(n) for n, _ in named)}); make it relative to the model "
                    "folder ($$TRITON_MODEL_DIRECTORY) or leave the model out"
                )
    except shutil.Error as exc:
        _empty(dest)
        raise MissingFileError(
            f"copying {model} with its links resolved failed (a link that points nowhere?): {exc}"
        ) from None
    except BaseException:
        _empty(dest)
        raise
    return dest


def copy_command(s: DeploySettings, repository: str = "REPO", mount: str = "<mount>") -> str:
    """The shell command that copies the deployed models into the claim, as
    :func:`copy_repository` does: ``cp -rL REPO/minilm REPO/smollm2 <mount>/``."""
    return f"cp -rL {' '.join(f'{repository}/{m}' for m in s.models)} {mount}/"


def _empty(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's script) as literal blocks, readable as written."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def _yaml(resource: dict) -> str:
    return yaml.dump(resource, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _readme(s: DeploySettings, repository: Path) -> str:
    kind = "KServe InferenceService" if s.kserve else "Deployment + Service"
    files = (
        "pvc.yaml configmap.yaml inferenceservice.yaml hpa.yaml"
        if s.kserve
        else "pvc.yaml configmap.yaml deployment.yaml service.yaml hpa.yaml"
    )
    ns = f" -n {s.namespace}" if s.namespace else ""
    cached = cached_models(repository, s.models)
    repo = Repository(repository)
    left_out = "".join(
        f"\n- `{m}`: " + (runs_elsewhere(repo, m) or "not chosen (`--model`)")
        for m in repo.models()
        if m not in s.models
    )
    if left_out:
        left_out = f"\n\nLeft out of the repository `{repository.name}`:{left_out}"
    if s.cache_size is None:
        cache = "Response cache: off (give `--cache-size` for one)."
    else:
        cache = (
            f"Response cache: {s.cache_size} bytes, in the container's memory "
            f"(`--cache-config=local,size={s.cache_size}`); used by "
            + (", ".join(f"`{m}`" for m in cached) if cached else "no model yet")
            + " (a model uses it when its config says `response_cache { enable: true }`)."
        )
    return f"""# {s.name}: Triton on Kubernetes ({kind}, {s.accelerator})

Written by `labkit deploy k8s` from a model repository named `{repository.name}`. Nothing here
was applied to a cluster.

Models: {", ".join(f"`{m}`" for m in s.models)}. Triton loads exactly these at start
(`--model-control-mode=explicit`, one `--load-model` each), whatever else the claim holds.{left_out}

1. The model repository on shared storage: `kubectl apply{ns} -f pvc.yaml`, then copy these
   models into the claim with their weights and shared code resolved, from the folder that holds
   `{repository.name}/`: `{copy_command(s, repository.name)}`
   (labkit's `copy_repository` makes the same copy).
2. The hub token, if a model needs one (never written in these files):
   `kubectl create secret generic {s.hf_secret}{ns} --from-literal=HF_TOKEN=...`
3. prometheus-adapter with the queue-time rule:
   `helm install prometheus-adapter prometheus-community/prometheus-adapter -f prometheus-adapter-values.yaml`
4. `kubectl apply{ns} {" ".join(f"-f {f}" for f in files.split())}`

Image: `{s.image}`. Python packages the models import (`requirements.txt`):
{", ".join(s.requirements) or "(none)"}.

{cache}

Probes: Triton 2.51 keeps a model READY after its Python stub process died, and
`/v2/health/ready` stays 200 while that model refuses every request. So the readiness probe runs
`ready_check.py` (`configmap.yaml`, mounted at `{CHECK_DIR}`), the check labkit's local balancer
runs on each replica: every model's `/v2/models/<model>/ready` and every Python stub alive. The
liveness probe runs it with `--live`, so a container whose stub died is restarted. From NGC 26.01
on, `/v2/models/<model>/ready` itself answers not ready after a stub died.
"""
