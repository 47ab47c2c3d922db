"""Triton model generator for Neuron-compiled models (and the ``cpu`` target that stands in for them).

Covers every option of python_backend's ``inferentia/scripts/gen_triton_model.py`` with the same
spellings (``--triton_input INPUT__0,INT64,4x384``, ``--neuron_core_range 0:3``, ...), so an
existing command works unchanged under ``labkit neuron gen-model``. Differences on purpose:

- ``config.pbtxt`` is built as a ``ModelConfig`` protobuf and written with ``text_format``;
- any ``--model_version`` works (upstream writes model.py into ``1/`` whatever the version);
- cores that the instance count leaves unused are reported in a loud warning, naming them;
- each instance's thread count comes from its own cores, not from the whole range;
- ``--target cpu`` serves the same artifact through ``torch.jit.load`` for development and CI.

``model.py`` is a fixed template from ``labkit/templates/neuron/`` that reads every option from
the config's parameters, so a generated model can be retuned by editing ``config.pbtxt``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from labkit.errors import ConfigError, MissingDependencyError, MissingFileError

log = logging.getLogger(__name__)

TARGETS = ("inf1", "inf2", "trn1", "cpu")
MODEL_TYPES = ("pytorch", "tensorflow")
TEMPLATE_DIR = Path(__file__).parent.parent / "templates" / "neuron"
TEMPLATES = {"pytorch": "pytorch_model.py", "tensorflow": "tensorflow_model.py"}
TRITON_TYPES = tuple(k.removeprefix("TYPE_") for k in mc.DataType.keys() if k != "TYPE_INVALID")  # noqa: SIM118 (protobuf enum wrapper)
_NAME = re.compile(r"^(?P<stem>.+)__(?P<index>\d+)$")
# TensorFlow dtype names (``tf.DType.name``) to Triton data types.
TF_TO_TRITON = {
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
    "bfloat16": "BF16",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "bool": "BOOL",
    "string": "STRING",
}


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: ``NAME,DATATYPE,SHAPE`` with ``x`` between dimensions."""

    name: str
    data_type: str  # Triton's name without the TYPE_ prefix: INT64, FP32, STRING, ...
    dims: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> TensorSpec:
        parts = text.split(",")
        if len(parts) != 3 or not all(p.strip() for p in parts):
            raise ConfigError(
                f"tensor spec {text!r} is not NAME,DATATYPE,SHAPE; write for example "
                "INPUT__0,INT64,4x384 (x between dimensions, -1 for a variable one)"
            )
        name, dtype, shape = (p.strip() for p in parts)
        dtype = dtype.upper().removeprefix("TYPE_")
        if dtype not in TRITON_TYPES:
            known = ", ".join(TRITON_TYPES)
            raise ConfigError(
                f"data type {dtype!r} in {text!r} is not a Triton type; use one of {known}"
            )
        try:
            dims = tuple(int(d) for d in shape.lower().split("x"))
        except ValueError:
            raise ConfigError(
                f"shape {shape!r} in {text!r} is not integers separated by x; write e.g. 4x384 or -1x4"
            ) from None
        if any(d == 0 or d < -1 for d in dims):
            raise ConfigError(f"shape {shape!r} in {text!r} has a dimension that is 0 or below -1")
        return cls(name, dtype, dims)


@dataclass(frozen=True)
class CoreAssignment:
    """Which Neuron cores each Triton model instance gets."""

    ranges: tuple[tuple[int, int], ...]  # inclusive (first, last) per instance
    unused: tuple[int, ...]

    @property
    def cores_per_instance(self) -> int:
        first, last = self.ranges[0]
        return last - first + 1

    def visible_cores(self, instance: int) -> str:
        """The ``NEURON_RT_VISIBLE_CORES`` value of instance ``instance``."""
        first, last = self.ranges[instance]
        return str(first) if first == last else f"{first}-{last}"


def parse_core_range(text: str) -> tuple[int, int]:
    """``"0:7"`` -> ``(0, 7)``; both ends inclusive, as upstream."""
    try:
        start, end = (int(p) for p in str(text).split(":"))
    except ValueError:
        raise ConfigError(
            f"--neuron_core_range {text!r} is not <start>:<end>; write e.g. 0:3 for cores 0 to 3"
        ) from None
    if start < 0 or end < start:
        raise ConfigError(
            f"--neuron_core_range {text!r}: the end must be >= the start and both >= 0; e.g. 0:3"
        )
    return start, end


