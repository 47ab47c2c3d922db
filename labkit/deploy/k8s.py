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
- ``requirements.txt``: the Python packages the repository's models import, at the versions this
  environment has (what the image must contain; with the NGC image they are installed at start);
- ``README.md``: how to apply them, and the Secret to create.

Every model of the repository is loaded at start (``--model-control-mode=none``), so a pipeline
travels whole: the ensemble ``minilm_pipeline`` with its steps, and ``ask`` with the models it
calls. The response cache: ``cache_size`` (bytes; ``labkit deploy k8s --cache-size``) starts
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
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

import yaml

from labkit.cluster import ready_check
from labkit.errors import ConfigError, MissingFileError
from labkit.repository import Repository
from labkit.settings import NGC_IMAGE, triton_image

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


def cached_models(repository: str | os.PathLike) -> list[str]:
    """The repository's models whose config enables Triton's response cache."""
    repo = Repository(repository)
    return [name for name in repo.models() if repo.config(name).response_cache.enable]


def cache_args(s: DeploySettings) -> list[str]:
    """Triton's response-cache arguments: none without ``cache_size``."""
    if s.cache_size is None:
        return []
    return [f"--cache-config=local,size={int(s.cache_size)}", f"--cache-directory={IMAGE_CACHES}"]


def ngc_image() -> str:
    """NGC's Triton image (the models' Python packages are installed when it starts)."""
    return NGC_IMAGE


# -- the repository's Python dependencies -----------------------------------------------------
def python_requirements(repository: str | os.PathLike) -> list[str]:
    """``name==version`` for every distribution the repository's model code imports (at the
    versions installed here), plus weight packages named by ``package:`` parameters. numpy is
    pinned below 2, which Triton 2.51's Python backend needs."""
    repo = Repository(repository)
    modules: set[str] = set()
    for name in repo.models():
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


def _server_args(s: DeploySettings, repository: str = MODEL_DIR) -> list[str]:
    return [
        f"--model-repository={repository}",
        "--model-control-mode=none",  # every model of the repository, loaded at start
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
        # allows 20 minutes before liveness and readiness take over. With every model loaded at
        # start (--model-control-mode=none), /v2/health/ready is right here.
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
            "--model-control-mode=none",
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
    """File name -> resource, for these settings."""
    s.check()
    files = {"pvc.yaml": persistent_volume_claim(s), "configmap.yaml": check_config_map(s)}
    if s.kserve:
        files["inferenceservice.yaml"] = inference_service(s)
    else:
        files["deployment.yaml"] = deployment(s)
        files["service.yaml"] = service(s)
    files["hpa.yaml"] = autoscaler(s)
    return files


def write_manifests(
    repository: str | os.PathLike, out: str | os.PathLike, settings: DeploySettings | None = None
) -> list[Path]:
    """Write the manifests for ``repository`` into ``out``; return the paths written."""
    repo = Path(repository)
    if not repo.is_dir():
        raise MissingFileError(
            f"model repository {str(repo)!r} does not exist; pass --model-repository a folder of models"
        )
    settings = settings or DeploySettings()
    if not settings.requirements:
        settings = replace(settings, requirements=tuple(python_requirements(repo)))
    if settings.cache_size is None and cached_models(repo):
        settings = replace(settings, cache_size=DEFAULT_CACHE_BYTES)
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
    cached = cached_models(repository)
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

Written by `labkit deploy k8s` from `{repository}`. Nothing here was applied to a cluster.

1. The model repository on shared storage: `kubectl apply{ns} -f pvc.yaml`, then copy the
   repository into the claim with its weights resolved (`cp -rL {repository.name}/. <mount>/`).
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
