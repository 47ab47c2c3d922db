"""The GPU check: its bundle (built here for real, size and contents), its runner (run here on the
CPU, end to end, and on the real bundle, where it says why it cannot run), and the GPU-aware
install (scripts/install.sh with a fake nvidia-smi: no GPU here)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from labkit import doctor
from labkit.cli import main
from labkit.gpu_check import SIZE_LIMIT_BYTES, BundleInfo, build_bundle, remote
from labkit.gpu_check.bundle import (
    AGREEMENT,
    NO_BATCHING,
    elf_needed,
    needed_libraries,
    wheel_root,
)
from labkit.repository import parse_config

ROOT = Path(__file__).resolve().parents[1]
SERVER = wheel_root() / remote.SERVER_DIR


@pytest.fixture(scope="module")
def gpu_bundle(tmp_path_factory):
    """The real bundle, for Python 3.12 and KIND_GPU, exactly as the GPU machine gets it,
    built by the command the README gives (``labkit gpu bundle``)."""
    folder = tmp_path_factory.mktemp("gpu") / "bundle"
    assert main(["gpu", "bundle", str(folder)]) == 0
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    return BundleInfo(folder, files, json.loads((folder / remote.MANIFEST).read_text()))


@pytest.fixture(scope="module")
def unpacked(gpu_bundle, tmp_path_factory):
    target = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(gpu_bundle.path / remote.ARCHIVE) as archive:
        archive.extractall(target, filter="tar")
    return target


@pytest.mark.integration
@pytest.mark.slow
def test_the_bundle_fits_in_60_mib_and_holds_four_files(gpu_bundle):
    files = set(gpu_bundle.files)
    wheel = gpu_bundle.manifest["numpy_wheel"]
    assert files == {remote.ARCHIVE, remote.MANIFEST, remote.RUNNER, wheel}
    on_disk = sum(p.stat().st_size for p in gpu_bundle.path.rglob("*") if p.is_file())
    assert on_disk == gpu_bundle.total_bytes <= SIZE_LIMIT_BYTES == 60 * 2**20
    assert (gpu_bundle.path / remote.RUNNER).read_bytes() == Path(remote.__file__).read_bytes()


@pytest.mark.integration
@pytest.mark.slow
def test_the_bundle_takes_only_the_server_its_libraries_and_the_312_stub(unpacked):
    server = unpacked / remote.SERVER_DIR
    shipped = {str(p.relative_to(server)) for p in server.rglob("*") if p.is_file()}
    assert shipped == {
        "bin/tritonserver",
        "backends/python/libtriton_python.so",
        "backends/python/triton_python_backend_utils.py",
        "backends/python/triton_python_backend_stub",
        "caches/local/libtritoncache_local.so",
    }
    stub = server / "backends/python/triton_python_backend_stub"
    wheel_stub = SERVER / "python_backend_stubs/3.12/triton_python_backend_stub"
    assert _digest(stub) == _digest(wheel_stub)
    assert "libpython3.12.so.1.0" in elf_needed(stub)
    assert os.access(server / "bin/tritonserver", os.X_OK) and os.access(stub, os.X_OK)

    libraries = {p.name for p in (unpacked / remote.LIBS_DIR).iterdir()}
    assert any(n.startswith("libtritonserver") for n in libraries)
    assert not any(n.startswith("libpython") for n in libraries)  # the wheel's 3.13 stays behind
    elf = [p for p in unpacked.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    vendored = {p.name for p in (wheel_root() / remote.LIBS_DIR).iterdir()}
    for path in elf:  # every vendored library anything shipped loads is shipped too
        missing = (set(elf_needed(path)) & vendored) - libraries
        assert not missing, f"{path.name} needs {missing}"


@pytest.mark.integration
def test_elf_needed_reads_what_readelf_reads():
    if not shutil.which("readelf"):
        pytest.skip("readelf (binutils) is not installed to compare with")
    binary = SERVER / "bin" / "tritonserver"
    out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True).stdout
    assert elf_needed(binary) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", out)
    assert needed_libraries([binary], wheel_root() / remote.LIBS_DIR)  # the closure is not empty


@pytest.mark.integration
@pytest.mark.slow
def test_the_bundle_holds_the_labs_model_code_on_kind_gpu_and_no_weights(unpacked, gpu_bundle):
    repository = unpacked / remote.REPOSITORY_DIR
    models = sorted(p.name for p in repository.iterdir())
    assert set(AGREEMENT.values()) | {NO_BATCHING} <= set(models)
    template = ROOT / "labkit" / "templates" / "textgen"
    for name in models:
        config = parse_config((repository / name / "config.pbtxt").read_text())
        assert [g.kind for g in config.instance_group] == [config.instance_group[0].KIND_GPU]
        for code in template.glob("*.py"):
            assert (repository / name / "1" / code.name).read_bytes() == code.read_bytes()
    dtypes = {
        name: parse_config((repository / name / "config.pbtxt").read_text())
        .parameters["dtype"]
        .string_value
        for name in AGREEMENT.values()
    }
    assert dtypes == {v: k for k, v in AGREEMENT.items()}
    nobatch = parse_config((repository / NO_BATCHING / "config.pbtxt").read_text())
    assert not nobatch.HasField("dynamic_batching")
    weights = [p for p in unpacked.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    assert weights == []
    assert gpu_bundle.manifest["bench"]["models"]["batching_off"] == NO_BATCHING


@pytest.mark.integration
@pytest.mark.slow
def test_the_bundled_config_builds_a_model_of_smollm2_135m_size(unpacked):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from labkit.repository import build_weights

    real = build_weights("smollm2")
    with torch.device("meta"):
        ours = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(unpacked / "model"))
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    assert 130e6 < count < 140e6
    tokenizer = AutoTokenizer.from_pretrained(unpacked / "model")
    assert tokenizer.padding_side == "left"
    for text in remote.PROMPTS:
        assert tokenizer(text).input_ids == AutoTokenizer.from_pretrained(real)(text).input_ids


@pytest.mark.integration
@pytest.mark.slow
def test_the_bundled_numpy_is_below_2_and_built_for_cpython_312(gpu_bundle):
    wheel = gpu_bundle.path / gpu_bundle.manifest["numpy_wheel"]
    assert re.fullmatch(r"numpy-1\.\d+\.\d+-cp312-cp312-manylinux.*x86_64.*\.whl", wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert any(re.search(r"numpy/core/_multiarray_umath\.cpython-312-x86_64", n) for n in names)


def gpu_usable_here() -> bool:
    """Whether the runner would find a GPU here: ``nvidia-smi -L`` lists one and this Python's
    torch can use it (the runner runs on ``sys.executable``; a CPU-only torch cannot)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    if not re.search(r"^GPU \d", listed.stdout, re.MULTILINE):
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.integration
@pytest.mark.slow
def test_the_check_says_why_it_did_not_run_on_this_machine(gpu_bundle, tmp_path):
    """The bundle is for Python 3.12 and a GPU: on a host with another Python, or without a
    usable GPU, the runner does not run, and names each reason that holds here and no other.
    The same command is the one the GPU machine runs."""
    other_python = sys.version_info[:2] != (3, 12)
    no_gpu = not gpu_usable_here()
    if not (other_python or no_gpu):
        pytest.skip("Python 3.12 with a usable GPU: here the check runs for real")
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--run", str(gpu_bundle.path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=300,
    )
    assert done.returncode == remote.EXIT_NOT_RUN, done.stdout + done.stderr
    result = json.loads((out / remote.RESULT).read_text())
    assert result["status"] == "not_run"
    assert ("the bundle's stub is for 3.12" in result["reason"]) is other_python, result["reason"]
    assert ("no usable NVIDIA GPU" in result["reason"]) is no_gpu, result["reason"]
    assert "labkit gpu check: not_run" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == [remote.RESULT]
    assert main(["gpu", "show", str(out / remote.RESULT)]) == remote.EXIT_NOT_RUN