def assign_cores(start: int, end: int, instance_count: int) -> CoreAssignment:
    """Split cores ``start..end`` equally between ``instance_count`` instances.

    Instances get equal, contiguous slices (a compiled model runs the same on each); cores left
    over when the count does not divide evenly are returned in ``unused`` for the caller to
    report loudly. More instances than cores is an error.
    """
    total = end - start + 1
    if instance_count < 1:
        raise ConfigError(f"--triton_model_instance_count must be >= 1, got {instance_count}")
    if instance_count > total:
        raise ConfigError(
            f"cannot give {instance_count} model instances their own cores out of the {total} in "
            f"{start}:{end}; lower --triton_model_instance_count or widen --neuron_core_range"
        )
    per = total // instance_count
    ranges = tuple((start + i * per, start + (i + 1) * per - 1) for i in range(instance_count))
    unused = tuple(range(start + per * instance_count, end + 1))
    return CoreAssignment(ranges, unused)


@dataclass
class GenOptions:
    """Everything ``gen_triton_model.py`` takes, plus ``target`` and ``copy_compiled_model``."""

    triton_model_dir: str | os.PathLike
    compiled_model: str | os.PathLike
    neuron_core_range: str = "0:0"
    target: str = "inf1"  # upstream's default without --inf2
    model_type: str = "pytorch"
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    triton_model_instance_count: int = 1
    threads_per_core: int = 1
    enable_dynamic_batching: bool = False
    max_batch_size: int = 0
    preferred_batch_size: list[int] | None = None
    max_queue_delay_microseconds: int | None = None
    disable_batch_requests_to_neuron: bool = False
    tag_set: str = "serve"
    signature_def_key: str = "serving_default"
    model_version: int = 1
    copy_compiled_model: bool = False
    #: The compiled model is made later, on the device host (a folder written here for inf2): it
    #: is expected to be missing, so the generator records it in ``pending`` instead of warning.
    compiled_elsewhere: bool = False


@dataclass
class GeneratedModel:
    path: Path
    config: mc.ModelConfig
    cores: CoreAssignment
    warnings: list[str]
    #: The compiled model the config names that is still to be made (``compiled_elsewhere``).
    pending: str = ""

    @property
    def name(self) -> str:
        return self.config.name


def _check_names(specs: list[TensorSpec], kind: str) -> None:
    """PyTorch models take inputs by position: names must be <name>__<index>, indices 0..n-1."""
    indices = []
    for spec in specs:
        match = _NAME.match(spec.name)
        if not match:
            raise ConfigError(
                f"{kind} name {spec.name!r} does not follow <name>__<index> (e.g. {kind.upper()}__0); "
                "a TorchScript model has no tensor names, so the index gives the position"
            )
        indices.append(int(match["index"]))
    if sorted(indices) != list(range(len(specs))):
        raise ConfigError(
            f"{kind} indices {sorted(indices)} must be 0..{len(specs) - 1}, each once "
            f"(names: {', '.join(s.name for s in specs)})"
        )


def _tensor(spec: TensorSpec, message):
    t = message(name=spec.name, data_type=mc.DataType.Value(f"TYPE_{spec.data_type}"))
    t.dims.extend(spec.dims)
    return t


def build_config(
    opts: GenOptions, name: str, compiled_model: str
) -> tuple[mc.ModelConfig, CoreAssignment, list[str]]:
    """Validate ``opts`` and return the ``ModelConfig``, the core split and the warnings."""
    warnings: list[str] = []
    _check_options(opts)
    start, end = parse_core_range(opts.neuron_core_range)
    cores = assign_cores(start, end, opts.triton_model_instance_count)
    if cores.unused:
        warnings.append(
            f"UNUSED NEURON CORES: {len(cores.unused)} of the {end - start + 1} cores in "
            f"{start}:{end} ({', '.join(map(str, cores.unused))}) are left idle, because "
            f"{opts.triton_model_instance_count} instances get {cores.cores_per_instance} cores "
            f"each ({', '.join(cores.visible_cores(i) for i in range(len(cores.ranges)))}). "
            "Choose an instance count that divides the core count, or narrow --neuron_core_range."
        )
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=opts.max_batch_size)
    config.input.extend(_tensor(s, mc.ModelInput) for s in opts.inputs)
    config.output.extend(_tensor(s, mc.ModelOutput) for s in opts.outputs)
    config.instance_group.add(
        kind=mc.ModelInstanceGroup.KIND_MODEL, count=opts.triton_model_instance_count
    )
    config.version_policy.specific.versions.append(opts.model_version)
    warnings += _add_batching(config, opts, cores)
    params = {
        "TARGET": opts.target,
        "MODEL_TYPE": opts.model_type,
        "COMPILED_MODEL": compiled_model,
        "NEURON_CORE_START_INDEX": start,
        "NEURON_CORE_END_INDEX": end,
        "NUM_THREADS_PER_CORE": opts.threads_per_core,
        "BATCH_REQUESTS_TO_NEURON": "false" if opts.disable_batch_requests_to_neuron else "true",
    }
    if opts.model_type == "tensorflow":
        params.update(TAG_SET=opts.tag_set, SIGNATURE_DEF_KEY=opts.signature_def_key)
    for key, value in params.items():
        config.parameters[key].string_value = str(value)
    return config, cores, warnings


