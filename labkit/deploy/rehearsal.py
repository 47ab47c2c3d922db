"""The pod that ``labkit deploy k8s`` writes, run in Docker on this machine as the kubelet runs it.

A schema check reads the manifests; it cannot see a path that exists only on the machine that
wrote them, a package the image lacks, or a probe that never passes. :func:`rehearse` runs the
pod's own container and plays the kubelet around it:

1. **The container, from the written files** (:func:`read_pod`): the Deployment's container, or
   what KServe makes of the InferenceService's predictor: image, command, args, env,
   volumeMounts, ports, memory limit and the three probes. The volumes:

   - the repository claim: the deployed models copied as the manifests' README tells the user
     (``cp -rL``: :func:`labkit.deploy.k8s.copy_repository`), mounted read-only at the mount path;
   - the ConfigMap (the readiness check): its data written to files, mounted read-only with its
     ``defaultMode``;
   - the memory-backed ``/dev/shm`` emptyDir: ``--shm-size`` of its ``sizeLimit``; other
     emptyDirs: a tmpfs (emptied by a restart, where a pod's emptyDir survives one).

   Left out, and said so in :attr:`Pod.notes`: an optional ``secretKeyRef`` (no Secret here),
   accelerator and CPU requests (the container runs on this host's CPU cores), the node selector
   and tolerations (no scheduler). The memory limit becomes ``--memory``.

   **What KServe adds** (it is not in ``inferenceservice.yaml``, so the rehearsal takes it from
   KServe's own definitions): the ``kserve-tritonserver`` ClusterServingRuntime runs the image's
   entrypoint with the args :data:`KSERVE_RUNTIME_ARGS` (``tritonserver --model-store=/mnt/models
   --grpc-port=9000 --http-port=8080 ...``), and KServe appends the predictor's ``args`` after
   them; the predictor's ``image`` replaces the runtime's (``runtimeVersion`` only changes the tag
   of ``nvcr.io/nvidia/tritonserver``); the container serves on port 8080. ``storageUri:
   pvc://<claim>`` puts the claim's files at ``/mnt/models`` (KServe's storage initializer links
   them there from the claim's mount, or mounts the claim there directly), read-only: the
   rehearsal mounts the copy at ``/mnt/models``.

2. **The kubelet's probes.** ``docker run -d`` (container ``labkit-pod-<hex>``, each container port
   published on a free port of 127.0.0.1), then the startup probe every ``periodSeconds`` until it
   passes or fails ``failureThreshold`` times; then readiness (run at once, as the kubelet does
   when a started container is not yet ready) and liveness, each on its own ``periodSeconds``
   ticks from the container's start, each attempt bounded by its ``timeoutSeconds``. An
   ``httpGet`` probe is sent from this host through the published port (the kubelet sends it
   from the node to the pod's address); an ``exec`` probe is ``docker exec`` of its command in
   the container, as the kubelet execs it. Readiness turns off after ``failureThreshold``
   failures in a row; liveness failing ``failureThreshold`` times in a row restarts the container
   (``docker restart`` with the pod's ``terminationGracePeriodSeconds``), and the startup probe
   starts over. One loop runs the probes in turn (the kubelet has a worker per probe), so a slow
   probe delays the next by at most its own time: every row of :meth:`Rehearsal.table` has the
   time it really ran.

3. **Passes** when the pod becomes ready within its startup budget (``periodSeconds x
   failureThreshold``) and answers an inference: a KServe v2 ``/infer`` through the published
   port to a deployed text model, whose answer must be a non-empty ``text_output``.

4. ``kill_stub=True``: once ready (and live once), one ``triton_python_backend_stub`` is killed
   (``docker exec <container> sh -c 'kill -9 <pid>'``). Readiness must turn off; liveness fails
   until the kubelet restarts the container; it must be ready again and answer again.

A pod that never becomes ready is a :class:`~labkit.errors.ServerTimeoutError` (or a
:class:`~labkit.errors.ServerError` when its container exits) quoting the failing probe's output
and the container's last log lines. The container and the copied repository are removed in every
case, Ctrl+C included. The whole rehearsal is bounded by ``timeout_s``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import yaml

from labkit import client, proc
from labkit.errors import (
    ConfigError,
    InferenceError,
    MissingDependencyError,
    MissingFileError,
    ServerError,
    ServerTimeoutError,
    ToolError,
)
from labkit.server.base_image import BASE_IMAGE
from labkit.server.docker import daemon_problem, require_daemon
from labkit.server.image import ON_STAND_IN

from .k8s import DeploySettings, copy_repository, memory_bytes

log = logging.getLogger(__name__)

#: What runs here in place of an image this host does not have: the lab's image on the stand-in.
STAND_IN_IMAGE = ON_STAND_IN
#: The ``kserve-tritonserver`` ClusterServingRuntime's container args (KServe's
#: ``config/runtimes/kserve-tritonserver.yaml``); KServe appends the predictor's own args.
KSERVE_RUNTIME_ARGS = (
    "tritonserver",
    "--model-store=/mnt/models",
    "--grpc-port=9000",
    "--http-port=8080",
    "--allow-grpc=true",
    "--allow-http=true",
)
#: Where KServe's storage initializer puts ``storageUri``'s files in the serving container.
KSERVE_MODEL_DIR = "/mnt/models"
#: The port KServe gives the predictor's container (``containerPort: 8080``).
KSERVE_PORT = 8080
#: The image KServe's runtime names; ``runtimeVersion`` replaces its tag.
KSERVE_RUNTIME_IMAGE = "nvcr.io/nvidia/tritonserver"
#: What a rehearsal's containers are labelled with, so a leftover can be found by it.
LABEL = "labkit.rehearsal"
#: What the rehearsal asks the model it checks.
PROMPT = "Where is the nearest"
#: Kubernetes' defaults for a probe's fields the manifest leaves out.
_PROBE_DEFAULTS = {"periodSeconds": 10, "timeoutSeconds": 1, "failureThreshold": 3}
#: The Python backend's stub; its second argument is ``<repository>/<model>/<version>/model.py``.
STUB = "triton_python_backend_stub"
_FIND_STUBS = (
    "import os\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n"
    "        a = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
    "    except OSError:\n"
    "        continue\n"
    f"    if a[0].endswith(b'{STUB}') and len(a) > 1:\n"
    "        print(p, a[1].decode())\n"
)
_LOG_LINES = 40
#: How often the container's state is looked at while it starts (seconds).
_WATCH_S = 1.0


# -- the pod, read from the written files -------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    """One of the container's probes, with Kubernetes' defaults filled in."""

    name: str  # startup | readiness | liveness
    period_s: int
    timeout_s: int
    failure_threshold: int
    initial_delay_s: int = 0
    command: tuple[str, ...] = ()  # exec
    path: str = ""  # httpGet
    port: int = 0  # httpGet: the container port (a named port resolved)

    @property
    def how(self) -> str:
        if self.command:
            return f"exec {shlex.join(self.command)}"
        return f"httpGet {self.path} on port {self.port}"


@dataclass(frozen=True)
class Mount:
    """A volume as the container sees it, and what stands in for it here."""

    path: str
    kind: str  # repository | configmap | shm | tmpfs
    read_only: bool = False
    size_bytes: int | None = None
    files: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # configmap: (name, text)
    mode: int = 0o644


@dataclass(frozen=True)
class Pod:
    """The container a cluster would run for the written manifests."""

    source: str  # "deployment.yaml: Deployment/triton"
    kind: str  # Deployment | InferenceService
    image: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    ports: tuple[tuple[str, int], ...]  # (name, containerPort)
    probes: tuple[Probe, ...]
    mounts: tuple[Mount, ...]
    memory_bytes: int | None
    grace_s: int
    notes: tuple[str, ...] = ()

    def probe(self, name: str) -> Probe | None:
        return next((p for p in self.probes if p.name == name), None)

    @property
    def startup_budget_s(self) -> int:
        """How long the startup probe lets the container take: ``periodSeconds x
        failureThreshold`` (plus its initial delay)."""
        startup = self.probe("startup")
        if startup is None:
            return 0
        return startup.initial_delay_s + startup.period_s * startup.failure_threshold

    @property
    def repository_path(self) -> str:
        found = next((m.path for m in self.mounts if m.kind == "repository"), None)
        if found is None:
            raise ConfigError(f"{self.source} mounts no model repository claim")
        return found

    @property
    def models(self) -> list[str]:
        """The models the server is told to load (``--load-model``); empty: every one."""
        return [
            token.removeprefix("--load-model=")
            for token in _tokens(self.command + self.args)
            if token.startswith("--load-model=")
        ]


def _tokens(words: Sequence[str]) -> list[str]:
    """Command and args as words, a shell script (``sh -c '... && exec tritonserver ...'``) split."""
    found: list[str] = []
    for word in words:
        found += shlex.split(word) if " " in word else [word]
    return found


def _resources_in(directory: Path) -> list[dict]:
    resources = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if isinstance(doc, dict) and doc.get("kind"):
                resources.append({**doc, "_file": path.name})
    return resources


def read_pod(manifests: str | os.PathLike) -> Pod:
    """The serving container of the Deployment or the InferenceService in ``manifests`` (a folder
    :func:`labkit.deploy.k8s.write_manifests` wrote), with its volumes resolved against the
    folder's other resources (the ConfigMap's data, the claim)."""
    folder = Path(manifests)
    if not folder.is_dir():
        raise MissingFileError(
            f"manifests folder {str(folder)!r} does not exist; write it with "
            "`labkit deploy k8s --out DIR` (or labkit.deploy.write_manifests)"
        )
    resources = _resources_in(folder)
    pods = [r for r in resources if r["kind"] in ("Deployment", "InferenceService")]
    if len(pods) != 1:
        found = ", ".join(f"{r['_file']}: {r['kind']}" for r in pods) or "none"
        raise ConfigError(
            f"{folder} must hold exactly one Deployment or InferenceService to rehearse; found "
            f"{found}. Write the plain and the KServe manifests into two folders"
        )
    resource = pods[0]
    config_maps = {
        r["metadata"]["name"]: r.get("data") or {} for r in resources if r["kind"] == "ConfigMap"
    }
    if resource["kind"] == "Deployment":
        return _deployment_pod(resource, config_maps)
    return _kserve_pod(resource, config_maps)


def _deployment_pod(resource: dict, config_maps: dict[str, dict]) -> Pod:
    spec = resource["spec"]["template"]["spec"]
    containers = spec["containers"]
    container = containers[0]
    notes = [f"container {c['name']!r}: not rehearsed (only the first)" for c in containers[1:]]
    ports = tuple(
        (p.get("name", str(p["containerPort"])), p["containerPort"])
        for p in container.get("ports", [])
    )
    return _pod(
        source=f"{resource['_file']}: Deployment/{resource['metadata']['name']}",
        kind="Deployment",
        image=container["image"],
        command=tuple(container.get("command", ())),
        args=tuple(container.get("args", ())),
        container=container,
        ports=ports,
        volumes=spec.get("volumes", []),
        mounts=container.get("volumeMounts", []),
        config_maps=config_maps,
        pod_spec=spec,
        notes=notes,
    )


def _kserve_pod(resource: dict, config_maps: dict[str, dict]) -> Pod:
    predictor = resource["spec"]["predictor"]
    model = predictor["model"]
    notes = []
    if model.get("runtime") not in (None, "kserve-tritonserver"):
        raise ConfigError(
            f"{resource['_file']}: runtime {model['runtime']!r}; the rehearsal knows only what "
            "KServe's kserve-tritonserver runtime runs"
        )
    if "image" in model:
        image = model["image"]
    else:
        image = f"{KSERVE_RUNTIME_IMAGE}:{model.get('runtimeVersion', 'latest')}"
        notes.append(f"image: the runtime's {KSERVE_RUNTIME_IMAGE}, tag runtimeVersion")
    notes.append(
        f"command: the image's entrypoint with the kserve-tritonserver runtime's args "
        f"({' '.join(KSERVE_RUNTIME_ARGS)}), then the predictor's (KServe appends them)"
    )
    storage = model.get("storageUri", "")
    notes.append(
        f"storageUri {storage}: the repository at {KSERVE_MODEL_DIR}, read-only (KServe's "
        "storage initializer)"
    )
    repository = {
        "name": "kserve-provision-location",
        "mountPath": KSERVE_MODEL_DIR,
        "readOnly": True,
    }
    volumes = [*predictor.get("volumes", []), {"name": repository["name"], "_storage": storage}]
    ports = tuple(
        (p.get("name", str(p["containerPort"])), p["containerPort"]) for p in model.get("ports", [])
    ) or (("http1", KSERVE_PORT),)
    return _pod(
        source=f"{resource['_file']}: InferenceService/{resource['metadata']['name']}",
        kind="InferenceService",
        image=image,
        command=tuple(model.get("command", ())),
        args=(*KSERVE_RUNTIME_ARGS, *model.get("args", ())),
        container=model,
        ports=ports,
        volumes=volumes,
        mounts=[*model.get("volumeMounts", []), repository],
        config_maps=config_maps,
        pod_spec=predictor,
        notes=notes,
    )


def _pod(*, container: dict, ports, volumes, mounts, config_maps, pod_spec, notes, **fields) -> Pod:
    notes = list(notes)
    env = []
    for variable in container.get("env", []):
        if "value" in variable:
            env.append((variable["name"], str(variable["value"])))
            continue
        secret = variable.get("valueFrom", {}).get("secretKeyRef")
        if secret and secret.get("optional"):
            notes.append(
                f"env {variable['name']}: from Secret {secret['name']} (optional), which does not "
                "exist here: left out, as the kubelet leaves it out"
            )
            continue
        raise ConfigError(
            f"{fields['source']}: env {variable['name']} comes from {variable.get('valueFrom')}, "
            "which the rehearsal cannot give; make it optional or a plain value"
        )
    by_name = {v["name"]: v for v in volumes}
    resolved = []
    for mount in mounts:
        volume = by_name.get(mount["name"])
        if volume is None:
            raise ConfigError(f"{fields['source']}: volumeMount {mount['name']!r} has no volume")
        resolved.append(_mount(mount, volume, config_maps, fields["source"]))
    resources = container.get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    for key in sorted({*limits, *requests} - {"memory"}):
        asked = requests.get(key, limits.get(key))
        notes.append(f"resources {key}: {asked} requested, not given here (this host's CPU cores)")
    for key, value in sorted(pod_spec.get("nodeSelector", {}).items()):
        notes.append(f"nodeSelector {key}={value}: no scheduler here, not applied")
    for toleration in pod_spec.get("tolerations", []):
        notes.append(f"toleration {toleration.get('key')}: no scheduler here, not applied")
    memory = limits.get("memory")
    probes = []
    named = dict(ports)
    for key, name in (
        ("startupProbe", "startup"),
        ("readinessProbe", "readiness"),
        ("livenessProbe", "liveness"),
    ):
        if key in container:
            probes.append(_probe(name, container[key], named, fields["source"]))
    return Pod(
        **fields,
        env=tuple(env),
        ports=tuple(ports),
        probes=tuple(probes),
        mounts=tuple(resolved),
        memory_bytes=memory_bytes(memory) if memory else None,
        grace_s=int(pod_spec.get("terminationGracePeriodSeconds", 30)),
        notes=tuple(notes),
    )


def _mount(mount: dict, volume: dict, config_maps: dict[str, dict], source: str) -> Mount:
    path, read_only = mount["mountPath"], bool(mount.get("readOnly", False))
    if "persistentVolumeClaim" in volume or "_storage" in volume:
        return Mount(path, "repository", read_only=True)
    if "configMap" in volume:
        name = volume["configMap"]["name"]
        if name not in config_maps:
            raise ConfigError(
                f"{source}: volume {volume['name']!r} is ConfigMap {name!r}, which is not among "
                "the written files"
            )
        files = tuple(sorted((k, str(v)) for k, v in config_maps[name].items()))
        mode = int(volume["configMap"].get("defaultMode", 0o644))
        return Mount(path, "configmap", read_only=True, files=files, mode=mode)
    if "emptyDir" in volume:
        empty = volume["emptyDir"] or {}
        size = memory_bytes(empty["sizeLimit"]) if empty.get("sizeLimit") else None
        if empty.get("medium") == "Memory" and path == "/dev/shm":
            return Mount(path, "shm", size_bytes=size)
        return Mount(path, "tmpfs", read_only=read_only, size_bytes=size)
    raise ConfigError(f"{source}: volume {volume['name']!r} is of a kind the rehearsal cannot give")


def _probe(name: str, spec: dict, ports: dict[str, int], source: str) -> Probe:
    fields = {**_PROBE_DEFAULTS, **spec}
    common = dict(
        name=name,
        period_s=int(fields["periodSeconds"]),
        timeout_s=int(fields["timeoutSeconds"]),
        failure_threshold=int(fields["failureThreshold"]),
        initial_delay_s=int(fields.get("initialDelaySeconds", 0)),
    )
    if "exec" in spec:
        return Probe(**common, command=tuple(spec["exec"]["command"]))
    if "httpGet" in spec:
        port = spec["httpGet"]["port"]
        if isinstance(port, str) and not port.isdigit():
            if port not in ports:
                raise ConfigError(f"{source}: the {name} probe's port {port!r} is not named")
            port = ports[port]
        return Probe(**common, path=spec["httpGet"].get("path", "/"), port=int(port))
    raise ConfigError(f"{source}: the {name} probe is neither exec nor httpGet")


# -- the container ---------------------------------------------------------------------------
def run_command(
    pod: Pod,
    *,
    name: str,
    image: str,
    host_ports: dict[int, int],
    repository: str | os.PathLike,
    config_dirs: dict[str, str | os.PathLike],
) -> list[str]:
    """The ``docker run -d`` of ``pod``'s container: ``host_ports`` maps each container port to
    a port of 127.0.0.1, ``repository`` is the copied repository, ``config_dirs`` maps each
    ConfigMap mount path to the folder its files were written to."""
    cmd = ["docker", "run", "-d", "--name", name, "--label", f"{LABEL}={pod.source}"]
    for inside, outside in sorted(host_ports.items()):
        cmd += ["-p", f"127.0.0.1:{outside}:{inside}"]
    if pod.memory_bytes:
        cmd += [f"--memory={pod.memory_bytes}"]
    for key, value in pod.env:
        cmd += ["-e", f"{key}={value}"]
    for mount in pod.mounts:
        if mount.kind == "repository":
            cmd += ["-v", f"{os.fspath(repository)}:{mount.path}:ro"]
        elif mount.kind == "configmap":
            cmd += ["-v", f"{os.fspath(config_dirs[mount.path])}:{mount.path}:ro"]
        elif mount.kind == "shm":
            cmd += [f"--shm-size={mount.size_bytes}"] if mount.size_bytes else []
        else:
            options = ",".join(
                [
                    *(["ro"] if mount.read_only else []),
                    *([f"size={mount.size_bytes}"] if mount.size_bytes else []),
                ]
            )
            cmd += ["--tmpfs", f"{mount.path}:{options}" if options else mount.path]
    words = list(pod.args)
    if pod.command:  # the kubelet's rule: command replaces the entrypoint, args the image's CMD
        cmd += ["--entrypoint", pod.command[0]]
        words = [*pod.command[1:], *pod.args]
    return [*cmd, image, *words]


def _docker(*args: str, timeout_s: float = 60.0, check: bool = True):
    return proc.run(["docker", *args], timeout_s=timeout_s, check=check)


def _has_image(image: str) -> bool:
    return _docker("image", "inspect", image, check=False).returncode == 0


def rehearsal_problem(
    manifests: str | os.PathLike | None = None, image: str | None = None
) -> str | None:
    """Why a rehearsal cannot run here, in one sentence with its fix; None when it can: no
    usable Docker engine, or neither ``image`` (default: the manifests' own, then
    :data:`STAND_IN_IMAGE`) is on this host."""
    problem = daemon_problem()
    if problem:
        return problem
    try:
        _pick_image(read_pod(manifests).image if manifests else None, image)
    except MissingDependencyError as exc:
        return str(exc)
    return None


def _pick_image(named: str | None, image: str | None) -> str:
    """The image to run: ``image`` if given; else the manifests' own when this host has it; else
    the lab's image on the CPU stand-in."""
    if image:
        if not _has_image(image):
            raise MissingDependencyError(
                f"image {image!r} is not on this host; build the lab's image (`labkit image "
                f"build`, or on the CPU stand-in `labkit image base` then `labkit image build "
                f"--base {BASE_IMAGE}`, which makes {STAND_IN_IMAGE})"
            )
        return image
    if named and _has_image(named):
        return named
    if _has_image(STAND_IN_IMAGE):
        return STAND_IN_IMAGE
    raise MissingDependencyError(
        f"neither the manifests' image {named!r} nor the lab's image on the CPU stand-in "
        f"{STAND_IN_IMAGE!r} is on this host; build the stand-in with `labkit image base` and "
        f"`labkit image build --base {BASE_IMAGE}`, or pass image="
    )


