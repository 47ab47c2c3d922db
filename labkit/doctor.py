"""``labkit doctor``: check that this machine can run the lab, and say how to fix what cannot.

Each check returns a :class:`Check` with status ``ok``, ``warn``, ``fail`` or ``skipped`` and,
when it warns or fails, the fix. ``skipped`` is a check that did not run because this machine has
nothing for it to check (no NVIDIA GPU, no Neuron device, no Docker engine): the detail says why,
and it is never counted as passed. :func:`run_checks` runs them all (a check that crashes is
reported as a fail, never raised); :func:`to_frame` makes a DataFrame for the notebook; the command
exits 1 on any fail.
Secrets are never shown: the token check names the variable, never its value.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import psutil
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from labkit import hardware, proc
from labkit.errors import LabkitError, MissingDependencyError
from labkit.headless import check_kernel as kernel_python
from labkit.profiling import locate_perf_analyzer
from labkit.repository import environment_folder
from labkit.server import ServerBinary, TritonServer, locate_tritonserver, require_image
from labkit.server.base_image import BASE_IMAGE
from labkit.server.image import ON_STAND_IN, inspect_image
from labkit.settings import hub_endpoint, hub_offline, token_variable, triton_image

log = logging.getLogger(__name__)

LAB_PORTS = (8000, 8001, 8002)
#: Below this total the Python backend's shared memory runs out on real models (Docker: 64 MiB).
SHM_MIN_TOTAL_BYTES = 256 * 1024**2
SHM_MIN_FREE_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    status: str
    detail: str
    fix: str = ""


def passed(name: str, detail: str) -> Check:
    """An ok check with its detail."""
    return Check(name, "ok", detail)


def skipped(name: str, why: str) -> Check:
    """A check that did not run: this machine has nothing for it to check (``why`` says what)."""
    return Check(name, "skipped", why)


# -- checks -------------------------------------------------------------------------------------
def _listeners(port: int) -> str:
    try:
        held = {
            f"{c.pid and psutil.Process(c.pid).name()} (pid {c.pid})"
            for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == "LISTEN"
        }
    except Exception:  # noqa: BLE001 (psutil may not see other users' sockets)
        return "another process"
    return ", ".join(sorted(held)) or "another process"


def check_ports(ports: Sequence[int] = LAB_PORTS) -> Check:
    taken = []
    for port in ports:
        try:
            proc.check_port_free(port, "0.0.0.0")
        except LabkitError:
            taken.append(f"{port} by {_listeners(port)}")
    if taken:
        return Check(
            "ports",
            "warn",
            f"in use: {'; '.join(taken)}",
            "stop what holds them, or "
            "pass http_port=0, grpc_port=0, metrics_port=0 (labkit picks free ports)",
        )
    return passed("ports", f"{', '.join(map(str, ports))} are free")


def check_public_servers() -> Check:
    """Warn about any running tritonserver that listens on all interfaces."""

    public, count = [], 0
    for p in psutil.process_iter(["name", "pid"]):
        if p.info["name"] != "tritonserver":
            continue
        count += 1
        try:
            ports = sorted(
                {
                    c.laddr.port
                    for c in p.net_connections("inet")
                    if c.status == "LISTEN" and c.laddr.ip in ("0.0.0.0", "::")
                }
            )
        except psutil.Error:
            continue
        if ports:
            public.append(f"pid {p.info['pid']} on 0.0.0.0 ports {', '.join(map(str, ports))}")
    if public:
        return Check(
            "servers open to the network",
            "warn",
            f"tritonserver listens on all interfaces: {'; '.join(public)}",
            "anyone on the network can call it; restart it "
            "bound to loopback (labkit's default host 127.0.0.1)",
        )
    if not count:
        return passed("servers open to the network", "no tritonserver is running")
    return passed(
        "servers open to the network", f"{count} tritonserver running, none on all interfaces"
    )


def check_shm(
    path: str | os.PathLike = "/dev/shm",
    min_total_bytes: int = SHM_MIN_TOTAL_BYTES,
    min_free_bytes: int = SHM_MIN_FREE_BYTES,
) -> Check:
    """The Python backend passes tensors through shared memory; Docker's 64 MiB is too little."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return Check(
            "/dev/shm",
            "fail",
            f"{path} does not exist",
            "mount a tmpfs on /dev/shm (in Docker: --shm-size=1g)",
        )
    size = f"{usage.total / 2**20:.0f} MiB, {usage.free / 2**20:.0f} MiB free"
    if usage.free < min_free_bytes:
        return Check(
            "/dev/shm",
            "fail",
            f"{path}: {size}",
            "free shared memory (stale "
            "triton_python_backend_shm_region_* files) or enlarge it (--shm-size=1g)",
        )
    if usage.total < min_total_bytes:
        return Check(
            "/dev/shm",
            "warn",
            f"{path}: {size}, below {min_total_bytes / 2**20:.0f} "
            "MiB (Docker's 64 MB default is a known trap)",
            "docker run --shm-size=1g",
        )
    return passed("/dev/shm", f"{path}: {size}")