def _check_options(opts: GenOptions) -> None:
    """Refuse options that gen_triton_model.py would turn into a model Triton cannot serve."""
    if opts.target not in TARGETS:
        raise ConfigError(f"target {opts.target!r} is not one of {', '.join(TARGETS)}")
    if opts.model_type not in MODEL_TYPES:
        raise ConfigError(
            f"--model_type {opts.model_type!r} is not one of {', '.join(MODEL_TYPES)}"
        )
    if opts.model_type == "tensorflow" and opts.target == "cpu":
        raise ConfigError("the cpu target serves TorchScript only; use --model_type pytorch")
    if opts.model_version < 1:
        raise ConfigError(f"--model_version must be >= 1, got {opts.model_version}")
    if opts.threads_per_core < 1:
        raise ConfigError(f"--threads_per_core must be >= 1, got {opts.threads_per_core}")
    if opts.max_batch_size < 0:
        raise ConfigError(f"--max_batch_size must be >= 0, got {opts.max_batch_size}")
    if not opts.inputs or not opts.outputs:
        raise ConfigError("give at least one --triton_input and one --triton_output")
    if opts.model_type == "pytorch":
        _check_names(opts.inputs, "input")
        _check_names(opts.outputs, "output")
        for spec in opts.inputs + opts.outputs:
            if spec.data_type == "STRING":
                raise ConfigError(
                    f"{spec.name}: a TorchScript model cannot take or return STRING tensors"
                )


def _add_batching(config: mc.ModelConfig, opts: GenOptions, cores: CoreAssignment) -> list[str]:
    """Set dynamic batching from ``opts``; return the warnings about batching options."""
    warnings: list[str] = []
    batching_only = {
        "--preferred_batch_size": opts.preferred_batch_size,
        "--max_queue_delay_microseconds": opts.max_queue_delay_microseconds,
    }
    if opts.enable_dynamic_batching:
        if opts.max_batch_size < 1:
            raise ConfigError(
                "--enable_dynamic_batching needs --max_batch_size >= 1 (got "
                f"{opts.max_batch_size}); Triton batches only models that declare a batch dimension"
            )
        batcher = config.dynamic_batching
        batcher.SetInParent()  # on, even with no option set: `dynamic_batching { }`
        for size in opts.preferred_batch_size or []:
            if not 1 <= size <= opts.max_batch_size:
                raise ConfigError(
                    f"--preferred_batch_size {size} must be between 1 and --max_batch_size "
                    f"{opts.max_batch_size}"
                )
            if size % cores.cores_per_instance:
                warnings.append(
                    f"--preferred_batch_size {size} is not a multiple of the "
                    f"{cores.cores_per_instance} cores per instance; some cores idle per batch"
                )
            batcher.preferred_batch_size.append(size)
        if opts.max_queue_delay_microseconds is not None:
            if opts.max_queue_delay_microseconds < 0:
                raise ConfigError("--max_queue_delay_microseconds must be >= 0")
            batcher.max_queue_delay_microseconds = opts.max_queue_delay_microseconds
    else:
        for flag, value in batching_only.items():
            if value is not None:
                warnings.append(f"{flag} is ignored without --enable_dynamic_batching")
    return warnings


