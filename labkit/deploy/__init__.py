"""The same model repository beyond this machine: Kubernetes manifests, validated offline.

- :mod:`.k8s`: plain manifests (Deployment, Service, HPA on Triton's queue time with its
  prometheus-adapter rule, the repository's claim) or a KServe InferenceService;
- :mod:`.validate`: kubernetes-validate for core resources, check-jsonschema for KServe's.
"""

from .k8s import (
    ACCELERATORS,
    NGC_IMAGE,
    DeploySettings,
    manifests,
    ngc_image,
    python_requirements,
    write_manifests,
)
from .validate import KUBERNETES_VERSION, kserve_schema, validate_manifests

__all__ = [
    "ACCELERATORS",
    "KUBERNETES_VERSION",
    "NGC_IMAGE",
    "DeploySettings",
    "kserve_schema",
    "manifests",
    "ngc_image",
    "python_requirements",
    "validate_manifests",
    "write_manifests",
]
