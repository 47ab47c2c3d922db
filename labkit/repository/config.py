"""Model configurations: Triton's ``ModelConfig`` protobuf read, validated, edited and written.

``config.pbtxt`` is parsed and written with protobuf's ``text_format`` (never with string
formatting). :func:`validate` applies the rules of Triton's that can be checked without a server,
so an edit Triton would reject fails before anything is written, with a message naming the field.
Writes are atomic and in protobuf's canonical text form, so a diff shows only what changed.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from labkit.errors import ConfigError, MissingFileError

ModelConfig = model_config_pb2.ModelConfig
CONFIG_FILE = "config.pbtxt"
KINDS = tuple(model_config_pb2.ModelInstanceGroup.Kind.keys())  # KIND_AUTO, KIND_GPU, ...
# Folder names Triton and every file system accept: no separators, no "..", no leading dot.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid model (folder) name, else raise :class:`ConfigError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"invalid model name {name!r}: use letters, digits, '_', '-' and '.', starting with a "
            "letter, digit or '_', with no path separator and no '..'"
        )
    return name


# -- config files -------------------------------------------------------------------------------
def parse_config(text: str, source: str = "config.pbtxt") -> ModelConfig:
    """Parse config text; a syntax error or unknown field raises with its line and column."""
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        where = f"{source}:{exc.GetLine()}:{exc.GetColumn()}" if exc.GetLine() else source
        raise ConfigError(
            f"{where}: {exc}; fix that line (field names and values are those of Triton's "
            "ModelConfig, see the model configuration documentation)"
        ) from exc


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Read a ``config.pbtxt`` into a ``ModelConfig``."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"no model configuration at {str(path)!r}; create {CONFIG_FILE}")
    return parse_config(path.read_text(encoding="utf-8"), str(path))


def config_to_text(cfg: ModelConfig) -> str:
    """The canonical ``config.pbtxt`` text of ``cfg``."""
    return text_format.MessageToString(cfg, as_utf8=True)


def write_config(path: str | os.PathLike, cfg: ModelConfig) -> None:
    """Validate ``cfg`` (named after its folder) and write it atomically to ``path``."""
    path = Path(path)
    validate(cfg, name=path.parent.name)
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".pbtxt", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_to_text(cfg))
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def diff_configs(old: ModelConfig, new: ModelConfig, name: str = "model") -> str:
    """A unified diff between two configurations in canonical form ('' when they are equal)."""
    lines = difflib.unified_diff(
        config_to_text(old).splitlines(keepends=True),
        config_to_text(new).splitlines(keepends=True),
        fromfile=f"{name}/{CONFIG_FILE} (before)",
        tofile=f"{name}/{CONFIG_FILE} (after)",
    )
    return "".join(lines)


def change_summary(old: ModelConfig, new: ModelConfig, name: str = "model") -> str:
    """What an edit changed, one line a setting (``max_batch_size: 0 -> 8``), where a diff of the
    protobuf text would take five lines a parameter ('' when nothing changed)."""
    lines = []
    for field in sorted(f.name for f in ModelConfig.DESCRIPTOR.fields if f.name != "parameters"):
        before, after = _setting_text(old, field), _setting_text(new, field)
        if before != after:
            lines.append(f"{field}: {before} -> {after}")
    for key in sorted(set(old.parameters) | set(new.parameters)):
        before = old.parameters[key].string_value if key in old.parameters else "(unset)"
        after = new.parameters[key].string_value if key in new.parameters else "(unset)"
        if before != after:
            lines.append(f"parameter {key}: {before} -> {after}")
    return "\n".join([f"{name}/{CONFIG_FILE}:", *("  " + line for line in lines)]) if lines else ""


def _setting_text(config: ModelConfig, field: str) -> str:
    """One field of ``config`` on one line: a message in protobuf's one-line text, a list of
    them in brackets, a plain value as itself; an absent message or an empty list "(unset)"."""
    descriptor = ModelConfig.DESCRIPTOR.fields_by_name[field]
    value = getattr(config, field)
    if descriptor.label == descriptor.LABEL_REPEATED:
        if not len(value):
            return "(unset)"
        if descriptor.message_type is None:
            return "[" + ", ".join(map(str, value)) + "]"
        return (
            "[" + ", ".join(text_format.MessageToString(v, as_one_line=True) for v in value) + "]"
        )
    if descriptor.message_type is not None:
        if not config.HasField(field):
            return "(unset)"
        return "{" + text_format.MessageToString(value, as_one_line=True) + "}"
    return str(value)


def validate(cfg: ModelConfig, *, name: str | None = None) -> None:
    """Raise :class:`ConfigError` listing every rule of Triton's that ``cfg`` breaks.

    ``name`` is the model's folder name; the config's own ``name``, when set, must equal it.
    """
    problems = [
        *_name_problems(cfg, name),
        *_batching_problems(cfg),
        *_instance_problems(cfg),
        *_tensor_problems(cfg, "input"),
        *_tensor_problems(cfg, "output"),
        *["parameters has an empty key" for key in cfg.parameters if not key],
    ]
    if problems:
        label = name or cfg.name or "model"
        raise ConfigError(f"invalid configuration of {label!r}: " + "; ".join(problems))


def _name_problems(cfg: ModelConfig, name: str | None) -> list[str]:
    problems = []
    if name is not None:
        check_name(name)
        if cfg.name and cfg.name != name:
            problems.append(
                f"name {cfg.name!r} differs from the folder name {name!r}; make them equal"
            )
    if cfg.name:
        check_name(cfg.name)
    return problems


def _batching_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    mbs = cfg.max_batch_size
    if mbs < 0:
        problems.append(f"max_batch_size {mbs} is negative; use 0 (no batching) or more")
    if not cfg.HasField("dynamic_batching"):
        return problems
    db = cfg.dynamic_batching
    if mbs == 0:
        problems.append(
            "dynamic_batching needs max_batch_size > 0 (it is 0); set max_batch_size or "
            "remove dynamic_batching"
        )
    for size in db.preferred_batch_size:
        if size < 1 or (mbs > 0 and size > mbs):
            problems.append(
                f"dynamic_batching.preferred_batch_size {size} is outside 1..max_batch_size "
                f"({mbs}); lower it or raise max_batch_size"
            )
    if db.default_priority_level > db.priority_levels:
        problems.append(
            f"dynamic_batching.default_priority_level {db.default_priority_level} is above "
            f"priority_levels {db.priority_levels}"
        )
    return problems


def _instance_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    for i, group in enumerate(cfg.instance_group):
        where = f"instance_group[{i}]"
        if group.count < 0:
            problems.append(f"{where}.count {group.count} is negative; use 1 or more")
        if group.gpus and group.kind in (group.KIND_CPU, group.KIND_MODEL):
            kind = group.Kind.Name(group.kind)
            problems.append(f"{where}.gpus is set but kind is {kind}; use KIND_GPU or drop gpus")
    return problems


def _tensor_problems(cfg: ModelConfig, field: str) -> list[str]:
    problems = []
    seen: set[str] = set()
    for i, tensor in enumerate(getattr(cfg, field)):
        where = f"{field}[{i}]"
        if not tensor.name:
            problems.append(f"{where}.name is empty; name every {field}")
        elif tensor.name in seen:
            problems.append(f"{where}.name {tensor.name!r} is used twice; names must differ")
        seen.add(tensor.name)
        if tensor.data_type == model_config_pb2.TYPE_INVALID:
            problems.append(f"{where} ({tensor.name}) has no data_type; set one, e.g. TYPE_FP32")
        if not tensor.dims and not tensor.HasField("reshape"):
            problems.append(f"{where} ({tensor.name}) has no dims; give its shape, e.g. [1]")
        problems += [
            f"{where}.dims has {d}; each dim is -1 (any) or above 0"
            for d in tensor.dims
            if d == 0 or d < -1
        ]
    return problems


def apply_edits(
    cfg: ModelConfig,
    *,
    max_batch_size: int | None = None,
    dynamic_batching: bool | None = None,
    preferred_batch_size: Iterable[int] | None = None,
    max_queue_delay_microseconds: int | None = None,
    instance_count: int | None = None,
    instance_kind: str | None = None,
    parameters: Mapping[str, str | None] | None = None,
) -> ModelConfig:
    """A copy of ``cfg`` with the given fields changed (``None`` leaves a field as it is).

    ``dynamic_batching=False`` removes dynamic batching; ``preferred_batch_size`` or
    ``max_queue_delay_microseconds`` turn it on. ``instance_count`` and ``instance_kind`` apply to
    every instance group (one is created if there is none). A parameter set to ``None`` is removed.
    """
    new = ModelConfig()
    new.CopyFrom(cfg)
    if max_batch_size is not None:
        new.max_batch_size = _int("max_batch_size", max_batch_size, minimum=0)
    _edit_batching(new, dynamic_batching, preferred_batch_size, max_queue_delay_microseconds)
    _edit_instances(new, instance_count, instance_kind)
    for key, value in (parameters or {}).items():
        if value is None:
            new.parameters.pop(key, None)
        else:
            new.parameters[key].string_value = str(value)
    return new


def _edit_batching(
    new: ModelConfig,
    dynamic_batching: bool | None,
    preferred_batch_size: Iterable[int] | None,
    max_queue_delay_microseconds: int | None,
) -> None:
    batching_fields = preferred_batch_size is not None or max_queue_delay_microseconds is not None
    if dynamic_batching is False and batching_fields:
        raise ConfigError(
            "dynamic_batching=False conflicts with preferred_batch_size / "
            "max_queue_delay_microseconds; drop one or the other"
        )
    if dynamic_batching is False:
        new.ClearField("dynamic_batching")
    elif dynamic_batching or batching_fields:
        new.dynamic_batching.SetInParent()
    if preferred_batch_size is not None:
        sizes = [_int("preferred_batch_size", s, minimum=1) for s in preferred_batch_size]
        del new.dynamic_batching.preferred_batch_size[:]
        new.dynamic_batching.preferred_batch_size.extend(sizes)
    if max_queue_delay_microseconds is not None:
        delay = _int("max_queue_delay_microseconds", max_queue_delay_microseconds, minimum=0)
        new.dynamic_batching.max_queue_delay_microseconds = delay


def _edit_instances(
    new: ModelConfig, instance_count: int | None, instance_kind: str | None
) -> None:
    if instance_count is not None or instance_kind is not None:
        if not new.instance_group:
            new.instance_group.add(count=1)
        for group in new.instance_group:
            if instance_count is not None:
                group.count = _int("instance_count", instance_count, minimum=1)
            if instance_kind is not None:
                group.kind = _kind(instance_kind)


def _int(field: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _kind(kind: str) -> int:
    key = str(kind).upper()
    key = key if key.startswith("KIND_") else f"KIND_{key}"
    if key not in KINDS:
        raise ConfigError(f"instance_kind {kind!r} is not one of {', '.join(KINDS)}")
    return model_config_pb2.ModelInstanceGroup.Kind.Value(key)
