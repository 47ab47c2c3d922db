"""Will these models fit? Memory estimates for a repository's models against what the host has.

The tutorial serves falcon7b and persimmon8b together and advises falling back to opt-125m when
a machine is too small. This module automates that advice before anything is loaded:

- :func:`estimate` says how much memory one model needs: its parameter count x the bytes of each
  parameter in the dtype the model code will load (float32 on a CPU, float16 on a GPU for the
  text-generation template unless its ``dtype`` parameter says otherwise), plus a headroom for
  activations and the KV cache, plus the fixed cost of the Python-backend stub process that holds
  it (torch and transformers themselves), once per model instance. The parameter count comes from
  the checkpoint itself when it is on this machine (safetensors headers are read; no weights are
  loaded), otherwise from the catalog (:mod:`labkit.repository.models`).
- :mod:`labkit.hardware` says what the machine has (psutil; NVML), and
  :func:`served_memory` what the loaded models really hold.
- :func:`plan` walks a list of models in order, keeps those that fit in what is left, and replaces
  one that does not with a small fallback (``opt125m``) with a logged warning, or refuses it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import psutil
from safetensors import SafetensorError, safe_open
from tritonclient.grpc import model_config_pb2

from labkit.errors import ConfigError, ServerError
from labkit.hardware import (
    GIB,
    Memory,
    device_memory,
    gpu_memory_by_pid,
    host_memory,
    resolve_device,
)
from labkit.proc import python_stubs
from labkit.repository.config import read_config
from labkit.repository.models import BUILDERS, CATALOG, MARKER, model_folder
from labkit.settings import cache_dir, hf_home, project_root

if TYPE_CHECKING:
    from labkit.server import TritonServer

log = logging.getLogger(__name__)

#: Activations, KV cache and allocator slack on top of the weights (the catalog uses the same).
HEADROOM = 0.2
#: What one Python-backend stub costs beyond its weights: Python, torch and transformers in host
#: memory (measured: 0.37-0.40 GiB resident per stub on CPU), or on a GPU the CUDA context and
#: PyTorch's caching-allocator slack (not measured on a GPU yet: a conservative 1 GiB).
RUNTIME_OVERHEAD_BYTES = {"cpu": int(0.5 * GIB), "gpu": int(1.0 * GIB)}
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}
#: safetensors' dtype codes -> torch dtype names.
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
SAFETENSORS_DTYPES |= {"I8": "int8", "U8": "uint8", "I64": "int64", "I32": "int32", "BOOL": "bool"}
#: Index buffers some checkpoints store (BERT's position_ids): not parameters, not counted.
INDEX_DTYPES = ("int64", "int32", "int16", "bool")
TEXTGEN, EMBEDDING = "text generation", "embedding"


# -- parameter counts ---------------------------------------------------------------------------
def safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """Each tensor of a safetensors file, name -> ``{"dtype": "F32", "shape": [...]}``, from the
    file's header (:func:`safetensors.safe_open`: no weights are loaded)."""
    try:
        with safe_open(path, framework="np") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            return {n: {"dtype": t.get_dtype(), "shape": t.get_shape()} for n, t in slices.items()}
    except SafetensorError as exc:
        raise ConfigError(f"{path}: not a safetensors file ({exc})") from exc


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint folder holds: parameter count and the dtype its tensors are stored in."""

    folder: Path
    parameters: int
    stored_dtype: str
    files: int


def count_checkpoint(folder: str | os.PathLike) -> Checkpoint:
    """Count the parameters of a transformers checkpoint folder from its safetensors headers.

    Tied weights are stored once by ``save_pretrained``, so the count is that of the model in
    memory; integer index buffers (``position_ids``) are not counted. A folder with only ``pytorch_model*.bin`` files is read with ``torch.load(mmap=True)``.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    counts: dict[str, int] = {}
    if files:
        for path in files:
            for info in safetensors_header(path).values():
                dtype = SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
                counts[dtype] = counts.get(dtype, 0) + math.prod(info["shape"])
    else:
        files = sorted(folder.glob("pytorch_model*.bin"))
        if not files:
            raise ConfigError(
                f"{str(folder)!r} holds no *.safetensors or pytorch_model*.bin weights; "
                "pass a folder saved with save_pretrained"
            )
        import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

        for path in files:
            seen = set()
            for tensor in torch.load(path, mmap=True, weights_only=True).values():
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
                if key not in seen:
                    seen.add(key)
                    name = str(tensor.dtype).removeprefix("torch.")
                    counts[name] = counts.get(name, 0) + tensor.numel()
    counts = {k: v for k, v in counts.items() if k not in INDEX_DTYPES}
    stored = max(counts, key=counts.get) if counts else "float32"
    return Checkpoint(folder, sum(counts.values()), stored, len(files))


