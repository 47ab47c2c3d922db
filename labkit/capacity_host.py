"""What the machine has (host RAM, NVIDIA GPUs) and what the served models really hold.

Used by :mod:`labkit.capacity` (re-exported there): :func:`host_memory` (psutil),
:func:`gpu_memory` (``nvidia-smi``), :func:`device_memory`, and :func:`served_memory`, the
resident memory of each model's Python-backend stub processes on a running local server, so an
estimate can be checked against what the model really takes once loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import proc
from .errors import ConfigError, LabkitError, ServerError

if TYPE_CHECKING:
    import pandas as pd

    from .server import TritonServer

log = logging.getLogger(__name__)

GIB = 1024**3
DEVICES = ("auto", "cpu", "gpu")
STUB = "triton_python_backend_stub"


# -- what the host has --------------------------------------------------------------------------
@dataclass(frozen=True)
class Memory:
    """Memory of one device: ``cpu`` (host RAM) or ``gpu`` (the GPU with the least free)."""

    device: str
    total_bytes: int
    available_bytes: int
    description: str

    def __str__(self) -> str:
        return (
            f"{self.available_bytes / GIB:.1f} GiB free of {self.total_bytes / GIB:.1f} GiB "
            f"({self.description})"
        )


def host_memory() -> Memory:
    """The host's RAM as psutil sees it (``available``: what can be used without swapping)."""
    import psutil  # noqa: PLC0415

    vm = psutil.virtual_memory()
    return Memory("cpu", int(vm.total), int(vm.available), f"host RAM, {os.cpu_count()} CPUs")


def parse_nvidia_smi(text: str) -> list[Memory]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,
    nounits`` (MiB) into one :class:`Memory` per GPU."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise ConfigError(
                f"unexpected nvidia-smi line {line!r}; expected index, name, MiB, MiB"
            )
        index, name, total, free = fields
        try:
            total_b, free_b = int(float(total) * 2**20), int(float(free) * 2**20)
        except ValueError:
            raise ConfigError(f"nvidia-smi reported no memory figures in {line!r}") from None
        gpus.append(Memory("gpu", total_b, free_b, f"GPU {index}: {name}"))
    return gpus


def gpu_memory() -> list[Memory]:
    """Every NVIDIA GPU's memory from ``nvidia-smi``; an empty list when there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    query = "--query-gpu=index,name,memory.total,memory.free"
    try:
        result = proc.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], timeout_s=30)
    except LabkitError as exc:
        log.warning("nvidia-smi is installed but failed, so no GPU is counted: %s", exc)
        return []
    return parse_nvidia_smi(result.stdout)


def resolve_device(device: str = "auto") -> str:
    """``cpu`` or ``gpu``: ``auto`` is ``gpu`` when nvidia-smi sees one."""
    if device not in DEVICES:
        raise ConfigError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        return "gpu" if gpu_memory() else "cpu"
    return device


def device_memory(device: str = "auto") -> Memory:
    """What ``device`` has. For ``gpu``, the GPU with the least free memory: Triton puts one
    instance of a GPU model on every GPU, so every GPU must hold it."""
    device = resolve_device(device)
    if device == "cpu":
        return host_memory()
    gpus = gpu_memory()
    if not gpus:
        raise ConfigError(
            "device='gpu' but nvidia-smi reports no NVIDIA GPU here; use device='cpu' or 'auto'"
        )
    return min(gpus, key=lambda g: g.available_bytes)


# -- what the served models hold ----------------------------------------------------------------
def gpu_memory_by_pid() -> dict[int, int]:
    """GPU memory (bytes) each process uses, from ``nvidia-smi --query-compute-apps``."""
    if not shutil.which("nvidia-smi"):
        return {}
    query = "--query-compute-apps=pid,used_memory"
    try:
        out = proc.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], timeout_s=30).stdout
    except LabkitError as exc:
        log.warning("nvidia-smi could not list GPU processes: %s", exc)
        return {}
    used: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(float(mib) * 2**20)
    return used


def served_memory(server: TritonServer) -> pd.DataFrame:
    """Memory of each served model's stub processes on a local server: resident host memory
    (RSS) and GPU memory (``nvidia-smi``; 0 without a GPU).

    A stub's command line names the ``model.py`` it runs (``<repo>/<model>/<version>/model.py``).
    The resident set includes weights memory-mapped from the checkpoint once they have been read,
    so measure after the model has answered a request.
    """
    import pandas as pd  # noqa: PLC0415
    import psutil  # noqa: PLC0415

    if server.pid is None:
        raise ServerError(
            f"{server!r} runs no local process (remote or stopped); served_memory() measures "
            "the stub processes of a server started here"
        )
    on_gpu = gpu_memory_by_pid()
    totals: dict[str, list[tuple[int, int]]] = {}
    for child in psutil.Process(server.pid).children(recursive=True):
        try:
            argv = child.cmdline()
            if len(argv) < 2 or not argv[0].endswith(STUB):
                continue
            rss = child.memory_info().rss
        except psutil.Error:  # a stub that ended meanwhile
            continue
        name = Path(argv[1]).parent.parent.name
        totals.setdefault(name, []).append((rss, on_gpu.get(child.pid, 0)))
    columns = ["model", "processes", "resident (GiB)", "gpu (GiB)"]
    rows = [
        (m, len(r), round(sum(x for x, _ in r) / GIB, 3), round(sum(g for _, g in r) / GIB, 3))
        for m, r in sorted(totals.items())
    ]
    return pd.DataFrame(rows, columns=columns).set_index("model")