def generate_model(opts: GenOptions) -> GeneratedModel:
    """Write ``<triton_model_dir>/config.pbtxt`` and ``<version>/model.py``; return what was made.

    A relative ``compiled_model`` is kept relative to the model directory (upstream's ``--inf2``
    convention, now for every target), so a repository can move. ``copy_compiled_model`` copies
    the artifact into ``<version>/`` and points the config there.
    """
    model_dir = Path(opts.triton_model_dir)
    name = model_dir.resolve().name
    if opts.model_type == "tensorflow" and not (opts.inputs and opts.outputs):
        opts.inputs, opts.outputs = read_saved_model_signature(
            opts.compiled_model, opts.tag_set, opts.signature_def_key
        )
        if opts.max_batch_size > 0:  # the signature's first dimension is the batch
            opts.inputs, opts.outputs = (
                [TensorSpec(t.name, t.data_type, t.dims[1:]) for t in specs]
                for specs in (opts.inputs, opts.outputs)
            )
    compiled = Path(opts.compiled_model)
    version_dir = model_dir / str(opts.model_version)
    if opts.copy_compiled_model:
        if not compiled.exists():
            raise MissingFileError(
                f"compiled model {str(compiled)!r} does not exist; compile it first "
                "(labkit neuron compile) or fix --compiled_model"
            )
        reference = f"{opts.model_version}/{compiled.name}"
    else:
        reference = str(compiled)
    config, cores, warnings = build_config(opts, name, reference)
    version_dir.mkdir(parents=True, exist_ok=True)
    if opts.copy_compiled_model:
        target = version_dir / compiled.name
        if compiled.is_dir():
            shutil.copytree(compiled, target, dirs_exist_ok=True)
        else:
            shutil.copy2(compiled, target)
    pending = ""
    if (
        not opts.copy_compiled_model
        and not (compiled if compiled.is_absolute() else model_dir / compiled).exists()
    ):
        if opts.compiled_elsewhere:
            pending = str(compiled)
            log.info("%s: %s is to be compiled on the device host", name, pending)
        else:
            warnings.append(
                f"compiled model {str(compiled)!r} does not exist yet (a relative path is read "
                f"from {str(model_dir)!r}); the model will fail to load until it does"
            )
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    template = TEMPLATE_DIR / TEMPLATES[opts.model_type]
    (version_dir / "model.py").write_text(template.read_text())
    for message in warnings:
        log.warning("%s: %s", name, message)
    return GeneratedModel(model_dir, config, cores, warnings, pending)


def read_saved_model_signature(
    saved_model: str | os.PathLike, tag_set: str, signature_def_key: str
):
    """Inputs and outputs of a TensorFlow SavedModel's signature, as ``TensorSpec`` lists."""
    try:
        from tensorflow.python.tools import saved_model_utils  # noqa: PLC0415 (Neuron hosts only)
    except ImportError as exc:
        raise MissingDependencyError(
            "reading a SavedModel's signature needs tensorflow (tensorflow-neuron on inf1, "
            "tensorflow-neuronx on inf2/trn1); install it, or pass --triton_input and "
            "--triton_output yourself"
        ) from exc
    meta = saved_model_utils.get_meta_graph_def(str(saved_model), tag_set)
    if signature_def_key not in meta.signature_def:
        raise ConfigError(
            f"--signature_def_key {signature_def_key!r} is not in {str(saved_model)!r}; it has "
            f"{', '.join(meta.signature_def)}"
        )
    sig = meta.signature_def[signature_def_key]
    return signature_specs(sig.inputs.items()), signature_specs(sig.outputs.items())


def signature_specs(items) -> list[TensorSpec]:
    """``(key, TensorInfo)`` pairs of a signature -> ``TensorSpec`` list named by the keys.

    ``TensorInfo.dtype`` may be the DataType enum or its name (``float32``); an unknown
    dimension (-1) stays -1.
    """
    specs = []
    for key, info in items:
        dtype = info.dtype if isinstance(info.dtype, str) else _tf_dtype_name(info.dtype)
        if dtype not in TF_TO_TRITON:
            raise ConfigError(f"TensorFlow dtype {dtype!r} of {key!r} has no Triton type")
        dims = tuple(int(d.size) for d in info.tensor_shape.dim)
        specs.append(TensorSpec(key, TF_TO_TRITON[dtype], dims))
    return specs


def _tf_dtype_name(enum_value: int) -> str:
    import tensorflow as tf  # noqa: PLC0415 (Neuron hosts only)

    return tf.dtypes.as_dtype(enum_value).name