# -- the result ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """One probe attempt: when (seconds since the container first started), what it said."""

    at_s: float
    probe: str
    passed: bool
    output: str
    took_s: float
    event: str = ""  # what the kubelet did on it: "ready", "not ready", "restart"...


@dataclass
class StubKill:
    """What the probes did after one Python stub was killed (times in seconds after the kill)."""

    model: str
    pid: int  # in the container
    at_s: float  # since the container first started
    readiness_off_after_s: float | None = None
    readiness_output: str = ""
    liveness_failures: int = 0
    liveness_output: str = ""
    restarted_after_s: float | None = None
    restarts: int = 0
    ready_again_after_s: float | None = None
    answer_after: str | None = None

    @property
    def passed(self) -> bool:
        return (
            self.readiness_off_after_s is not None
            and self.restarts > 0
            and self.ready_again_after_s is not None
            and bool(self.answer_after)
        )


@dataclass
class Rehearsal:
    """A rehearsed pod: was it ready within its startup budget, what did it answer, what did its
    probes say (:meth:`table`), and what a killed stub did (:attr:`stub_kill`)."""

    pod: Pod
    image: str  # the image that ran
    ready: bool = False
    time_to_ready_s: float | None = None
    model: str = ""
    answer: str = ""
    probes: list[ProbeResult] = field(default_factory=list)
    stub_kill: StubKill | None = None
    took_s: float = 0.0

    @property
    def passed(self) -> bool:
        """Ready within the startup budget, answered, and (when a stub was killed) out of the
        Service, restarted by liveness, ready again and answering."""
        on_time = self.time_to_ready_s is not None and (
            self.time_to_ready_s <= self.pod.startup_budget_s
        )
        return (
            self.ready
            and on_time
            and bool(self.answer)
            and (self.stub_kill is None or self.stub_kill.passed)
        )

    @property
    def image_note(self) -> str:
        if self.image == self.pod.image:
            return f"ran the manifests' image {self.image}"
        return f"ran {self.image} in place of the manifests' {self.pod.image} (not on this host)"

    def table(self) -> pd.DataFrame:
        """Every probe attempt: seconds since the container first started, the probe, passed,
        what the kubelet did on it, the probe's output."""
        return pd.DataFrame(
            [
                {
                    "t (s)": round(r.at_s, 1),
                    "probe": r.probe,
                    "passed": r.passed,
                    "kubelet": r.event,
                    "took (s)": round(r.took_s, 2),
                    "output": r.output,
                }
                for r in self.probes
            ],
            columns=["t (s)", "probe", "passed", "kubelet", "took (s)", "output"],
        )

    def figures(self) -> dict[str, object]:
        """The rehearsal's figures, by name (seconds rounded to tenths)."""
        kill = self.stub_kill
        out: dict[str, object] = {
            "pod": self.pod.source,
            "image": self.image_note,
            "startup budget (s)": self.pod.startup_budget_s,
            "time to ready (s)": _round(self.time_to_ready_s),
            "model asked": self.model,
            "answer": self.answer,
        }
        if kill is not None:
            out |= {
                "stub killed": f"{kill.model} (pid {kill.pid}) at {kill.at_s:.1f} s",
                "readiness off after (s)": _round(kill.readiness_off_after_s),
                "readiness said": kill.readiness_output,
                "liveness failures": kill.liveness_failures,
                "liveness said": kill.liveness_output,
                "restarted after (s)": _round(kill.restarted_after_s),
                "restarts": kill.restarts,
                "ready again after (s)": _round(kill.ready_again_after_s),
                "answer after restart": kill.answer_after,
            }
        out["notes"] = "; ".join(self.pod.notes)
        out["passed"] = self.passed
        return out

    def __str__(self) -> str:
        figures = self.figures()
        del figures["notes"]
        lines = [f"{k}: {v}" for k, v in figures.items()]
        return "\n".join([*lines, *(f"note: {n}" for n in self.pod.notes)])


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def rehearsal_table(rehearsals: Sequence[Rehearsal]) -> pd.DataFrame:
    """The rehearsals' figures side by side: one row per figure, one column per pod."""
    columns = {r.pod.kind: r.figures() for r in rehearsals}
    names = list(dict.fromkeys(k for figures in columns.values() for k in figures))
    rows = [
        {"": name, **{kind: _shown(f.get(name, "")) for kind, f in columns.items()}}
        for name in names
    ]
    return pd.DataFrame(rows)


