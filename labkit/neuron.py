"""AWS Inferentia and Trainium: find the hardware, compile a model for it, serve it through Triton.

- :func:`detect` reports inf1 / inf2 / trn1 / trn2 / none with device and NeuronCore counts, from
  ``neuron-ls --json-output`` or, without the tools, from the ``/dev/neuron*`` devices.
- :func:`compile` turns a PyTorch module into a saved TorchScript artifact: ``torch_neuronx.trace``
  for inf2/trn1, ``torch.neuron.trace`` for inf1, and ``torch.jit.trace`` for the ``cpu`` target
  (development and CI; it is called ``cpu`` wherever it appears, never passed off as Neuron).
  Results are cached by model, input shapes, target and compiler arguments.
- The Triton model generator is in :mod:`labkit.neuron_gen`; the inf2 LLM in :mod:`labkit.neuron_llm`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, MissingDependencyError, ToolError
from .proc import run
from .settings import cache_dir as labkit_cache_dir

log = logging.getLogger(__name__)

TARGETS = ("inf1", "inf2", "trn1", "cpu")
#: NeuronCores per device by instance family (trn2 shown with its default logical-core setting).
CORES_PER_DEVICE = {"inf1": 4, "inf2": 2, "trn1": 2, "trn2": 4}
SETUP_HINT = (
    "run scripts/setup-neuron-host.sh on the Neuron host (it adds the Neuron pip repository)"
)


# -- hardware ----------------------------------------------------------------------------------
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


def detect(
    neuron_ls: str | None = None,
    dev_dir: str | os.PathLike = "/dev",
    sys_dir: str | os.PathLike = "/sys",
) -> NeuronHardware:
    """What Neuron hardware this host has. Never raises for a host without any."""
    instance_type = _instance_type(Path(sys_dir))
    tool = neuron_ls or shutil.which("neuron-ls") or "/opt/aws/neuron/bin/neuron-ls"
    if os.access(tool, os.X_OK):
        try:
            result = run([tool, "--json-output"], timeout_s=30)
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


# -- compile -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompiledModel:
    path: Path
    target: str
    key: str
    cached: bool
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]


def _as_tuple(example_inputs) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, list | tuple) else (example_inputs,)


def cache_key(
    model,
    example_inputs,
    target: str,
    compiler_args: Sequence[str] = (),
    dynamic_batch_size: bool = False,
    model_id: str | None = None,
) -> str:
    """A digest of the model (class, architecture and weights, or ``model_id``), the input
    shapes and dtypes, the target, the compiler arguments and the framework versions."""
    import torch  # noqa: PLC0415

    h = hashlib.sha256()
    for part in (
        target,
        *compiler_args,
        str(dynamic_batch_size),
        torch.__version__,
        _sdk_version(target),
    ):
        h.update(part.encode() + b"\0")
    for t in _as_tuple(example_inputs):
        h.update(f"{tuple(t.shape)}:{t.dtype}".encode() + b"\0")
    if model_id:
        h.update(model_id.encode())
    else:
        h.update(f"{type(model).__module__}.{type(model).__qualname__}\0{model!r}".encode())
        for name, tensor in sorted(model.state_dict().items()):
            t = tensor.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def _sdk_version(target: str) -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    package = {"inf1": "torch-neuron", "inf2": "torch-neuronx", "trn1": "torch-neuronx"}.get(target)
    try:
        return version(package) if package else "none"
    except PackageNotFoundError:
        return "missing"


def compile(  # noqa: A001 (the verb users expect: labkit.neuron.compile)
    model,
    example_inputs,
    target: str = "cpu",
    *,
    compiler_args: Sequence[str] | None = None,
    compiler_workdir: str | os.PathLike | None = None,
    dynamic_batch_size: bool = False,
    cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    model_id: str | None = None,
) -> CompiledModel:
    """Trace ``model`` on ``example_inputs`` for ``target`` and save it as TorchScript.

    ``compiler_args`` and ``compiler_workdir`` go to the Neuron compiler (ignored, with a note,
    on ``cpu``). ``dynamic_batch_size`` lets the artifact take any batch size on dimension 0
    (``torch_neuronx.dynamic_batch`` / ``torch.neuron.trace(dynamic_batch_size=True)``;
    TorchScript on the cpu target already does). The artifact is cached under
    ``$LABKIT_CACHE/neuron/<target>/<key>.pt``; a second call with the same model, shapes,
    target and arguments returns it without compiling.
    """
    import torch  # noqa: PLC0415

    if target not in TARGETS:
        raise ConfigError(f"compile target {target!r} is not one of {', '.join(TARGETS)}")
    inputs = _as_tuple(example_inputs)
    args = list(compiler_args or [])
    key = cache_key(model, inputs, target, args, dynamic_batch_size, model_id)
    folder = Path(cache_dir) if cache_dir else labkit_cache_dir() / "neuron" / target
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.pt"
    shapes = tuple(tuple(t.shape) for t in inputs)
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in inputs)
    if cache and path.is_file():
        log.info("compile cache hit for %s on %s: %s", type(model).__name__, target, path)
        return CompiledModel(path, target, key, True, shapes, dtypes)
    model.eval()
    log.info("compiling %s for %s (inputs %s)", type(model).__name__, target, shapes)
    with torch.no_grad(), torchscript_allowed():
        traced = _trace(model, inputs, target, args, compiler_workdir, dynamic_batch_size)
        staging = Path(tempfile.mkstemp(suffix=".pt", dir=folder)[1])
        torch.jit.save(traced, str(staging))
    staging.replace(path)
    meta = {
        "target": target,
        "input_shapes": shapes,
        "input_dtypes": dtypes,
        "compiler_args": args,
        "dynamic_batch_size": dynamic_batch_size,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_id": model_id,
    }
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    return CompiledModel(path, target, key, False, shapes, dtypes)


@contextlib.contextmanager
def torchscript_allowed():
    """torch 2.13 deprecates ``torch.jit``, but Neuron artifacts are TorchScript
    (``torch_neuronx.trace`` returns one), so the cpu target makes and loads the same kind."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        yield


