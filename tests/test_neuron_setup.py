"""The Neuron host setup script: shellcheck-clean, and its dry run plans the right packages."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from labkit import hardware

SCRIPT = Path(__file__).parent.parent / "scripts" / "setup-neuron-host.sh"


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="apt-get install shellcheck")
def test_setup_script_is_shellcheck_clean():
    result = subprocess.run(
        ["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--skip-apt", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.integration
def test_inf2_dry_run_plans_the_neuron_pip_repository_and_packages(tmp_path):
    result = dry_run("--inf2", "--venv", str(tmp_path / "venv"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "global.extra-index-url https://pip.repos.neuron.amazonaws.com" in out
    assert "torch-neuronx" in out and "neuronx-cc==2.*" in out
    assert "optimum-neuron" not in out  # the LLM runs on vLLM with the Neuron plugin now
    assert not (tmp_path / "venv").exists()  # a dry run changes nothing


@pytest.mark.integration
def test_inf1_dry_run_plans_torch_neuron(tmp_path):
    out = dry_run("--inf1", "--venv", str(tmp_path / "venv")).stdout
    assert "torch-neuron neuron-cc[tensorflow]" in out and "torch-neuronx" not in out


@pytest.mark.integration
@pytest.mark.skipif(hardware.detect_neuron().present, reason="this host is a Neuron host")
def test_setup_refuses_a_host_that_is_not_neuron_without_a_target_flag():
    result = dry_run()
    assert result.returncode == 2 and "pass --inf1, --inf2 or --trn1" in result.stdout