def _shown(value: object) -> str:
    return "" if value is None else str(value)


# -- the kubelet -----------------------------------------------------------------------------
class _Kubelet:
    """The probes of one container, on their periods, and what the kubelet does on them."""

    def __init__(self, pod: Pod, container: str, host_ports: dict[int, int], result: Rehearsal):
        self.pod, self.container, self.host_ports, self.result = pod, container, host_ports, result
        self.origin = time.monotonic()  # the container's first start
        self.restarts = 0
        self._started(self.origin)

    def _started(self, at: float) -> None:
        self.started_at = at
        self.startup_done = self.pod.probe("startup") is None
        self.ready = False
        self.failures = {"startup": 0, "readiness": 0, "liveness": 0}
        self.due = {}
        for probe in self.pod.probes:
            self.due[probe.name] = at + probe.initial_delay_s
        self.last: dict[str, ProbeResult] = {}

    def now_s(self) -> float:
        return time.monotonic() - self.origin

    def _active(self) -> list[Probe]:
        names = ("startup",) if not self.startup_done else ("readiness", "liveness")
        return [p for p in self.pod.probes if p.name in names]

    def step(self, deadline: float) -> ProbeResult | None:
        """Run the next probe that falls due; None when none fell due within a second (or before
        ``deadline``), so that the caller can look at the container in between."""
        active = self._active()
        if not active:
            self.ready = True
            return None
        probe = min(active, key=lambda p: self.due[p.name])
        wait = self.due[probe.name] - time.monotonic()
        if wait > 0:
            time.sleep(max(0.0, min(wait, _WATCH_S, deadline - time.monotonic())))
            if time.monotonic() < self.due[probe.name]:
                return None
        started = time.monotonic()
        passed, output = self._run(probe)
        took = time.monotonic() - started
        # a ticker: the next attempt on the next tick still ahead (a slow one skips ticks)
        due = self.due[probe.name] + probe.period_s
        while due <= time.monotonic():
            due += probe.period_s
        self.due[probe.name] = due
        event = self._apply(probe, passed)
        row = ProbeResult(started - self.origin, probe.name, passed, output, took, event)
        self.result.probes.append(row)
        self.last[probe.name] = row
        return row

    def _apply(self, probe: Probe, passed: bool) -> str:
        name = probe.name
        if passed:
            self.failures[name] = 0
            if name == "startup":
                self.startup_done = True
                self.due["readiness"] = time.monotonic()  # probed at once, as the kubelet does
                liveness = self.pod.probe("liveness")
                if liveness is not None:
                    due = self.started_at + liveness.initial_delay_s
                    while due <= time.monotonic():
                        due += liveness.period_s
                    self.due["liveness"] = due
                return "started"
            if name == "readiness" and not self.ready:
                self.ready = True
                return "ready"
            return ""
        self.failures[name] += 1
        if self.failures[name] < probe.failure_threshold:
            return f"failure {self.failures[name]} of {probe.failure_threshold}"
        if name == "readiness":
            if self.ready:
                self.ready = False
                return "not ready"
            return ""
        if name == "liveness":
            self.restart()
            return "restarted"
        return "startup failed"  # the kubelet would restart it; the caller stops here

    def restart(self) -> None:
        """What the kubelet does when liveness fails: stop the container within its grace
        period, start it again, and probe it from the start."""
        _docker(
            "restart",
            "--time",
            str(self.pod.grace_s),
            self.container,
            timeout_s=self.pod.grace_s + 120,
        )
        self.restarts += 1
        self._started(time.monotonic())

    def _run(self, probe: Probe) -> tuple[bool, str]:
        if probe.command:
            try:
                done = _docker(
                    "exec", self.container, *probe.command, timeout_s=probe.timeout_s, check=False
                )
            except ToolError as exc:  # the timeout: a failure, as the kubelet counts it
                return False, f"timed out after {probe.timeout_s} s ({str(exc).splitlines()[0]})"
            said = proc.tail((done.stdout + done.stderr).strip(), 2).replace("\n", " | ")
            return done.returncode == 0, f"exit {done.returncode}: {said}"[:300]
        url = f"http://127.0.0.1:{self.host_ports[probe.port]}{probe.path}"
        try:
            with urllib.request.urlopen(url, timeout=probe.timeout_s) as response:
                return 200 <= response.status < 400, f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            return (
                200 <= exc.code < 400,
                f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}",
            )
        except (OSError, ValueError) as exc:  # refused, reset, timed out
            return False, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"

    def running(self) -> tuple[bool, str]:
        done = _docker(
            "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", self.container, check=False
        )
        running, _, code = done.stdout.strip().partition(" ")
        return running == "true", code

    def run_until(self, condition: Callable[[], bool], deadline: float) -> bool:
        """Probe until ``condition`` holds (True) or ``deadline`` passes (False). A startup that
        fails its threshold, or a container that exits before it started, raises."""
        while not condition():
            if time.monotonic() >= deadline:
                return False
            row = self.step(deadline)
            if row is not None and row.event == "startup failed":
                raise self.not_ready(
                    f"its startup probe failed {self.failures['startup']} times in a row (its "
                    f"budget: {self.pod.startup_budget_s} s); the kubelet would restart it"
                )
            if not self.startup_done and (row is None or not row.passed):
                # the kubelet hears of an exit within a second or so (its pod lifecycle events)
                running, code = self.running()
                if not running:
                    raise self.not_ready(
                        f"its container exited with status {code} before it started (the kubelet "
                        "would restart it, then back off: CrashLoopBackOff)",
                        error=ServerError,
                    )
        return True

    def not_ready(self, why: str, error: type[ServerError] = ServerTimeoutError) -> ServerError:
        last = self.result.probes[-1] if self.result.probes else None
        said = f"; its last probe ({last.probe}, {last.at_s:.1f} s): {last.output}" if last else ""
        logs = _docker("logs", "--tail", str(_LOG_LINES), self.container, check=False)
        return error(
            f"the pod of {self.pod.source} did not become ready: {why}{said}\n"
            f"the container's last log lines (docker logs --tail {_LOG_LINES}):\n"
            f"{proc.tail(logs.stdout + logs.stderr, _LOG_LINES)}"
        )


