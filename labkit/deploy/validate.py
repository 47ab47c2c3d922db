"""Check generated manifests offline: core resources with kubernetes-validate (its bundled
Kubernetes schemas, strict), a KServe InferenceService with check-jsonschema against a schema file.

Both tools are command-line programs from PyPI (the test extra); they run through
:func:`labkit.proc.run`. No cluster is contacted.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pandas as pd
import yaml

from labkit import proc
from labkit.errors import MissingDependencyError, MissingFileError

#: The Kubernetes release the core manifests are validated against.
KUBERNETES_VERSION = "1.37.0"
#: The InferenceService schema shipped with labkit (written by scripts/make_kserve_schema.py).
KSERVE_SCHEMA = Path(__file__).resolve().parent / "schemas" / "inferenceservice-v1beta1.schema.json"
CRD_KINDS = {"InferenceService"}


def _tool(name: str) -> str:
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise MissingDependencyError(
        f"{name} is not installed; `pip install -e '.[deploy]'` in the checkout installs both "
        "validators, kubernetes-validate and check-jsonschema (make install does)"
    )


def kserve_schema(explicit: str | os.PathLike | None = None) -> Path:
    """The InferenceService JSON schema: the argument, else the one shipped with labkit."""
    path = Path(explicit) if explicit else KSERVE_SCHEMA
    if not path.is_file():
        raise MissingFileError(
            f"no KServe InferenceService schema at {str(path)!r}; pass schema= the JSON schema "
            f"file (labkit ships one at {KSERVE_SCHEMA})"
        )
    return path


def validate_manifests(
    folder: str | os.PathLike, *, schema: str | os.PathLike | None = None, timeout_s: float = 180
) -> pd.DataFrame:
    """Validate every ``*.yaml`` resource in ``folder`` (one run of each validator for all its
    files); one row per file: kind, validator, passed, and what the validator said about it.
    An invalid file raises nothing: see ``passed``."""
    folder = Path(folder)
    groups: dict[str, list[tuple[Path, str]]] = {"core": [], "crd": []}
    for path in sorted(folder.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        kind = document.get("kind") if isinstance(document, dict) else None
        if kind is not None:  # else helm values, not a resource
            groups["crd" if kind in CRD_KINDS else "core"].append((path, kind))
    commands = {
        "core": (
            f"kubernetes-validate --strict ({KUBERNETES_VERSION})",
            [_tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION],
        ),
        "crd": (
            "check-jsonschema (KServe v1beta1 schema)",
            [_tool("check-jsonschema"), "--schemafile", str(kserve_schema(schema))]
            if groups["crd"]
            else [],
        ),
    }
    rows = []
    for group, files in groups.items():
        if not files:
            continue
        validator, command = commands[group]
        result = proc.run([*command, *(p for p, _ in files)], timeout_s=timeout_s, check=False)
        lines = ((result.stdout or "") + (result.stderr or "")).splitlines()
        for path, kind in files:
            said = [line.strip() for line in lines if str(path) in line]
            failed = any(not line.startswith("INFO") for line in said) or (
                result.returncode != 0 and not any(str(p) in "\n".join(lines) for p, _ in files)
            )  # a file nobody mentions passed, unless the tool failed before naming any
            rows.append(
                {
                    "file": path.name,
                    "kind": kind,
                    "validator": validator,
                    "passed": not failed,
                    "message": "\n".join(said)
                    or ("ok" if not failed else proc.tail("\n".join(lines), 5)),
                }
            )
    frame = pd.DataFrame(rows, columns=["file", "kind", "validator", "passed", "message"])
    return frame.sort_values("file", ignore_index=True)
