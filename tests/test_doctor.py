"""`labkit doctor` against this machine, and each check's verdict on a situation made real here."""

from __future__ import annotations

import ast
import dataclasses
import http.server
import json
import os
import re
import socket
import stat
import sysconfig
import threading
from pathlib import Path

import pynvml
import pytest
from test_hardware import fake_nvml

from labkit import doctor
from labkit.cli import main
from labkit.proc import free_port
from labkit.server import ServerBinary, locate_tritonserver

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_doctor_starts_triton_serves_the_probe_and_exits_by_its_failures(capsys):
    code = main(["doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}

    assert code == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    assert all(c["status"] in doctor.STATUSES and c["detail"] for c in checks.values())
    assert all(c["fix"] for c in checks.values() if c["status"] in ("warn", "fail"))
    assert not any("not checked" in c["detail"] for c in checks.values())
    assert checks["server"]["status"] == "ok", checks["server"]
    assert "Triton 2.51.0" in checks["server"]["detail"]
    assert "Python-backend" in checks["server"]["detail"]
    for name in ("python", "tritonserver", "python backend", "numpy", "jupyter kernel"):
        assert checks[name]["status"] == "ok", checks[name]


def test_the_table_and_frame_carry_every_check():
    checks = [doctor.Check("a", "ok", "fine"), doctor.Check("bb", "fail", "broken", "do this")]
    table = doctor.format_table(checks)
    assert table.splitlines() == ["OK    a   fine", "FAIL  bb  broken", "          fix: do this"]
    frame = doctor.to_frame(checks)
    assert list(frame.columns) == ["check", "status", "detail", "fix"]
    assert frame.loc[1, "status"] == "fail"
    assert doctor.exit_code(checks) == 1 and doctor.exit_code(checks[:1]) == 0


def test_a_crashing_check_is_reported_as_a_fail_with_a_fake_check(monkeypatch):
    # Fake: no shipped check crashes on purpose, so a check that raises is put in their list.
    def check_broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "CHECKS", [doctor.check_numpy, check_broken])
    numpy_check, broken = doctor.run_checks(server=False)
    assert numpy_check.status == "ok"
    assert (broken.name, broken.status, broken.detail) == ("broken", "fail", "RuntimeError: boom")


def test_numpy_2_is_a_fail_naming_the_fix():
    assert doctor.check_numpy("1.26.4").status == "ok"
    check = doctor.check_numpy("2.1.0")
    assert check.status == "fail" and "BYTES" in check.detail and "numpy<2" in check.fix


@pytest.mark.integration
def test_this_python_and_its_stub_are_ok_and_the_stub_is_checked_with_ldd():
    assert doctor.check_python().status == "ok"
    check = doctor.check_python_backend()
    assert check.status == "ok", check
    assert sysconfig.get_config_var("LIBDIR") in check.detail


@pytest.mark.integration
def test_a_stub_that_would_load_another_libpython_is_a_fail():
    binary = locate_tritonserver()
    if binary.source != "nvidia-pytriton":
        pytest.skip("the libpython trap is specific to the bundled server")
    vendored = [
        p
        for p in binary.env["LD_LIBRARY_PATH"].split(os.pathsep)
        if p.endswith("nvidia_pytriton.libs")
    ]
    without_ours = ServerBinary(
        binary.path,
        binary.source,
        binary.backend_directory,
        {**binary.env, "LD_LIBRARY_PATH": os.pathsep.join(vendored)},
    )
    check = doctor.check_python_backend(without_ours)
    assert check.status == "fail"
    assert "_PyModule_Add" in check.detail and "LD_LIBRARY_PATH" in check.fix


@pytest.mark.integration
def test_a_missing_perf_analyzer_is_a_fail_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PERF_ANALYZER", str(tmp_path / "perf_analyzer"))
    check = doctor.check_perf_analyzer()
    assert check.status == "fail" and str(tmp_path / "perf_analyzer") in check.detail
    assert "libb64-0d" in check.fix
    monkeypatch.delenv("LABKIT_PERF_ANALYZER")
    assert doctor.check_perf_analyzer().status == "ok"


def test_a_taken_port_is_a_warning_naming_it_and_its_holder():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        check = doctor.check_ports([port])
    assert check.status == "warn"
    assert f"{port} by" in check.detail and f"pid {os.getpid()}" in check.detail
    assert "port=0" in check.fix
    assert doctor.check_ports([port]).status == "ok"


@pytest.mark.integration
def test_a_triton_bound_to_all_interfaces_is_a_warning(tmp_path, start_server):
    empty = tmp_path / "repository"
    empty.mkdir()
    port = free_port()
    server = start_server(empty, host="0.0.0.0", http_port=port)
    pid = server.pid
    listed = f"pid {pid} on 0.0.0.0 ports "
    check = doctor.check_public_servers()
    assert check.status == "warn"
    assert listed in check.detail and str(port) in check.detail.split(listed, 1)[1]
    server.stop()
    # read while the pid was still known: a stopped server is no longer listed (other public
    # servers on this machine may be, so only this one's entry is checked)
    assert listed not in doctor.check_public_servers().detail


def test_small_or_missing_shared_memory_is_flagged(tmp_path):
    assert doctor.check_shm("/dev/shm", min_total_bytes=1, min_free_bytes=1).status == "ok"
    small = doctor.check_shm("/dev/shm", min_total_bytes=2**60)
    assert small.status == "warn" and "--shm-size" in small.fix
    full = doctor.check_shm("/dev/shm", min_free_bytes=2**60)
    assert full.status == "fail"
    assert doctor.check_shm(tmp_path / "no-shm").status == "fail"


def test_no_gpu_neuron_or_docker_skips_their_checks_with_a_fake_empty_path(tmp_path, monkeypatch):
    # Fake: this host has a docker client (a GPU host has nvidia-smi too); an empty PATH is a
    # host without them. A check with nothing to check is skipped, never "ok". (NVML does not
    # load here: there is no NVIDIA driver.)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert doctor.check_gpu() == doctor.Check(
        "gpu",
        "skipped",
        "no NVIDIA GPU here (no NVIDIA driver: NVML and nvidia-smi not found): the lab runs on "
        "the CPU",
    )
    assert doctor.check_neuron().status == "skipped"
    docker = doctor.check_docker()
    assert docker.status == "warn" and "no docker client" in docker.detail and docker.fix
    for check in (doctor.check_docker_gpu(), doctor.check_triton_image()):
        assert check.status == "skipped" and "no Docker engine here" in check.detail, check