@pytest.mark.integration
@pytest.mark.slow
def test_the_runner_serves_checks_and_measures_end_to_end_on_this_cpu(tmp_path):
    """The runner's whole path, on a bundle for this Python and KIND_CPU with a tiny model: the
    bundled server and stub, numpy<2 first on the stub's path, the random model, agreement,
    benchmarks and metrics. Only the device differs from the GPU machine's run."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    bundle = build_bundle(
        tmp_path / "bundle", python=python, device="cpu", size="tiny", archive=False
    )
    out = tmp_path / "out"
    code = remote.main(["--bundle", str(bundle.path), "--out", str(out), "--bench-seconds", "2"])
    result = json.loads((out / remote.RESULT).read_text())
    assert code == remote.EXIT_PASSED, remote.summary(result)
    assert result["status"] == "passed" and result["failures"] == []
    assert result["stub_python"]["numpy"].startswith("1.")
    assert result["server"]["version"] == "2.51.0"
    assert set(result["server"]["instances"].values()) == {"cpu"}
    assert result["agreement"]["float32"]["batched_equals_alone"] == "8/8"
    assert result["agreement"]["float32"]["concurrent_equals_alone"] == "8/8"
    for dtype in ("float16", "bfloat16"):
        assert re.fullmatch(r"\d/8", result["agreement"][dtype]["alone_equals_float32"])
    on, off = result["benchmarks"]["batching_on"], result["benchmarks"]["batching_off"]
    assert on["requests"] > 0 and off["requests"] > 0 and on["errors"] == off["errors"] == 0
    assert off["avg_batch_size"] == 1.0
    assert "inflight" in result["benchmarks"]
    assert "triton_note" in on["gpu"]  # no GPU here: Triton reports no GPU figures
    assert (out / remote.SERVER_LOG).stat().st_size > 0
    assert sorted(p.name for p in out.iterdir()) == [remote.RESULT, remote.SERVER_LOG]
    assert main(["gpu", "show", str(out / remote.RESULT)]) == 0


def test_prometheus_text_is_read_into_counters_per_model():
    text = (
        "# HELP nv_inference_count Number of inferences\n"
        'nv_inference_count{model="a",version="1"} 12\n'
        'nv_inference_count{model="ab",version="1"} 5\n'
        'nv_inference_exec_count{model="a",version="1"} 4\n'
        'nv_gpu_utilization{gpu_uuid="GPU-1"} 0.75\n'
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-1"} 1048576\n'
    )
    after = remote.parse_metrics(text)
    before = remote.parse_metrics(text.replace(" 12\n", " 2\n"))
    assert remote.delta(before, after, "nv_inference_count", "a") == 10
    assert remote.delta({}, after, "nv_inference_exec_count", "a") == 4
    assert remote.gpu_figures(after) == {
        "nv_gpu_utilization": 0.75,
        "nv_gpu_memory_used_bytes": 1048576.0,
    }


# -- the GPU-aware install (scripts/install.sh) ----------------------------------------------------
INSTALL = ROOT / "scripts" / "install.sh"
BLOCK = re.compile(r"^# >>> torch:.*?^# <<< torch$", re.M | re.S)


def install_block() -> str:
    found = BLOCK.search(INSTALL.read_text())
    if not found:
        pytest.fail("scripts/install.sh has no '# >>> torch' ... '# <<< torch' block")
    return found[0]


def _fake_tool(folder: Path, name: str, script: str) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_install_block(tmp_path, cuda: str | None, pip_fails: bool = False, **env: str):
    """The block as install.sh runs it, with a fake nvidia-smi (none here) and a fake pip."""
    tools = tmp_path / "bin"
    if cuda is not None:
        _fake_tool(
            tools,
            "nvidia-smi",
            'case "$1" in\n'
            '  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)";;\n'
            f'  *) echo "| NVIDIA-SMI 580.65   Driver Version: 580.65   CUDA Version: {cuda} |";;\n'
            "esac",
        )
    _fake_tool(tools, "fakepip", f'echo "pip $*" >> {tmp_path}/pip.log\nexit {int(pip_fails)}')
    script = f"set -euo pipefail\nVENV=.venv\nPIP=({tools}/fakepip install)\n"
    script += install_block() + '\necho "torch_spec=$torch_spec"\n'
    path = f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin"
    done = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": path, "HOME": str(tmp_path), **env},
        timeout=60,
    )
    log = tmp_path / "pip.log"
    return done, log.read_text().splitlines() if log.exists() else []


@pytest.mark.integration
def test_install_takes_the_newest_cuda_torch_the_driver_runs_with_a_fake_nvidia_smi(tmp_path):
    done, pip = run_install_block(tmp_path, cuda="12.9")
    assert done.returncode == 0, done.stderr
    assert pip == [
        "pip install torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128"
    ]
    assert "torch_spec=torch==2.13.0+cu128" in done.stdout


@pytest.mark.integration
def test_install_takes_the_cpu_torch_without_a_gpu(tmp_path):
    done, pip = run_install_block(tmp_path, cuda=None)
    assert done.returncode == 0, done.stderr
    assert pip == ["pip install torch==2.13.0"]


@pytest.mark.integration
def test_install_stops_with_the_exact_command_when_no_cuda_torch_installs_with_a_fake_nvidia_smi(
    tmp_path,
):
    done, pip = run_install_block(tmp_path, cuda="13.1", pip_fails=True)
    assert done.returncode == 1
    assert len(pip) == 3  # cu130, cu128, cu126: each tried once
    assert (
        '.venv/bin/python -m pip install "torch==2.13.0+cu130" --index-url '
        "https://download.pytorch.org/whl/cu130" in done.stderr
    )


@pytest.mark.integration
def test_install_dry_run_prints_the_command_and_installs_nothing_with_a_fake_nvidia_smi(
    tmp_path,
):
    done, pip = run_install_block(tmp_path, cuda="13.0", LABKIT_INSTALL_DRY_RUN="1")
    assert done.returncode == 0 and pip == []
    assert "would run: pip install torch==2.13.0+cu130" in done.stdout
    assert "torch_spec=" not in done.stdout  # the dry run stops after the torch choice


def test_install_and_doctor_know_the_same_cuda_builds_of_torch():
    default = re.search(r'TORCH_CUDA_BUILDS=\$\{TORCH_CUDA_BUILDS:-"([^"]+)"\}', install_block())
    assert tuple(default[1].split()) == doctor.TORCH_CUDA_BUILDS
    pinned = re.search(r"^TORCH_VERSION=(\S+)$", install_block(), re.M)[1]
    assert (
        pinned
        == re.search(
            r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "docker" / "Dockerfile").read_text(), re.M
        )[1]
    )


def test_environment_yml_says_the_same_for_a_gpu_host():
    text = (ROOT / "environment.yml").read_text()
    pinned = re.search(r"^TORCH_VERSION=(\S+)$", install_block(), re.M)[1]
    assert f"- torch=={pinned}\n" in text
    tags = ["cu" + build.replace(".", "") for build in doctor.TORCH_CUDA_BUILDS]
    assert f"# - torch=={pinned}+{tags[0]}" in text
    assert all(tag in text for tag in tags) and "labkit doctor" in text


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
