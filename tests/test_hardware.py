"""GPU facts through NVML (nvidia-ml-py). No GPU here: a fake NVML stands in at pynvml's API,
and a fake nvidia-smi for the fallback where NVML cannot be loaded."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from labkit import hardware
from labkit.errors import ToolError

MIB = 2**20


def fake_nvml(monkeypatch, gpus, driver="550.54.15", cuda=12040, processes=None, init_error=None):
    """Put a fake NVML in pynvml's place (no GPU here): ``gpus`` is a list of ``(name, total MiB,
    free MiB)``, ``processes`` maps a GPU's index to ``(pid, bytes or None)`` pairs, and
    ``init_error`` an NVMLError class that ``nvmlInit`` raises. Returns the calls made."""
    calls = []

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error()

    def memory(handle):
        _, total, free = gpus[handle]
        return SimpleNamespace(total=total * MIB, free=free * MIB, used=(total - free) * MIB)

    def running(handle):
        return [
            SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in (processes or {}).get(handle, [])
        ]

    fakes = {
        "nvmlInit": init,
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda handle: gpus[handle][0],
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlSystemGetDriverVersion": lambda: driver,
        "nvmlSystemGetCudaDriverVersion": lambda: cuda,
        "nvmlDeviceGetComputeRunningProcesses": running,
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(pynvml, name, fake)
    return calls


TWO_H200 = [("NVIDIA H200", 143771, 143000), ("NVIDIA H200", 143771, 100000)]


def test_two_gpus_are_read_from_a_fake_nvml_with_driver_and_cuda(monkeypatch):
    calls = fake_nvml(monkeypatch, TWO_H200, driver="580.65", cuda=13000)
    assert hardware.gpus() == [
        hardware.GPU(0, "NVIDIA H200", 143771, "580.65", "13.0"),
        hardware.GPU(1, "NVIDIA H200", 143771, "580.65", "13.0"),
    ]
    memory = hardware.gpu_memory()
    assert [m.description for m in memory] == ["GPU 0: NVIDIA H200", "GPU 1: NVIDIA H200"]
    assert memory[1].available_bytes == 100000 * MIB and memory[0].total_bytes == 143771 * MIB
    assert calls == ["init", "shutdown"] * 2  # NVML is shut down after each reading


def test_auto_means_the_gpu_with_the_least_free_memory_with_a_fake_nvml(monkeypatch):
    fake_nvml(monkeypatch, TWO_H200)
    assert hardware.resolve_device("auto") == "gpu" and hardware.has_gpu()
    chosen = hardware.device_memory("auto")
    assert (chosen.description, chosen.available_bytes) == ("GPU 1: NVIDIA H200", 100000 * MIB)


def test_gpu_memory_by_process_adds_up_every_gpu_with_a_fake_nvml(monkeypatch):
    processes = {0: [(41, 3 * MIB), (42, None)], 1: [(41, 5 * MIB)]}
    fake_nvml(monkeypatch, TWO_H200, processes=processes)
    assert hardware.gpu_memory_by_pid() == {41: 8 * MIB, 42: 0}  # None: the driver cannot tell


def test_a_driver_that_does_not_answer_raises_or_counts_no_gpu_with_a_fake_nvml(
    monkeypatch, caplog
):
    fake_nvml(monkeypatch, TWO_H200, init_error=pynvml.NVMLError_DriverNotLoaded)
    with pytest.raises(ToolError, match="NVML .* failed to start: Driver Not Loaded"):
        hardware.gpus()
    with caplog.at_level(logging.WARNING, logger="labkit.hardware"):
        assert hardware.gpu_memory() == [] and hardware.gpu_memory_by_pid() == {}
    assert "Driver Not Loaded" in caplog.text


def test_without_nvml_gpu_facts_come_from_a_fake_nvidia_smi(tmp_path: Path, monkeypatch):
    # The fallback: NVML's library cannot be loaded (faked: NVML does not load here either), and
    # a fake nvidia-smi first on PATH stands in for a one-GPU host.
    calls = fake_nvml(monkeypatch, TWO_H200, init_error=pynvml.NVMLError_LibraryNotFound)
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=index,name,memory.total,driver_version) echo "0, NVIDIA H100, 81559, 550.54.15";;\n'
        '  --query-gpu=*) echo "0, NVIDIA H100, 81559, 81000";;\n'
        '  --query-compute-apps=*) echo "77, 1024";;\n'
        '  *) echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |";;\n'
        "esac\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert hardware.gpus() == [hardware.GPU(0, "NVIDIA H100", 81559, "550.54.15", "12.4")]
    [memory] = hardware.gpu_memory()
    assert (memory.total_bytes, memory.available_bytes) == (81559 * MIB, 81000 * MIB)
    assert hardware.gpu_memory_by_pid() == {77: 1024 * MIB}
    assert calls == ["init"] * 3  # NVML was tried first each time, and never shut down


def test_without_nvml_or_nvidia_smi_there_is_no_gpu(tmp_path, monkeypatch):
    fake_nvml(monkeypatch, TWO_H200, init_error=pynvml.NVMLError_LibraryNotFound)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hardware.gpus() == [] and hardware.gpu_memory() == []
    assert hardware.resolve_device("auto") == "cpu"
