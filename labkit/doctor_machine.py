"""The doctor's machine checks: ports, exposed servers, /dev/shm, devices, Docker, token, hub.

Also :class:`Check`, the result every doctor check returns.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import proc
from .errors import LabkitError
from .settings import token_variable

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


# -- checks -------------------------------------------------------------------------------------
def _listeners(port: int) -> str:
    try:
        import psutil  # noqa: PLC0415

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
    import psutil  # noqa: PLC0415

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
            "exposed servers",
            "warn",
            f"tritonserver listens on all interfaces: {'; '.join(public)}",
            "anyone on the network can call it; restart it "
            "bound to loopback (labkit's default host 127.0.0.1)",
        )
    return passed("exposed servers", f"{count} tritonserver running, none on all interfaces")


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


def _probe(name: str, program: str, args: list[str], absent: str, parse: Callable[[str], str]):
    if not shutil.which(program):
        return passed(name, absent)
    try:
        result = proc.run([program, *args], timeout_s=20)
    except LabkitError as exc:
        return Check(
            name,
            "fail",
            f"{program} is installed but failed: {exc}",
            f"check the driver: {program} must run before the lab can use the device",
        )
    return passed(name, parse(result.stdout))


def check_gpu() -> Check:
    return _probe(
        "gpu",
        "nvidia-smi",
        ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        "no NVIDIA GPU (nvidia-smi not found): the lab runs on CPU",
        lambda out: "; ".join(ln.strip() for ln in out.splitlines() if ln.strip()),
    )


def check_neuron() -> Check:
    def parse(out: str) -> str:
        devices = len(re.findall(r"^\|\s*\d+\s*\|", out, flags=re.M))
        return f"AWS Neuron: {devices or 'some'} device(s) listed by neuron-ls"

    return _probe("neuron", "neuron-ls", [], "no AWS Neuron device (neuron-ls not found)", parse)


def check_docker() -> Check:
    if not shutil.which("docker"):
        return passed(
            "docker",
            "no docker client: the docker launch mode is unavailable, the local mode needs none",
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
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return passed("hub", "HF_HUB_OFFLINE is set: not checked, local models only")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
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
