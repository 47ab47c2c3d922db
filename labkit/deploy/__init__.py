"""The same model repository beyond this machine: Kubernetes manifests, validated offline.

- :mod:`.k8s`: plain manifests (Deployment, Service, HPA on Triton's queue time with its
  prometheus-adapter rule, the repository's claim) or a KServe InferenceService;
- :mod:`.validate`: kubernetes-validate for core resources, check-jsonschema for KServe's;
- :mod:`.portable`: the paths of this machine that a file written for another must not name;
- :mod:`.rehearsal`: a written pod run here in Docker, its probes played as the kubelet plays them.
"""

from .k8s import (
    ACCELERATORS,
    NGC_IMAGE,
    DeploySettings,
    copy_command,
    copy_repository,
    deployed_models,
    manifests,
    ngc_image,
    python_requirements,
    runs_elsewhere,
    settings_for,
    write_manifests,
)
from .portable import Finding, find_machine_paths, machine_paths, scan
from .rehearsal import Rehearsal, rehearsal_problem, rehearsal_table, rehearse
from .validate import KUBERNETES_VERSION, kserve_schema, validate_manifests

__all__ = [
    "ACCELERATORS",
    "KUBERNETES_VERSION",
    "NGC_IMAGE",
    "DeploySettings",
    "Finding",
    "Rehearsal",
    "copy_command",
    "copy_repository",
    "deployed_models",
    "find_machine_paths",
    "kserve_schema",
    "machine_paths",
    "manifests",
    "ngc_image",
    "python_requirements",
    "rehearsal_problem",
    "rehearsal_table",
    "rehearse",
    "runs_elsewhere",
    "scan",
    "settings_for",
    "validate_manifests",
    "write_manifests",
]