# -- estimates ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """The memory one model needs on one device."""

    model: str
    kind: str
    source: str  # where the parameter count came from
    device: str  # where the weights live: cpu, or gpu
    parameters: int
    dtype: str
    bytes_per_parameter: int
    instances: int
    headroom: float = HEADROOM
    runtime_bytes: int = 0

    @property
    def weights_bytes(self) -> int:
        """Parameters x bytes per parameter: one copy of the weights."""
        return self.parameters * self.bytes_per_parameter

    @property
    def needed_bytes(self) -> int:
        """Weights plus headroom plus the stub's own cost, for every instance."""
        per_instance = self.weights_bytes * (1 + self.headroom) + self.runtime_bytes
        return int(self.instances * per_instance)

    def describe(self) -> str:
        return (
            f"{self.model} needs ~{self.needed_bytes / GIB:.2f} GiB "
            f"({self.parameters / 1e9:.3f} B parameters x {self.bytes_per_parameter} bytes "
            f"({self.dtype}) + {self.headroom:.0%} headroom + "
            f"{self.runtime_bytes / GIB:.1f} GiB runtime, x{self.instances} instance(s))"
        )


@dataclass
class _Source:
    kind: str = TEXTGEN
    huggingface_model: str = ""
    folder: Path | None = None  # the model folder in a repository
    dtype: str = "auto"
    instances: int = 1
    cpu_only: bool = False  # every instance group is KIND_CPU: host memory even on a GPU host
    builder: str | None = None
    catalog_billions: float | None = None


def _from_repository(folder: Path) -> _Source:
    cfg = read_config(folder / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    kind = EMBEDDING if any(o.name == "embedding" for o in cfg.output) else TEXTGEN
    instances = sum(g.count or 1 for g in cfg.instance_group) or 1
    cpu = model_config_pb2.ModelInstanceGroup.KIND_CPU
    cpu_only = bool(cfg.instance_group) and all(g.kind == cpu for g in cfg.instance_group)
    return _Source(
        kind,
        params.get("huggingface_model", ""),
        folder,
        params.get("dtype", "auto") or "auto",
        instances,
        cpu_only,
        params.get("labkit_weights"),
    )


def _catalog_source(name: str) -> _Source | None:
    entry = CATALOG.get(name)
    if entry is None:
        return None
    return _Source(
        TEXTGEN,
        entry.huggingface_model,
        builder=entry.labkit_weights,
        dtype=entry.defaults.get("dtype", "auto"),
        catalog_billions=entry.parameters_b,
    )


def _local_folder(src: _Source) -> Path | None:
    """The checkpoint folder on this machine that the model will load, if there is one."""
    hub = src.huggingface_model
    if src.builder and src.builder in BUILDERS:
        built = cache_dir() / "models" / BUILDERS[src.builder].directory
        return built if (built / MARKER).is_file() else None
    if hub.startswith("package:"):
        return Path(model_folder(hub))
    path = Path(hub).expanduser()
    if src.folder is not None and not path.is_absolute():
        path = src.folder / path
    if hub and path.is_dir():
        return path
    if "/" in hub and not hub.startswith(("/", ".")):  # a Hub id already downloaded?
        snapshots = hf_home() / "hub" / f"models--{hub.replace('/', '--')}" / "snapshots"
        done = [s for s in sorted(snapshots.glob("*")) if any(s.glob("*.safetensors"))]
        return done[-1] if done else None
    return None


def _catalog_billions(src: _Source) -> float | None:
    if src.catalog_billions is not None:
        return src.catalog_billions
    for entry in CATALOG.values():
        same_builder = src.builder and entry.labkit_weights == src.builder
        if same_builder or (not src.builder and entry.huggingface_model == src.huggingface_model):
            return entry.parameters_b
    return None


def _load_dtype(src: _Source, device: str, stored: str | None) -> str:
    if src.kind == EMBEDDING:  # the embedding template loads with transformers' default "auto"
        return stored if stored in DTYPE_BYTES else "float32"
    if src.dtype != "auto":
        if src.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"dtype {src.dtype!r} has no known size; use one of {', '.join(DTYPE_BYTES)}"
            )
        return src.dtype
    return "float16" if device == "gpu" else "float32"  # what the textgen template does


