"""What the machine has: host RAM, NVIDIA GPUs and AWS Neuron devices. The one module that probes them.

- :func:`host_memory` (psutil), :func:`gpu_memory` and :func:`gpus` (NVML, through
  ``nvidia-ml-py``), :func:`gpu_memory_by_pid`, :func:`device_memory`;
- :func:`usable_cores`, :func:`split_cores` (a benchmark's server and client apart),
  :func:`pinned` (this process on some cores for a block);
- :func:`detect_neuron` (``neuron-ls --json-output``, else the ``/dev/neuron*`` devices).

GPU facts come from NVML, NVIDIA's own library, as typed values (:func:`nvml`). Only where NVML
cannot be loaded (its ``libnvidia-ml.so`` is not on the loader's path) are they read from
``nvidia-smi``'s text, and every such call goes through :func:`nvidia_smi`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import psutil
import pynvml

from labkit import proc
from labkit.errors import ConfigError, LabkitError, ToolError

log = logging.getLogger(__name__)

GIB = 1024**3
DEVICES = ("auto", "cpu", "gpu")


# -- what the host has --------------------------------------------------------------------------
def host_facts() -> dict:
    """Cores, CPU model, bfloat16 support, memory and load average: the context a benchmark's
    figures are read in (every benchmark's JSON carries it as ``host``)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), "x86_64"):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "avx512_bf16": "avx512_bf16" in flags.split(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "machine": platform.machine(),
    }


def usable_cores() -> tuple[int, ...]:
    """The CPU cores this process may run on, in order."""
    return tuple(sorted(os.sched_getaffinity(0)))