#: The gpu check's detail on a host without an NVIDIA driver.
NO_GPU = (
    "no NVIDIA GPU here (no NVIDIA driver: NVML and nvidia-smi not found): the lab runs on the CPU"
)


def check_gpu() -> Check:
    """The NVIDIA GPUs, their driver and CUDA version, from :mod:`labkit.hardware` (NVML)."""
    try:
        found = hardware.gpus()
    except LabkitError as exc:
        return Check(
            "gpu",
            "fail",
            f"the NVIDIA driver is installed but failed: {exc}",
            "check the driver (nvidia-smi should list the GPU) before the lab can use the device",
        )
    if not found:
        return skipped("gpu", NO_GPU)
    return passed(
        "gpu",
        "; ".join(
            f"GPU {g.index}: {g.name}, {g.memory_total_mib} MiB, driver {g.driver}"
            + (f", CUDA {g.cuda}" if g.cuda else "")
            for g in found
        ),
    )


#: The CUDA builds of torch that PyTorch's own index serves, newest first
#: (``https://download.pytorch.org/whl/cu<XY>``); scripts/install.sh tries the same ones.
TORCH_CUDA_BUILDS = ("13.0", "12.8", "12.6")
TORCH_INDEX_URL = "https://download.pytorch.org/whl/cu{tag}"
#: Run in the lab's Python: what its torch is built for and whether it can use a GPU.
_TORCH_PROBE = """
import json
found = {}
try:
    import torch
    found.update(version=torch.__version__, cuda=torch.version.cuda)
    found.update(available=torch.cuda.is_available(), count=torch.cuda.device_count())
    if found["available"]:
        found["device"] = torch.cuda.get_device_name(0)
except Exception as exc:
    found["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


def torch_cuda_build(driver_cuda: str | None) -> str | None:
    """The newest of :data:`TORCH_CUDA_BUILDS` that a driver supporting ``driver_cuda`` runs."""

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(p) for p in version.split("."))

    if not driver_cuda:
        return TORCH_CUDA_BUILDS[0]
    fits = [b for b in TORCH_CUDA_BUILDS if key(b) <= key(driver_cuda)]
    return fits[0] if fits else None


def torch_install_fix(torch_version: str, driver_cuda: str | None) -> str:
    """The exact command that puts a CUDA build of this torch release in the lab's Python."""
    release = torch_version.split("+")[0]
    build = torch_cuda_build(driver_cuda)
    if build is None:
        return (
            f"update the NVIDIA driver: the driver supports CUDA {driver_cuda}, torch {release}'s "
            f"CUDA builds need {TORCH_CUDA_BUILDS[-1]} or newer; then run make install"
        )
    tag = build.replace(".", "")
    return (
        f'{sys.executable} -m pip install "torch=={release}+cu{tag}" --index-url '
        f"{TORCH_INDEX_URL.format(tag=tag)} (a CUDA {build} build; the driver supports CUDA "
        f"{driver_cuda or 'unknown'})"
    )


