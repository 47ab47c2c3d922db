"""Compile a model for AWS Inferentia and Trainium (or the ``cpu`` target) and load it back.

The hardware itself is found by :func:`labkit.hardware.detect_neuron`.

- :func:`compile` turns a PyTorch module into a saved TorchScript artifact: ``torch_neuronx.trace``
  for inf2/trn1, ``torch.neuron.trace`` for inf1, and ``torch.jit.trace`` for the ``cpu`` target
  (development and CI; it is called ``cpu`` wherever it appears, never passed off as Neuron).
  Results are cached by model, input shapes, target and compiler arguments.
- The Triton model generator is in :mod:`labkit.neuron.gen`; the LLM (vLLM with the Neuron plugin)
  in :mod:`labkit.neuron.vllm`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from labkit.errors import ConfigError, MissingDependencyError
from labkit.settings import cache_dir as labkit_cache_dir

log = logging.getLogger(__name__)

TARGETS = ("inf1", "inf2", "trn1", "cpu")
SETUP_HINT = (
    "run scripts/setup-neuron-host.sh on the Neuron host (it adds the Neuron pip repository)"
)


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
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

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
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

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
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

    with torchscript_allowed():
        model = torch.jit.load(str(path), map_location="cpu")
    return model.eval()


@contextlib.contextmanager
def _quiet_trace():
    """Silence what tracing a transformers model prints, each for its reason.

    - ``TracerWarning``: transformers' masking code branches on tensor shapes, which a trace
      fixes for the traced shapes; the traced model is compiled for exactly those shapes, and the
      lab checks its outputs against eager PyTorch (:func:`labkit.neuron.walkthrough.compare`).
    - the ``is_gradient_checkpointing`` FutureWarning and the ``loss_type`` notice: the tracer
      reads every attribute of the module, deprecated properties included; neither concerns
      inference.
    """
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

    try:
        from transformers.utils import logging as hf_logging  # noqa: PLC0415 (a model library: importing labkit loads none)
    except ImportError:  # a plain PyTorch model, no transformers here
        hf_logging = None
    verbosity = hf_logging.get_verbosity() if hf_logging else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        if hf_logging:
            hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            if hf_logging:
                hf_logging.set_verbosity(verbosity)


def _trace(model, inputs, target, args, workdir, dynamic_batch_size):
    with _quiet_trace():
        return _trace_for(model, inputs, target, args, workdir, dynamic_batch_size)


def _trace_for(model, inputs, target, args, workdir, dynamic_batch_size):
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

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
        import torch_neuronx  # noqa: PLC0415 (Neuron hosts only)
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