def test_skipped_checks_are_counted_apart_and_fail_nothing():
    checks = [
        doctor.Check("numpy", "ok", "1.26"),
        doctor.Check("hub", "warn", "offline", "go online"),
        doctor.skipped("gpu", "no NVIDIA GPU here"),
    ]
    assert doctor.exit_code(checks) == 0
    doctor.require_no_failures(checks)
    assert doctor.summary(checks) == (
        "1 of 3 checks passed, 1 warned, 0 failed, 1 skipped: this machine can run the lab."
    )
    assert doctor.format_table(checks).splitlines()[-1] == "SKIPPED  gpu    no NVIDIA GPU here"
    failed = doctor.summary([*checks, doctor.Check("python", "fail", "no libpython", "fix")])
    assert failed.endswith("1 failed, 1 skipped: fix the failed ones first, as their rows say.")


def test_without_the_server_its_check_is_skipped_not_left_out(monkeypatch):
    monkeypatch.setattr(doctor, "CHECKS", [doctor.check_numpy, doctor.check_server])
    numpy_check, server = doctor.run_checks(server=False)
    assert (server.name, server.status) == ("server", "skipped") and "--no-server" in server.detail


def _fake_tool(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_gpu_is_listed_with_a_fake_nvml_since_no_gpu_is_here(monkeypatch):
    fake_nvml(monkeypatch, [("NVIDIA H100 80GB HBM3", 81559, 81000)], "550.54.15", 12040)
    check = doctor.check_gpu()
    assert check == doctor.Check(
        "gpu", "ok", "GPU 0: NVIDIA H100 80GB HBM3, 81559 MiB, driver 550.54.15, CUDA 12.4"
    )


def test_a_broken_gpu_driver_is_a_fail_with_a_fake_nvml(monkeypatch):
    fake_nvml(monkeypatch, [], init_error=pynvml.NVMLError_DriverNotLoaded)
    check = doctor.check_gpu()
    assert check.status == "fail" and "Driver Not Loaded" in check.detail and check.fix
    torch_check = doctor.check_torch_gpu()
    assert torch_check.status == "warn" and "the NVIDIA driver failed" in torch_check.detail


def test_an_unreachable_docker_engine_is_a_warning_with_a_fake_client_since_none_runs_here(
    tmp_path, monkeypatch
):
    _fake_tool(tmp_path, "docker", 'echo "Cannot connect to the Docker daemon" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    check = doctor.check_docker()
    assert check.status == "warn" and "Cannot connect to the Docker daemon" in check.detail


@pytest.mark.integration
def test_the_token_is_named_never_shown(monkeypatch, capsys):
    secret = "hf_doNotShowThisValue123"
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "PRIVATE_REPO_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert doctor.check_token().status == "warn"
    monkeypatch.setenv("PRIVATE_REPO_TOKEN", secret)
    check = doctor.check_token()
    assert check.status == "ok" and "PRIVATE_REPO_TOKEN" in check.detail
    main(["doctor", "--no-server"])
    main(["doctor", "--no-server", "--json"])
    printed = capsys.readouterr()
    assert secret not in printed.out + printed.err and "PRIVATE_REPO_TOKEN" in printed.out


class _Hub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"[]")

    def log_message(self, *args):
        pass


def test_the_hub_check_reports_reachable_unreachable_and_offline_with_a_fake_hub(monkeypatch):
    # Fake: no hub is reachable from here; a local HTTP server answers in its place.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = http.server.HTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.server_port}")
        assert doctor.check_hub().status == "ok"
    finally:
        hub.shutdown()
        hub.server_close()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    down = doctor.check_hub(timeout_s=2)
    assert down.status == "warn" and "offline" in down.detail
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = doctor.check_hub()
    assert offline.status == "skipped" and "HF_HUB_OFFLINE" in offline.detail


def test_require_no_failures_names_each_failed_check_and_its_fix():
    doctor.require_no_failures(
        [doctor.Check("numpy", "ok", "1.26"), doctor.Check("x", "warn", "y", "z")]
    )
    with pytest.raises(
        doctor.MissingDependencyError, match=r"numpy: numpy 2\.1\.0.*fix: pip install"
    ):
        doctor.require_no_failures([doctor.check_numpy("2.1.0")])


# -- the GPU host: the lab's torch, Docker's NVIDIA runtime and the lab's image --------
def _gpu_host(folder: Path, monkeypatch, cuda: str = "13.0") -> None:
    """A fake NVML: one H200 whose driver supports CUDA ``cuda`` (``folder``: unused, kept for
    the callers' shape)."""
    major, minor = cuda.split(".")
    code = int(major) * 1000 + int(minor) * 10
    fake_nvml(monkeypatch, [("NVIDIA H200", 143771, 143000)], "580.65", code)


@pytest.mark.integration
def test_a_cpu_only_torch_on_a_gpu_host_is_a_fail_with_its_fix_with_a_fake_nvml(
    tmp_path, monkeypatch
):
    """No GPU here (a fake NVML), and this machine's torch is the CPU build: on a GPU host that
    is the failure."""
    import importlib.metadata
    import sys

    _gpu_host(tmp_path, monkeypatch, cuda="13.0")
    check = doctor.check_torch_gpu()
    version = importlib.metadata.version("torch")
    assert check.status == "fail"
    assert f"torch {version} is a CPU-only build, but this host has NVIDIA H200" in check.detail
    release = version.split("+")[0]
    assert check.fix.startswith(
        f'{sys.executable} -m pip install "torch=={release}+cu130" --index-url '
        "https://download.pytorch.org/whl/cu130"
    )
    checks = {c.name: c for c in doctor.run_checks(server=False)}
    assert checks["torch gpu"] == check
    assert checks["gpu"].detail == (
        "GPU 0: NVIDIA H200, 143771 MiB, driver 580.65, CUDA 13.0"
    )  # driver, CUDA and memory
    assert doctor.exit_code(checks.values()) == 1


def test_the_torch_fix_names_the_newest_cuda_build_the_driver_runs():
    assert doctor.torch_cuda_build("12.9") == "12.8"
    assert doctor.torch_cuda_build("13.2") == "13.0"
    assert "cu128" in doctor.torch_install_fix("2.13.0+cpu", "12.9")
    old = doctor.torch_install_fix("2.13.0+cpu", "12.2")
    assert old.startswith("update the NVIDIA driver") and "12.6 or newer" in old


def test_torch_on_a_host_without_gpu_is_skipped_with_a_fake_empty_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    check = doctor.check_torch_gpu()
    assert check.status == "skipped" and "no NVIDIA GPU" in check.detail


def _fake_docker(folder: Path, monkeypatch, runtimes: str, image: bool) -> None:
    """A docker client whose engine answers (none runs here), with these runtimes and image."""
    tool = folder / "docker"
    inspect = 'echo "sha256:1234"' if image else 'echo "Error: No such image: $5" >&2; exit 1'
    tool.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        '  "version --format") echo "27.3.1";;\n'
        f"  \"info --format\") echo '{runtimes}';;\n"
        f'  "image inspect") {inspect};;\n'
        "  *) exit 1;;\n"
        "esac\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr("labkit.server.image._CHECKED", {})


def test_docker_without_the_nvidia_runtime_on_a_gpu_host_is_a_warning_with_a_fake_docker(
    tmp_path, monkeypatch
):
    _gpu_host(tmp_path, monkeypatch)
    monkeypatch.setattr(doctor.shutil, "which", _which_without("nvidia-container-runtime-hook"))
    _fake_docker(tmp_path, monkeypatch, '{"runc": {}, "io.containerd.runc.v2": {}}', image=True)
    check = doctor.check_docker_gpu()
    assert check.status == "warn" and "no NVIDIA runtime" in check.detail
    assert "nvidia-container-toolkit" in check.fix and "nvidia-ctk runtime configure" in check.fix
    _fake_docker(tmp_path, monkeypatch, '{"nvidia": {"path": "nvidia-container-runtime"}}', True)
    assert doctor.check_docker_gpu().status == "ok"


def test_a_docker_image_that_is_not_built_is_a_warning_naming_the_build_with_a_fake_docker(
    tmp_path, monkeypatch
):
    _fake_docker(tmp_path, monkeypatch, "{}", image=False)
    monkeypatch.delenv("LABKIT_TRITON_IMAGE", raising=False)
    check = doctor.check_triton_image()
    assert check.status == "warn" and "triton_transformer_server:26.06" in check.detail
    assert check.fix.startswith("labkit image build;")  # NGC's build, then the stand-in's two
    assert (
        "labkit image base, then labkit image build --base triton_labkit_base:2.51-cpu" in check.fix
    )


def _which_without(name: str):
    import shutil

    real = shutil.which

    def which(command, *args, **kwargs):
        return (
            None if command == name or command == "nvidia-ctk" else real(command, *args, **kwargs)
        )

    return which


# -- .venv-vllm, the environment of smollm2_vllm (no server) --------------------------------
GOOD = {"python": "3.11", "numpy": "1.26.4", "vllm": "0.32.0", "torchvision": False}


def test_the_doctor_passes_a_good_vllm_environment_and_names_its_versions():
    check = doctor.vllm_env_verdict(GOOD, Path("/x/.venv-vllm"), "3.11")
    assert check.status == "ok"
    assert check.detail == "/x/.venv-vllm: vLLM 0.32.0, Python 3.11, numpy 1.26.4"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"python": "3.12"}, "its Python is 3.12, the server's stub runs 3.11"),
        ({"numpy": "2.2.1"}, r"numpy 2.2.1 \(the Python backend needs numpy < 2\)"),
        ({"torchvision": True}, "torchvision is installed"),
        ({"error": "ImportError: no vllm"}, "vllm does not import there: ImportError: no vllm"),
    ],
)
def test_the_doctor_fails_a_broken_vllm_environment_saying_why(change, words):
    check = doctor.vllm_env_verdict({**GOOD, **change}, Path("/x/.venv-vllm"), "3.11")
    assert check.status == "fail"
    assert check.fix == "rm -rf /x/.venv-vllm && make install"
    assert re.search(words, check.detail), check.detail