def check_torch_gpu() -> Check:
    """On a GPU host, the lab's torch must be a CUDA build that can use the GPU.

    A CPU-only torch on a GPU host is the silent failure: every model then runs on the CPU and
    nothing says so. The probe runs in a child of this Python (the one whose torch the local
    server's stub imports), so a torch that crashes on CUDA init cannot take the doctor down.
    """
    try:
        found = hardware.gpus()
    except LabkitError:
        return Check(
            "torch gpu",
            "warn",
            "the NVIDIA driver failed (see the gpu check), so whether torch can use the GPU is "
            "unknown",
            "fix the driver first, then run labkit doctor again",
        )
    if not found:
        version = importlib.metadata.version("torch")
        return skipped("torch gpu", f"no NVIDIA GPU here: torch {version} runs on the CPU")
    gpu, cuda = f"{found[0].name} (GPU 0)", found[0].cuda
    ran = proc.run([sys.executable, "-c", _TORCH_PROBE], timeout_s=180, check=False)
    lines = ran.stdout.strip().splitlines()
    probe = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if "version" not in probe:
        reason = probe.get("error") or proc.tail(ran.stderr or "no output", 3)
        return Check(
            "torch gpu",
            "fail",
            f"this host has {gpu}, but torch does not import in {sys.executable}: {reason}",
            "run make install",
        )
    version = probe["version"]
    if probe["cuda"] is None:
        return Check(
            "torch gpu",
            "fail",
            f"torch {version} is a CPU-only build, but this host has {gpu}: every model would "
            "run on the CPU",
            torch_install_fix(version, cuda),
        )
    if not probe["available"]:
        return Check(
            "torch gpu",
            "fail",
            f"torch {version} (CUDA {probe['cuda']}) cannot use {gpu}; the driver "
            f"{found[0].driver} supports CUDA {cuda or 'unknown'}",
            torch_install_fix(version, cuda)
            if cuda and torch_cuda_build(cuda) != probe["cuda"]
            else "check that the NVIDIA driver is loaded (nvidia-smi) and that CUDA_VISIBLE_DEVICES "
            "does not hide the GPU",
        )
    return passed(
        "torch gpu",
        f"torch {version} (CUDA {probe['cuda']}) uses {probe['count']} GPU(s): {probe['device']}",
    )


def check_neuron() -> Check:
    """The AWS Neuron devices, from :func:`labkit.hardware.detect_neuron`."""
    found = hardware.detect_neuron()
    if not found.present:
        return skipped("neuron", "no AWS Neuron device here (neuron-ls not found, no /dev/neuron*)")
    return passed("neuron", f"AWS Neuron: {found}")


def check_docker() -> Check:
    if not shutil.which("docker"):
        return Check(
            "docker",
            "warn",
            "no docker client: the docker launch mode is unavailable (the local mode needs none)",
            "install Docker Engine, only to serve in the docker launch mode",
        )
    try:
        out = proc.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout_s=15)
    except LabkitError as exc:
        first = str(exc).strip().splitlines()[-1]
        return Check(
            "docker",
            "warn",
            f"docker engine not reachable ({first})",
            "start the engine (or use the local mode, which needs no Docker)",
        )
    return passed("docker", f"docker engine {out.stdout.strip()} reachable")


NVIDIA_TOOLKIT_FIX = (
    "install the NVIDIA Container Toolkit: sudo apt-get install -y nvidia-container-toolkit && "
    "sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker"
)


def _docker_engine() -> bool:
    """Whether a docker client is here and its engine answers."""
    if not shutil.which("docker"):
        return False
    try:
        proc.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout_s=15)
    except LabkitError:
        return False
    return True


def check_docker_gpu() -> Check:
    """``docker run --gpus all`` (the docker mode) needs the NVIDIA container runtime."""
    if not _docker_engine():
        return skipped("docker gpu", "no Docker engine here (see the docker check)")
    out = proc.run(["docker", "info", "--format", "{{json .Runtimes}}"], timeout_s=15).stdout
    try:
        runtimes = sorted(json.loads(out or "{}"))
    except json.JSONDecodeError:
        runtimes = []
    hook = shutil.which("nvidia-container-runtime-hook") or shutil.which("nvidia-ctk")
    if "nvidia" in runtimes or hook:
        where = "the nvidia runtime" if "nvidia" in runtimes else hook
        return passed("docker gpu", f"NVIDIA container support: {where}; --gpus all works")
    try:
        gpu_host = bool(hardware.gpus())
    except LabkitError:
        gpu_host = True  # the driver is there but fails: a GPU host with a driver problem
    if not gpu_host:
        return skipped("docker gpu", "no NVIDIA GPU here: the docker mode runs on the CPU")
    return Check(
        "docker gpu",
        "warn",
        f"this host has an NVIDIA GPU but Docker has no NVIDIA runtime (runtimes: "
        f"{', '.join(runtimes) or 'none'}): the docker mode's --gpus all fails",
        NVIDIA_TOOLKIT_FIX,
    )