def load(path: str | os.PathLike):
    """Load a compiled artifact in this process, to compare with what Triton serves.

    A cpu artifact loads anywhere; a Neuron one needs its SDK imported and a Neuron device.
    """
    import torch  # noqa: PLC0415

    with torchscript_allowed():
        model = torch.jit.load(str(path), map_location="cpu")
    return model.eval()


def _trace(model, inputs, target, args, workdir, dynamic_batch_size):
    import torch  # noqa: PLC0415

    if target == "cpu":
        if args or workdir:
            log.info("cpu target: compiler arguments and work directory are not used by torch.jit")
        return torch.jit.trace(model, inputs)
    if target == "inf1":
        try:
            import torch_neuron  # noqa: F401, PLC0415  (registers torch.neuron)
        except ImportError as exc:
            raise MissingDependencyError(
                f"compiling for inf1 needs torch-neuron; {SETUP_HINT}"
            ) from exc
        kwargs = {"compiler_args": args or None, "dynamic_batch_size": dynamic_batch_size}
        if workdir:
            kwargs["compiler_workdir"] = str(workdir)
        return torch.neuron.trace(model, inputs, **kwargs)
    try:
        import torch_neuronx  # noqa: PLC0415
    except ImportError as exc:
        raise MissingDependencyError(
            f"compiling for {target} needs torch-neuronx and neuronx-cc; {SETUP_HINT}"
        ) from exc
    kwargs = {"compiler_args": args or None}
    if workdir:
        kwargs["compiler_workdir"] = str(workdir)
    traced = torch_neuronx.trace(model, inputs, **kwargs)
    if dynamic_batch_size:
        torch_neuronx.dynamic_batch(traced)
    return traced


# -- perf_analyzer with validation (until labkit.profiling lands) ------------------------------
def write_perf_data(path: str | os.PathLike, inputs: list[dict], expected: list[dict]) -> Path:
    """An ``--input-data`` JSON with ``data`` and ``validation_data``, as the upstream QA uses.

    ``inputs`` / ``expected``: one dict per step, tensor name -> numpy array, shaped as the
    model's config declares it: without the batch dimension for a batching model (perf_analyzer
    adds it, ``-b``), with it for dims such as ``-1x4``. Outputs are compared flattened.
    """
    doc = {
        "data": [
            {
                k: {"content": v.reshape(-1).tolist(), "shape": list(v.shape)}
                for k, v in step.items()
            }
            for step in inputs
        ],
        "validation_data": [
            {k: v.reshape(-1).tolist() for k, v in step.items()} for step in expected
        ],
    }
    path = Path(path)
    path.write_text(json.dumps(doc))
    return path


def perf_analyzer(
    model: str,
    url: str,
    input_data: str | os.PathLike,
    *,
    concurrency: str = "1:4:1",
    out_csv: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300,
) -> str:
    """Run the ``perf_analyzer`` of this environment; returns its report, raises on a failure
    (a validation mismatch included). A small stand-in for ``labkit.profiling.perf_analyzer``."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    if not binary.is_file():
        raise MissingDependencyError(f"{binary} is missing; install tritonclient[all]==2.51.0")
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime  # noqa: PLC0415

        lib = str(Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, env.get("LD_LIBRARY_PATH")]))
    except ImportError:
        pass
    cmd = [
        binary,
        "-m",
        model,
        "-u",
        url,
        f"--input-data={input_data}",
        f"--concurrency-range={concurrency}",
        "--measurement-mode=count_windows",
        "--measurement-request-count=50",
        "--stability-percentage=100",
        *extra_args,
    ]
    if out_csv:
        cmd += ["-f", str(out_csv)]
    return run(cmd, timeout_s=timeout_s, env=env).stdout


# -- command line ------------------------------------------------------------------------------
def register_cli(sub) -> None:
    """``labkit neuron detect | compile | gen-model`` (defined in :mod:`labkit.neuron_cli`)."""
    from .neuron_cli import register  # noqa: PLC0415

    register(sub)