def estimate(
    model: str,
    *,
    device: str = "cpu",
    repository: str | os.PathLike | None = None,
    headroom: float = HEADROOM,
    runtime_bytes: int | None = None,
) -> Estimate:
    """The memory ``model`` needs on ``device`` (``cpu`` or ``gpu``).

    ``model`` is a folder of ``repository`` (default: the lab's ``model_repository/``) or a
    catalog name. The parameter count comes from the local checkpoint when there is one (built
    offline weights, a package's files, a folder, a Hub download in ``HF_HOME``), else from the
    catalog.
    """
    device = resolve_device(device)
    root = Path(repository) if repository is not None else project_root() / "model_repository"
    folder = root / model
    if (folder / "config.pbtxt").is_file():
        src = _from_repository(folder)
    else:
        src = _catalog_source(model)
        if src is None:
            raise ConfigError(
                f"cannot estimate the memory of {model!r}: it is neither a model of "
                f"{str(root)!r} nor in the catalog; add it to one of them first"
            )
    local = _local_folder(src)
    if local is not None:
        counted = count_checkpoint(local)
        parameters, stored, where = counted.parameters, counted.stored_dtype, f"checkpoint {local}"
    else:
        billions = _catalog_billions(src)
        if billions is None:
            raise ConfigError(
                f"cannot estimate the memory of {model!r}: {src.huggingface_model!r} is not on "
                "this machine and not in the catalog; download it, or add it to the catalog "
                "(labkit.repository.CATALOG)"
            )
        parameters, stored, where = int(billions * 1e9), None, "catalog"
    device = "cpu" if src.cpu_only else device
    dtype = _load_dtype(src, device, stored)
    return Estimate(
        model,
        src.kind,
        where,
        device,
        parameters,
        dtype,
        DTYPE_BYTES[dtype],
        src.instances,
        headroom,
        RUNTIME_OVERHEAD_BYTES[device] if runtime_bytes is None else runtime_bytes,
    )


# -- the plan -----------------------------------------------------------------------------------
@dataclass
class Plan:
    """Which models to load: ``models`` (in order), the ``table`` behind it, the ``messages``."""

    models: list[str]
    memory: Memory
    rows: list[dict] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)

    @property
    def table(self) -> pd.DataFrame:

        return pd.DataFrame(self.rows or None, columns=None if self.rows else ["model"]).set_index(
            "model"
        )

    def of_kind(self, kind: str) -> list[str]:
        """The planned models of one kind (``text generation`` or ``embedding``)."""
        kinds = {row["serve as"]: row["kind"] for row in self.rows if row["serve as"]}
        return [m for m in self.models if kinds.get(m) == kind]

    def compare(self, server) -> pd.DataFrame:
        """Each served model's estimate beside what its processes hold (:func:`served_memory`):
        resident host memory for a CPU model, GPU memory for a GPU model."""
        rows = {r["serve as"]: r for r in self.rows if r["serve as"]}
        frame = served_memory(server)
        planned = [rows.get(m, {}) for m in frame.index]
        frame.insert(0, "estimated (GiB)", [r.get("needed (GiB)", float("nan")) for r in planned])
        on_gpu = [r.get("device") == "gpu" for r in planned]
        frame["measured (GiB)"] = frame["gpu (GiB)"].where(on_gpu, frame["resident (GiB)"])
        frame["within estimate"] = frame["measured (GiB)"] <= frame["estimated (GiB)"]
        return frame

    def summary(self) -> str:
        head = f"{self.memory.device}: {self.memory}; loading {', '.join(self.models) or 'none'}"
        return "\n".join([head, *self.messages])


def _row(est: Estimate, free: int, decision: str, serve_as: str) -> dict:
    return {
        "model": est.model,
        "kind": est.kind,
        "device": est.device,
        "parameters (M)": round(est.parameters / 1e6, 1),
        "dtype": est.dtype,
        "weights (GiB)": round(est.weights_bytes / GIB, 3),
        "needed (GiB)": round(est.needed_bytes / GIB, 3),
        "free before (GiB)": round(free / GIB, 2),
        "decision": decision,
        "serve as": serve_as,
        "count from": "checkpoint" if est.source.startswith("checkpoint") else est.source,
    }