def check_triton_image() -> Check:
    """The docker mode's image exists and imports transformers (``labkit image build``)."""
    image = triton_image()
    if not _docker_engine():
        return skipped("docker image", f"no Docker engine here to hold {image}")
    try:
        info = require_image(image)
    except LabkitError as exc:
        on_cpu = ON_STAND_IN
        if image != on_cpu and inspect_image(on_cpu) is not None:
            return Check(
                "docker image",
                "warn",
                f"{str(exc).split(';')[0]}; the lab's image on the CPU stand-in, {on_cpu}, is",
                f"export LABKIT_TRITON_IMAGE={on_cpu} for the docker mode here, or "
                "labkit image build on a GPU host",
            )
        fix = f"labkit image build; without NGC's registry: labkit image base, then labkit image build --base {BASE_IMAGE}"
        return Check("docker image", "warn", str(exc).split(";")[0], fix)
    cuda = f"CUDA {info.torch_cuda}" if info.torch_cuda else "a CPU-only build"
    return passed(
        "docker image",
        f"{image}: torch {info.torch} ({cuda}), transformers {info.transformers}, "
        f"numpy {info.numpy}",
    )


def check_token() -> Check:
    name = token_variable()
    if name:
        return passed("hf token", f"{name} is set (value hidden)")
    return Check(
        "hf token",
        "warn",
        "no HF_TOKEN: public and local models work, gated ones (meta-llama/Llama-2-7b-hf) do not",
        "export HF_TOKEN=<your token>",
    )


def check_hub(timeout_s: float = 3.0) -> Check:
    if hub_offline():
        return skipped("hub", "HF_HUB_OFFLINE is set: the lab uses local models only")
    endpoint = hub_endpoint()
    try:
        with urllib.request.urlopen(f"{endpoint}/api/models?limit=1", timeout=timeout_s) as r:
            status = r.status
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Check(
            "hub",
            "warn",
            f"{endpoint} not reachable ({reason}): offline",
            "the lab's defaults are local models; hub models need network access",
        )
    return passed("hub", f"{endpoint} reachable (HTTP {status})")


STATUSES = ("ok", "warn", "fail", "skipped")
PROBE_MODEL = "labkit_probe"
_PROBE_CODE = '''"""labkit doctor's probe: echoes its text input, to prove the Python backend runs."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            echoed = np.array([b"echo: " + t for t in text.reshape(-1)], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", echoed)]))
        return responses
'''


# -- Python and the server ----------------------------------------------------------------------
def check_python() -> Check:
    """This Python and its shared libpython (the Python-backend stub links it)."""
    version = ".".join(map(str, sys.version_info[:3]))
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return Check(
            "python",
            "fail",
            f"Python {version} at {sys.executable} has no shared libpython",
            "use a Python built with --enable-shared (conda, Debian's "
            "python3, or pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared)",
        )
    if not (Path(libdir) / soname).exists():
        return Check(
            "python",
            "fail",
            f"{soname} is missing from {libdir}",
            "reinstall this Python; its shared library is gone",
        )
    return passed("python", f"Python {version} at {sys.executable}; {soname} in {libdir}")


def check_tritonserver() -> Check:
    binary = locate_tritonserver()
    return passed("tritonserver", f"{binary.path} (from {binary.source})")


def check_python_backend(binary: ServerBinary | None = None) -> Check:
    """The Python-backend stub exists and links *this* Python's libpython (``ldd``)."""
    binary = binary or locate_tritonserver()
    backends = binary.backend_directory or binary.path.parent.parent / "backends"
    stub = backends / "python" / "triton_python_backend_stub"
    if not stub.is_file():
        return Check(
            "python backend",
            "fail",
            f"no Python-backend stub at {stub}",
            "install the Python backend (the NGC image and nvidia-pytriton ship it)",
        )
    if not shutil.which("ldd"):
        return Check(
            "python backend",
            "warn",
            f"stub at {stub}; ldd is missing, so which libpython it loads is unknown",
            "install libc-bin to inspect it",
        )
    env = {**os.environ, **binary.env}
    out = proc.run(["ldd", stub], timeout_s=20, env=env, check=False).stdout
    line = next((ln.strip() for ln in out.splitlines() if "libpython" in ln), "")
    wanted = f"libpython{sys.version_info[0]}.{sys.version_info[1]}"
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent").resolve()
    target = line.split("=>", 1)[-1].split("(")[0].strip()
    if wanted not in line:
        return Check(
            "python backend",
            "fail",
            f"stub {stub} is built for another Python ({line or 'no libpython'}), not {wanted}",
            "use the stub for this Python (nvidia-pytriton ships 3.8 to 3.13)",
        )
    if "not found" in target or Path(target).resolve().parent != libdir:
        return Check(
            "python backend",
            "fail",
            f"stub loads {target or line}, not this "
            f"Python's library in {libdir}; it would die with `undefined symbol: "
            "_PyModule_Add`",
            f"put {libdir} first on LD_LIBRARY_PATH (labkit's "
            "TritonServer does this for the bundled server)",
        )
    return passed("python backend", f"stub {stub} loads {target}")