def split_cores(cores: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(server, client)``: a benchmark's server on every usable core but the last, its load
    generator on the last, so that the two do not take turns on one core (on 2 cores AIPerf took
    30-42% of the machine). Raises :class:`ConfigError` with fewer than two cores."""
    cores = usable_cores() if cores is None else tuple(cores)
    if len(cores) < 2:
        raise ConfigError(
            f"pinning a server and its client apart needs two cores; this process has {len(cores)}"
            " (measure unpinned instead)"
        )
    return cores[:-1], cores[-1:]


def format_cores(cores: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``, as ``taskset -c`` writes them."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


@contextlib.contextmanager
def pinned(cores: tuple[int, ...] | None) -> Iterator[None]:
    """Run every thread of this process on ``cores`` for the block (threads started inside it
    inherit that), then give each thread back the cores it had. ``None``: no change."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _set_thread_affinity(set(cores))
    try:
        yield
    finally:
        _set_thread_affinity(before)


def _set_thread_affinity(cores: set[int]) -> None:
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


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

    vm = psutil.virtual_memory()
    return Memory("cpu", int(vm.total), int(vm.available), f"host RAM, {os.cpu_count()} CPUs")


@dataclass(frozen=True)
class GPU:
    """One NVIDIA GPU as the driver names it."""

    index: int
    name: str
    memory_total_mib: int
    driver: str
    cuda: str | None  # the highest CUDA version the driver supports


@contextlib.contextmanager
def nvml() -> Iterator[ModuleType | None]:
    """NVML (``pynvml``, from ``nvidia-ml-py``) initialised for the block, then shut down; None
    where NVML cannot be loaded (no ``libnvidia-ml.so``: no NVIDIA driver here, or one this
    process cannot see), and the callers fall back to ``nvidia-smi``.

    Raises :class:`ToolError` with NVML's own message when it loads but fails (a driver that is
    not loaded or does not answer): a GPU host whose driver does not answer is not a CPU host.
    """
    try:
        pynvml.nvmlInit()
        loaded = True
    except pynvml.NVMLError_LibraryNotFound:
        loaded = False
    except pynvml.NVMLError as exc:
        raise ToolError(f"NVML (the NVIDIA driver's library) failed to start: {exc}") from exc
    if not loaded:
        yield None
        return
    try:
        yield pynvml
    except pynvml.NVMLError as exc:
        raise ToolError(f"NVML (the NVIDIA driver's library) failed: {exc}") from exc
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _cuda_version(code: int) -> str:
    """NVML's CUDA driver version, ``12040`` -> ``"12.4"``."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _devices(lib: ModuleType) -> list:
    return [lib.nvmlDeviceGetHandleByIndex(i) for i in range(lib.nvmlDeviceGetCount())]


def gpu_memory() -> list[Memory]:
    """Every NVIDIA GPU's memory (NVML; ``nvidia-smi`` without it); an empty list when there is
    none, or when the driver fails (logged)."""
    try:
        with nvml() as lib:
            if lib is None:
                return _smi_gpu_memory()
            found = []
            for index, handle in enumerate(_devices(lib)):
                memory = lib.nvmlDeviceGetMemoryInfo(handle)
                name = lib.nvmlDeviceGetName(handle)
                found.append(Memory("gpu", memory.total, memory.free, f"GPU {index}: {name}"))
            return found
    except LabkitError as exc:
        log.warning("the NVIDIA driver is installed but failed, so no GPU is counted: %s", exc)
        return []


def gpus() -> list[GPU]:
    """Every NVIDIA GPU with its driver (NVML; ``nvidia-smi`` without it); empty without an
    NVIDIA driver; raises :class:`ToolError` if the driver fails."""
    with nvml() as lib:
        if lib is None:
            return _smi_gpus()
        driver = lib.nvmlSystemGetDriverVersion()
        cuda = _cuda_version(lib.nvmlSystemGetCudaDriverVersion())
        return [
            GPU(
                index,
                lib.nvmlDeviceGetName(handle),
                lib.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
                driver,
                cuda,
            )
            for index, handle in enumerate(_devices(lib))
        ]


def has_gpu() -> bool:
    """True when the NVIDIA driver lists at least one GPU."""
    return bool(gpu_memory())


def resolve_device(device: str = "auto") -> str:
    """``cpu`` or ``gpu``: ``auto`` is ``gpu`` when the NVIDIA driver lists one."""
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
            "device='gpu' but the NVIDIA driver reports no GPU here (NVML, nvidia-smi); "
            "use device='cpu' or 'auto'"
        )
    return min(gpus, key=lambda g: g.available_bytes)


def gpu_memory_by_pid() -> dict[int, int]:
    """GPU memory (bytes) each process uses, on every GPU together (NVML's running compute
    processes; ``nvidia-smi --query-compute-apps`` without it)."""
    used: dict[int, int] = {}
    try:
        with nvml() as lib:
            if lib is None:
                return _smi_memory_by_pid()
            for handle in _devices(lib):
                for process in lib.nvmlDeviceGetComputeRunningProcesses(handle):
                    # usedGpuMemory is None where the driver cannot tell (some containers)
                    used[process.pid] = used.get(process.pid, 0) + (process.usedGpuMemory or 0)
    except LabkitError as exc:
        log.warning("the NVIDIA driver could not list GPU processes: %s", exc)
        return {}
    return used


# -- the fallback where NVML cannot be loaded: nvidia-smi's text --------------------------------
def nvidia_smi(*args: str) -> str | None:
    """``nvidia-smi ARGS`` output, or None when there is no nvidia-smi (so no NVIDIA GPU).

    Raises :class:`ToolError` with its own message when it is installed but fails (a driver
    problem): a GPU host whose driver does not answer is not a CPU host.
    """
    if not shutil.which("nvidia-smi"):
        return None
    return proc.run(["nvidia-smi", *args], timeout_s=30).stdout


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


def _smi_gpu_memory() -> list[Memory]:
    out = nvidia_smi(
        "--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"
    )
    return parse_nvidia_smi(out or "")


def _smi_gpus() -> list[GPU]:
    out = nvidia_smi(
        "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"
    )
    if out is None:
        return []
    header = nvidia_smi() or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    found = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and fields[0].isdigit():
            memory = int(float(fields[2])) if fields[2].replace(".", "", 1).isdigit() else 0
            found.append(GPU(int(fields[0]), fields[1], memory, fields[3], cuda and cuda[1]))
    return found


def _smi_memory_by_pid() -> dict[int, int]:
    out = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    used: dict[int, int] = {}
    for line in (out or "").splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(float(mib) * 2**20)
    return used


#: NeuronCores per device by instance family (trn2 shown with its default logical-core setting).
CORES_PER_DEVICE = {"inf1": 4, "inf2": 2, "trn1": 2, "trn2": 4}


# -- AWS Neuron devices ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NeuronHardware:
    kind: str  # inf1, inf2, trn1, trn2 or none
    devices: int
    cores: int
    source: str  # neuron-ls, /dev, or none
    instance_type: str | None = None

    @property
    def present(self) -> bool:
        return self.kind != "none"

    @property
    def target(self) -> str:
        """The compile target for this host: ``cpu`` when there is no Neuron device."""
        return {"none": "cpu", "trn2": "trn1"}.get(self.kind, self.kind)

    def __str__(self) -> str:
        if not self.present:
            return "no Neuron device (compile and serve on the cpu target)"
        where = f" ({self.instance_type})" if self.instance_type else ""
        return (
            f"{self.kind}{where}: {self.devices} devices, {self.cores} NeuronCores [{self.source}]"
        )


def kind_from_instance_type(instance_type: str | None) -> str | None:
    """``inf2.xlarge`` -> ``inf2``; None for anything that is not a Neuron instance family."""
    match = re.match(r"^(inf1|inf2|trn1n?|trn2u?)\.", (instance_type or "").strip())
    return match and re.sub(r"[nu]$", "", match[1])


def parse_neuron_ls(json_text: str, instance_type: str | None = None) -> NeuronHardware:
    """Read ``neuron-ls --json-output`` (a list with one entry per device, each with ``nc_count``)."""
    try:
        entries = json.loads(json_text)
    except json.JSONDecodeError as exc:
        raise ToolError(
            f"neuron-ls --json-output printed something that is not JSON: {exc}"
        ) from exc
    if isinstance(entries, dict):
        entries = entries.get("neuron_devices", [entries])
    if not isinstance(entries, list):
        raise ToolError(f"neuron-ls --json-output gave {type(entries).__name__}, expected a list")
    cores = sum(int(e.get("nc_count", 0)) for e in entries)
    kind = kind_from_instance_type(instance_type)
    if kind is None and entries:
        per_device = int(entries[0].get("nc_count", 0))
        kind = {4: "inf1", 8: "trn2"}.get(per_device, "inf2")  # 2 per device: inf2 or trn1
    return NeuronHardware(kind or "none", len(entries), cores, "neuron-ls", instance_type)


def detect_neuron(
    neuron_ls: str | None = None,
    dev_dir: str | os.PathLike = "/dev",
    sys_dir: str | os.PathLike = "/sys",
) -> NeuronHardware:
    """What Neuron hardware this host has. Never raises for a host without any."""
    instance_type = _instance_type(Path(sys_dir))
    tool = neuron_ls or shutil.which("neuron-ls") or "/opt/aws/neuron/bin/neuron-ls"
    if os.access(tool, os.X_OK):
        try:
            result = proc.run([tool, "--json-output"], timeout_s=30)
            return parse_neuron_ls(result.stdout, instance_type)
        except ToolError as exc:
            log.warning("neuron-ls failed, falling back to %s/neuron*: %s", dev_dir, exc)
    devices = sorted(p for p in Path(dev_dir).glob("neuron*") if re.fullmatch(r"neuron\d+", p.name))
    kind = kind_from_instance_type(instance_type)
    if not devices:
        return NeuronHardware("none", 0, 0, "none", instance_type)
    kind = kind or "inf2"
    return NeuronHardware(
        kind, len(devices), len(devices) * CORES_PER_DEVICE[kind], "/dev", instance_type
    )


def _instance_type(sys_dir: Path) -> str | None:
    """EC2 Nitro hosts name the instance type in DMI; the Neuron driver repeats it in sysfs."""
    for rel in (
        "devices/virtual/neuron_device/neuron0/info/architecture/instance_type",
        "devices/virtual/dmi/id/product_name",
    ):
        try:
            text = (sys_dir / rel).read_text().strip()
        except OSError:
            continue
        if kind_from_instance_type(text):
            return text
    return None