# -- the rehearsal ----------------------------------------------------------------------------
def rehearse(
    manifests: str | os.PathLike,
    repository: str | os.PathLike,
    *,
    image: str | None = None,
    kill_stub: bool = False,
    model: str | None = None,
    timeout_s: float = 600.0,
) -> Rehearsal:
    """Run the pod of the manifests in ``manifests`` in Docker, with ``repository`` copied into
    its claim as the manifests' README says, and play the kubelet's probes (see the module's
    docstring). ``image``: what to run instead of the manifests' image (default: theirs when this
    host has it, else :data:`STAND_IN_IMAGE`); ``model``: the one to ask (default: the first
    deployed text model); ``kill_stub``: kill a Python stub once ready and follow the probes
    until the restarted container is ready again. ``timeout_s`` bounds the whole rehearsal."""
    require_daemon()
    pod = read_pod(manifests)
    chosen = _pick_image(pod.image, image)
    result = Rehearsal(pod, chosen)
    began = time.monotonic()
    deadline = began + timeout_s
    name = f"labkit-pod-{uuid.uuid4().hex[:12]}"
    scratch = Path(tempfile.mkdtemp(prefix="labkit-rehearsal-"))
    created = False
    try:
        copied = copy_repository(
            repository, scratch / "repository", replace(DeploySettings(), models=tuple(pod.models))
        )
        config_dirs = _write_config_maps(pod, scratch / "configmaps")
        inside = sorted({port for _, port in pod.ports} | {p.port for p in pod.probes if p.port})
        host_ports = dict(zip(inside, proc.free_ports(len(inside)), strict=True))
        command = run_command(
            pod,
            name=name,
            image=chosen,
            host_ports=host_ports,
            repository=copied,
            config_dirs=config_dirs,
        )
        log.info("rehearsing %s: %s", pod.source, shlex.join(command))
        created = True
        _docker(*command[1:], timeout_s=120)
        kubelet = _Kubelet(pod, name, host_ports, result)
        url = f"127.0.0.1:{host_ports[_http_port(pod)]}"
        if not kubelet.run_until(lambda: kubelet.ready, deadline):
            raise kubelet.not_ready(
                f"not ready after {timeout_s:g} s, the rehearsal's bound (its startup budget: "
                f"{pod.startup_budget_s} s)"
            )
        result.ready = True
        result.time_to_ready_s = _ready_at(result, after=0.0)
        result.model = model or _text_model(url, pod)
        result.answer = _ask(url, result.model)
        # every probe once: liveness runs on its own ticks after the start
        kubelet.run_until(lambda: "liveness" in kubelet.last, deadline)
        if kill_stub:
            result.stub_kill = _kill_stub(kubelet, url, result, deadline)
    finally:
        if created:
            _docker("rm", "-f", name, timeout_s=120, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
        result.took_s = time.monotonic() - began
    return result


def _write_config_maps(pod: Pod, folder: Path) -> dict[str, Path]:
    """Each ConfigMap mount's files, written with its ``defaultMode``: mount path -> folder."""
    written = {}
    for index, mount in enumerate(m for m in pod.mounts if m.kind == "configmap"):
        target = folder / str(index)
        target.mkdir(parents=True)
        for file_name, text in mount.files:
            path = target / file_name
            path.write_text(text, encoding="utf-8")
            path.chmod(mount.mode)
        target.chmod(0o755)
        written[mount.path] = target
    return written


def _http_port(pod: Pod) -> int:
    """The container's HTTP port: the one named ``http``, else the startup probe's, else the
    first."""
    named = dict(pod.ports)
    if "http" in named:
        return named["http"]
    startup = pod.probe("startup")
    if startup is not None and startup.port:
        return startup.port
    return pod.ports[0][1]


def _ready_at(result: Rehearsal, after: float) -> float | None:
    return next(
        (r.at_s + r.took_s for r in result.probes if r.event == "ready" and r.at_s >= after), None
    )


def _get_json(url: str, timeout_s: float = 10.0, data: bytes | None = None):
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _text_model(url: str, pod: Pod) -> str:
    """The first deployed model that takes ``text_input`` and answers one response."""
    names = pod.models or sorted(
        row["name"]
        for row in _get_json(f"http://{url}/v2/repository/index", data=b"{}")
        if row.get("state") == "READY"
    )
    for name in names:
        config = _get_json(f"http://{url}/v2/models/{urllib.parse.quote(name)}/config")
        inputs = {i["name"] for i in config.get("input", [])}
        decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
        if client.INPUT_NAME in inputs and not decoupled:
            return name
    raise ConfigError(
        f"none of the pod's models ({', '.join(names)}) takes {client.INPUT_NAME} and answers "
        "once; pass model= one to ask"
    )


def _ask(url: str, model: str) -> str:
    """One ``/infer`` through the published port; the answer's text, checked well formed."""
    config = _get_json(f"http://{url}/v2/models/{urllib.parse.quote(model)}/config")
    batched = int(config.get("max_batch_size", 0)) > 0
    raw = client.infer_json(url, model, PROMPT, batched=batched, timeout_s=120, max_tokens=8)
    outputs = {o.get("name"): o for o in raw.get("outputs", [])}
    text = outputs.get(client.OUTPUT_NAME, {})
    data = text.get("data") or []
    if text.get("datatype") != "BYTES" or not data or not all(isinstance(d, str) for d in data):
        raise InferenceError(
            f"model {model!r} in the pod answered a malformed {client.OUTPUT_NAME}: {raw}"
        )
    if not data[0].strip():
        raise InferenceError(f"model {model!r} in the pod answered an empty text: {raw}")
    return data[0]


def _kill_stub(kubelet: _Kubelet, url: str, result: Rehearsal, deadline: float) -> StubKill:
    """Kill one Python stub (the asked model's, else the first), then probe until the kubelet
    restarted the container and it is ready again."""
    found = _docker("exec", kubelet.container, "python3", "-c", _FIND_STUBS).stdout.split()
    stubs = [
        (int(pid), Path(path).parent.parent.name)
        for pid, path in zip(found[::2], found[1::2], strict=True)
    ]
    if not stubs:
        raise ConfigError(f"the pod of {kubelet.pod.source} runs no Python stub to kill")
    pid, model = next(((p, m) for p, m in stubs if m == result.model), stubs[0])
    kill = StubKill(model=model, pid=pid, at_s=kubelet.now_s())
    _docker("exec", kubelet.container, "sh", "-c", f"kill -9 {pid}")
    log.info("killed %s's stub (pid %d) at %.1f s", model, pid, kill.at_s)
    counted = len(result.probes)
    kubelet.run_until(lambda: kubelet.restarts > 0 and kubelet.ready, deadline)
    for row in result.probes[counted:]:
        after = row.at_s + row.took_s - kill.at_s
        if row.event == "not ready" and kill.readiness_off_after_s is None:
            kill.readiness_off_after_s, kill.readiness_output = after, row.output
        if row.probe == "liveness" and not row.passed and kill.restarted_after_s is None:
            kill.liveness_failures += 1
            kill.liveness_output = row.output
        if row.event == "restarted" and kill.restarted_after_s is None:
            kill.restarted_after_s = after
    kill.restarts = kubelet.restarts
    if kubelet.restarts and kubelet.ready:
        kill.ready_again_after_s = _ready_at(result, after=kill.at_s)
        if kill.ready_again_after_s is not None:
            kill.ready_again_after_s -= kill.at_s
        kill.answer_after = _ask(url, result.model)
    return kill