def _write_probe(repository: Path) -> None:

    config = mc.ModelConfig(name=PROBE_MODEL, backend="python", max_batch_size=0)
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    (repository / PROBE_MODEL / "1").mkdir(parents=True)
    (repository / PROBE_MODEL / "config.pbtxt").write_text(text_format.MessageToString(config))
    (repository / PROBE_MODEL / "1" / "model.py").write_text(_PROBE_CODE)


def check_server(startup_timeout_s: float = 120.0) -> Check:
    """Start Triton on free loopback ports with a Python-backend probe model and call it."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="labkit-doctor-") as tmp:
        repository = Path(tmp) / "repository"
        _write_probe(repository)
        server = TritonServer(
            repository,
            http_port=0,
            grpc_port=0,
            metrics_port=0,
            startup_timeout_s=startup_timeout_s,
            log_path=Path(tmp) / "log",
        )
        try:
            server.start()
            base = f"http://{server.http_url}"
            with urllib.request.urlopen(f"{base}/v2", timeout=10) as r:
                version = json.load(r)["version"]
            request = urllib.request.Request(
                f"{base}/v2/models/{PROBE_MODEL}/generate",
                data=json.dumps({"text_input": "hi"}).encode(),
            )
            with urllib.request.urlopen(request, timeout=30) as r:
                answer = json.load(r)["text_output"]
        except (LabkitError, OSError) as exc:
            return Check(
                "server",
                "fail",
                f"Triton could not serve a Python-backend model: {exc}",
                "read the log above; `labkit doctor` checks above name the "
                "usual causes (libpython, stub, numpy, /dev/shm)",
            )
        finally:
            server.stop()
    if answer != "echo: hi":
        return Check(
            "server",
            "fail",
            f"the probe model answered {answer!r}, not 'echo: hi'",
            "check numpy<2 in the server's Python environment",
        )
    took = time.monotonic() - start
    return passed("server", f"Triton {version} served a Python-backend model ({took:.1f} s)")


def check_numpy(version: str | None = None) -> Check:
    version = version or importlib.metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        return Check(
            "numpy",
            "fail",
            f"numpy {version}: Triton 2.51's Python backend breaks every "
            "string (BYTES) tensor with numpy 2",
            'pip install "numpy<2" (pandas<3 too)',
        )
    return passed("numpy", f"numpy {version} (below 2, as the Python backend needs)")


# The facts about .venv-vllm that smollm2_vllm needs, read in that environment's own Python.
_VLLM_PROBE = """
import importlib.util, json, sys
found = {"python": "%d.%d" % sys.version_info[:2], "torchvision": bool(importlib.util.find_spec("torchvision"))}
try:
    import numpy
    found["numpy"] = numpy.__version__
    import vllm
    found["vllm"] = getattr(vllm, "__version__", "unknown")