def test_the_doctor_warns_without_the_vllm_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "environment_folder", lambda name: tmp_path / ".venv-vllm")
    check = doctor.check_vllm_env()
    assert (check.status, check.fix) == ("warn", "run make install")
    assert "smollm2_vllm model cannot load" in check.detail


# -- the system tools the lab runs ----------------------------------------------------------------
def test_a_system_tool_is_found_with_its_version_or_named_with_its_fix_with_fakes(
    tmp_path, monkeypatch
):
    # Fake: haproxy and setpriv are installed here; an empty PATH (and no /usr/sbin) is a host
    # without them, and a fake haproxy first on PATH stands in for an installed one.
    haproxy = dataclasses.replace(doctor.SYSTEM_TOOLS["haproxy"], also=())
    monkeypatch.setenv("PATH", str(tmp_path))
    missing = doctor.check_tool(haproxy)
    assert (missing.status, missing.fix) == (
        "warn",
        "sudo apt-get install -y haproxy (make install does it as root)",
    )
    assert missing.detail.startswith("haproxy is not installed; the lab runs it for the balancer")
    _fake_tool(tmp_path, "haproxy", 'echo "HAProxy version 2.6.12-1+deb12u4"')
    found = doctor.check_tool(haproxy)
    assert found == doctor.Check(
        "haproxy",
        "ok",
        f"{tmp_path / 'haproxy'} (HAProxy version 2.6.12-1+deb12u4), for the balancer in front "
        "of notebook 07's replicas",
    )
    _fake_tool(tmp_path, "setpriv", 'echo "setpriv: cannot run here" >&2; exit 3')
    broken = doctor.check_tool(doctor.SYSTEM_TOOLS["setpriv"])
    assert broken.status == "warn" and "exited with 3: setpriv: cannot run here" in broken.detail