def plan(
    models: Sequence[str],
    *,
    device: str = "auto",
    repository: str | os.PathLike | None = None,
    fallback: str | None = "opt125m",
    strict: bool = False,
    memory: Memory | None = None,
    headroom: float = HEADROOM,
) -> Plan:
    """Decide which of ``models`` to load on ``device``, in order, before anything is loaded.

    Each model's :func:`estimate` is checked against the memory still free after the models before
    it. One that does not fit is replaced by ``fallback`` (when it fits and is not planned yet) or
    refused, with a warning naming the model, its estimate and what the device has; ``strict``
    raises :class:`ConfigError` instead. ``memory`` replaces the measured device (for what-ifs).
    """
    if isinstance(models, str):
        raise ConfigError(f"plan() takes a list of model names, got one string {models!r}")
    repeated = sorted({m for m in models if list(models).count(m) > 1})
    if repeated:
        raise ConfigError(f"models {repeated} are listed twice; name each model once")
    memory = memory or device_memory(device)
    chosen = Plan([], memory)
    pools = {memory.device: memory}  # a KIND_CPU model on a GPU host takes host memory
    free = {memory.device: memory.available_bytes}

    def check(model: str) -> tuple[Estimate, Memory, int]:
        est = estimate(model, device=memory.device, repository=repository, headroom=headroom)
        if est.device not in pools:
            pools[est.device] = host_memory()
            free[est.device] = pools[est.device].available_bytes
        return est, pools[est.device], free[est.device]

    for name in models:
        est, pool, left = check(name)
        if est.needed_bytes <= left:
            chosen.rows.append(_row(est, left, "fits", name))
            chosen.models.append(name)
            free[est.device] -= est.needed_bytes
            continue
        planned = pool.available_bytes - left  # what the models planned before it take
        problem = (
            f"{est.describe()}, but only {left / GIB:.2f} GiB is left for it on the "
            f"{pool.device}: {pool}"
            + (
                f", less {planned / GIB:.2f} GiB for the models planned before it"
                if planned
                else ""
            )
        )
        if strict:
            raise ConfigError(
                f"{problem}; choose a smaller model (such as {fallback or 'opt125m'}), "
                "free memory, or use a larger device"
            )
        sub, why = None, ""
        if fallback and fallback != name:
            if fallback in chosen.models or fallback in models:
                why = f"{fallback} is already planned"
            else:
                sub, _, sub_left = check(fallback)
                if sub.needed_bytes > sub_left:
                    why = f"{fallback} does not fit either: it needs ~{sub.needed_bytes / GIB:.2f} GiB"
                    sub = None
        if sub is not None:
            chosen.rows.append(_row(est, left, f"replaced by {fallback}", ""))
            chosen.rows.append(_row(sub, free[sub.device], f"fallback for {name}", fallback))
            chosen.models.append(fallback)
            free[sub.device] -= sub.needed_bytes
            message = f"{problem}; serving {fallback} instead ({sub.describe()})"
        else:
            chosen.rows.append(_row(est, left, "refused", ""))
            message = f"{problem}; not loading it" + (f" ({why})" if why else "")
        log.warning(message)
        chosen.messages.append(message)
    return chosen


# -- what the served models hold --------------------------------------------------------------
def served_memory(server: TritonServer) -> pd.DataFrame:
    """Memory of each served model's stub processes on a local server: resident host memory
    (RSS) and GPU memory (NVML; 0 without a GPU).

    A stub's command line names the ``model.py`` it runs (``<repo>/<model>/<version>/model.py``).
    The resident set includes weights memory-mapped from the checkpoint once they have been read,
    so measure after the model has answered a request.
    """

    if server.pid is None:
        raise ServerError(
            f"{server!r} runs no local process (remote or stopped); served_memory() measures "
            "the stub processes of a server started here"
        )
    on_gpu = gpu_memory_by_pid()
    totals: dict[str, list[tuple[int, int]]] = {}
    for name, processes in python_stubs(server.pid).items():
        for stub in processes:
            try:
                rss = stub.memory_info().rss
            except psutil.Error:  # a stub that ended meanwhile
                continue
            totals.setdefault(name, []).append((rss, on_gpu.get(stub.pid, 0)))
    columns = ["model", "processes", "resident (GiB)", "gpu (GiB)"]
    rows = [
        (m, len(r), round(sum(x for x, _ in r) / GIB, 3), round(sum(g for _, g in r) / GIB, 3))
        for m, r in sorted(totals.items())
    ]
    return pd.DataFrame(rows, columns=columns).set_index("model")