except Exception as exc:
    found["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


def check_vllm_env() -> Check:
    """``.venv-vllm``, the environment of the ``smollm2_vllm`` model (see :func:`vllm_env_verdict`)."""
    folder = environment_folder("vllm")
    python = folder / "bin" / "python"
    if not python.is_file():
        return Check(
            "vLLM environment",
            "warn",
            f"{folder} does not exist: the smollm2_vllm model cannot load (the others can)",
            "run make install",
        )
    ran = proc.run([str(python), "-c", _VLLM_PROBE], timeout_s=300, check=False)
    lines = ran.stdout.strip().splitlines()
    probe = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if not probe:
        probe = {"error": proc.tail(ran.stderr or "no output", 3)}
    return vllm_env_verdict(probe, folder, f"{sys.version_info[0]}.{sys.version_info[1]}")


def vllm_env_verdict(probe: dict, folder: Path, server_python: str) -> Check:
    """What :data:`_VLLM_PROBE` found in ``folder``, judged against the server's Python version:
    the Triton stub runs the model in that environment with the server's Python, and its pybind11
    breaks BYTES tensors with numpy 2; torchvision against the CPU torch breaks transformers."""
    fix = f"rm -rf {folder} && make install"
    problems = []
    if probe.get("python") and probe["python"] != server_python:
        problems.append(f"its Python is {probe['python']}, the server's stub runs {server_python}")
    if "error" in probe:
        problems.append(f"vllm does not import there: {probe['error']}")
    numpy = probe.get("numpy")
    if numpy and int(numpy.split(".")[0]) >= 2:
        problems.append(f"numpy {numpy} (the Python backend needs numpy < 2)")
    if probe.get("torchvision"):
        problems.append("torchvision is installed (it breaks `import transformers` there)")
    if problems:
        return Check("vLLM environment", "fail", f"{folder}: " + "; ".join(problems), fix)
    return passed(
        "vLLM environment",
        f"{folder}: vLLM {probe.get('vllm')}, Python {probe.get('python')}, numpy {numpy}",
    )


# -- tools --------------------------------------------------------------------------------------
def check_perf_analyzer() -> Check:
    locate_perf_analyzer.cache_clear()  # report the machine as it is now
    try:
        tool = locate_perf_analyzer()
    except LabkitError as exc:
        return Check(
            "perf_analyzer",
            "fail",
            str(exc).splitlines()[0],
            "apt-get install libb64-0d; pip install 'tritonclient[all]==2.51.0' "
            "nvidia-cuda-runtime-cu12",
        )
    result = proc.run([tool.path, "--version"], timeout_s=30, env=tool.environ(), check=False)
    version = (result.stdout or result.stderr).strip().splitlines()[:1]
    return passed("perf_analyzer", f"{tool.path} ({version[0] if version else 'version unknown'})")


def check_model_analyzer() -> Check:
    try:
        version = importlib.metadata.version("triton-model-analyzer")
    except importlib.metadata.PackageNotFoundError:
        return Check(
            "model analyzer",
            "warn",
            "triton-model-analyzer is not installed (only the Model Analyzer notebook needs it)",
            "pip install 'triton-model-analyzer==1.58.0' (or make install-analyzer)",
        )
    program = Path(sys.executable).parent / "model-analyzer"
    where = program if program.is_file() else shutil.which("model-analyzer")
    if not where:
        return Check(
            "model analyzer",
            "warn",
            f"triton-model-analyzer {version} is installed "
            "but its model-analyzer command is not found",
            "reinstall it in this env",
        )
    return passed("model analyzer", f"triton-model-analyzer {version} at {where}")


def check_kernel() -> Check:
    try:
        python = kernel_python("python3")
    except LabkitError as exc:
        return Check("jupyter kernel", "fail", str(exc), "see the command in the detail")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = proc.run([python, "-c", "import labkit"], timeout_s=60, env=env, cwd="/", check=False)
    if found.returncode != 0:
        return Check(
            "jupyter kernel",
            "warn",
            f"kernel python3 runs {python}, which cannot import labkit outside the checkout",
            "run `pip install -e .` in the checkout so notebooks opened in Jupyter find labkit",
        )
    return passed("jupyter kernel", f"kernel python3 runs {python}, which imports labkit")


# -- system tools: what the lab runs that the OS provides, not pip ------------------------------
@dataclass(frozen=True)
class SystemTool:
    """A program the lab runs, where to find it, and what needs it."""

    name: str
    version_args: tuple[str, ...]  # what prints its version on the first line
    needed_by: str
    fix: str
    also: tuple[str, ...] = ()  # where else to look: /usr/sbin is not on a user's PATH


#: Every system tool labkit runs (scripts/install.sh installs their packages as root). docker,
#: ldd and nvidia-smi have their own checks (docker, python backend, gpu).
SYSTEM_TOOLS = {
    "haproxy": SystemTool(
        "haproxy",
        ("-v",),
        "the balancer in front of notebook 07's replicas",
        "sudo apt-get install -y haproxy (make install does it as root)",
        ("/usr/sbin/haproxy",),
    ),
    "setpriv": SystemTool(
        "setpriv",
        ("--version",),
        "stopping what notebook 04's Model Analyzer search started, should the search die",
        "sudo apt-get install -y util-linux",
    ),
    "debootstrap": SystemTool(
        "debootstrap",
        ("--version",),
        "building the CPU stand-in for NGC's image (labkit image base), which the docker mode "
        "and the pod rehearsal run here",
        "sudo apt-get install -y debootstrap (make install does it as root)",
        ("/usr/sbin/debootstrap",),
    ),
}


def check_tool(tool: SystemTool) -> Check:
    """``ok`` with the tool's version and path; ``warn`` naming what needs it when it is missing
    or does not run (each needs it for one part of the lab, not the rest)."""
    found = shutil.which(tool.name) or next(
        (c for c in tool.also if os.path.isfile(c) and os.access(c, os.X_OK)), None
    )
    if found is None:
        detail = f"{tool.name} is not installed; the lab runs it for {tool.needed_by}"
        return Check(tool.name, "warn", detail, tool.fix)
    try:
        ran = proc.run([found, *tool.version_args], timeout_s=15, check=False)
    except LabkitError as exc:
        return Check(tool.name, "warn", f"{found} does not run: {exc}", tool.fix)
    lines = (ran.stdout or ran.stderr).strip().splitlines()
    version = lines[0].strip() if lines else "version unknown"
    if ran.returncode != 0:
        return Check(
            tool.name, "warn", f"{found} exited with {ran.returncode}: {version}", tool.fix
        )
    return passed(tool.name, f"{found} ({version}), for {tool.needed_by}")


def check_haproxy() -> Check:
    return check_tool(SYSTEM_TOOLS["haproxy"])


def check_setpriv() -> Check:
    return check_tool(SYSTEM_TOOLS["setpriv"])


def check_debootstrap() -> Check:
    return check_tool(SYSTEM_TOOLS["debootstrap"])


# -- all together -------------------------------------------------------------------------------
CHECKS: list[Callable[[], Check]] = [
    check_python,
    check_tritonserver,
    check_python_backend,
    check_numpy,
    check_vllm_env,
    check_server,
    check_perf_analyzer,
    check_model_analyzer,
    check_haproxy,
    check_setpriv,
    check_debootstrap,
    check_kernel,
    check_ports,
    check_public_servers,
    check_shm,
    check_gpu,
    check_torch_gpu,
    check_neuron,
    check_docker,
    check_docker_gpu,
    check_triton_image,
    check_token,
    check_hub,
]


def run_checks(server: bool = True) -> list[Check]:
    """Run every check; a crash becomes a fail. ``server=False`` does not start Triton: the
    server check is then ``skipped``, saying so."""
    results = []
    for check in CHECKS:
        if check is check_server and not server:
            results.append(skipped("server", "not started on request (--no-server)"))
            continue
        name = check.__name__.removeprefix("check_").replace("_", " ")
        try:
            results.append(check())
        except Exception as exc:
            log.debug("check %s crashed", name, exc_info=True)
            results.append(
                Check(
                    name,
                    "fail",
                    f"{type(exc).__name__}: {exc}",
                    "see the detail; run `labkit -v doctor` for the traceback",
                )
            )
    return results


def to_frame(checks: Sequence[Check]):
    """A pandas DataFrame (check, status, detail, fix) for the notebook."""

    return pd.DataFrame([asdict(c) for c in checks]).rename(columns={"name": "check"})


def format_table(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    status = max(len(c.status) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<{status}}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<{status}}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def summary(checks: Sequence[Check]) -> str:
    """The checks' verdict in one sentence: how many passed, warned, failed and were skipped."""
    count = {s: sum(c.status == s for c in checks) for s in STATUSES}
    said = (
        f"{count['ok']} of {len(checks)} checks passed, {count['warn']} warned, "
        f"{count['fail']} failed, {count['skipped']} skipped"
    )
    if count["fail"]:
        return f"{said}: fix the failed ones first, as their rows say."
    return f"{said}: this machine can run the lab."


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


def require_no_failures(checks: Sequence[Check]) -> None:
    """Raise :class:`MissingDependencyError` naming each failed check and its fix."""
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise MissingDependencyError(
            "this machine cannot run the lab yet: "
            + "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
        )