def test_every_program_labkit_runs_by_name_has_a_doctor_row():
    """A program named in shutil.which(...) or as the first word of a command is checked by
    doctor: by its own row (SYSTEM_TOOLS) or by the check named here."""
    checked_elsewhere = {
        "docker": "docker", "nvidia-ctk": "docker gpu", "nvidia-container-runtime-hook": "docker gpu",
        "ldd": "python backend", "nvidia-smi": "gpu", "neuron-ls": "neuron",
        "tritonserver": "tritonserver", "perf_analyzer": "perf analyzer",
        "model-analyzer": "model analyzer",
        "aiperf": None,  # a Python tool in .venv-aiperf (make install); its errors name the fix
        "bash": None,  # make install itself runs in it
        "sh": None, "tar": None,  # POSIX: in every image and on every host the lab runs on
    }  # fmt: skip
    named = set()
    for path in (ROOT / "labkit").rglob("*.py"):
        if {"templates", "gpu_check"} & set(path.relative_to(ROOT / "labkit").parts):
            continue  # model code runs in Triton; the GPU check runs on a bare host
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args:
                first = node.args[0]
                if isinstance(first, ast.List) and first.elts:
                    first = first.elts[0]
                callee = ast.unparse(node.func)
                runs = callee in ("shutil.which", "proc.run", "subprocess.run", "subprocess.Popen")
                if runs and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    named.add(first.value)
    assert {"haproxy", "setpriv", "docker"} <= named  # the scan sees what it should
    unchecked = named - set(doctor.SYSTEM_TOOLS) - set(checked_elsewhere)
    assert unchecked == set(), "give these a row in doctor.SYSTEM_TOOLS"
    rows = {check.__name__.removeprefix("check_").replace("_", " ") for check in doctor.CHECKS}
    assert set(doctor.SYSTEM_TOOLS) | {c for c in checked_elsewhere.values() if c} <= rows
