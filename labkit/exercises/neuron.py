"""Notebook 05's exercise: split a host's NeuronCores across two model instances with the
generator's flags.

The learner gives the ``labkit neuron gen-model`` flags of the split (``--neuron_core_range`` and
``--triton_model_instance_count``) for the notebook's ``INSTANCE_TYPE``. The check reads the two
flags as the command line spells them and runs the generator on the guide's add_sub command with
them, twice: the folder made for inf2 (its ``config.pbtxt``: the instance count and the range each
instance takes, judged against the host's NeuronCores), and the same folder for this host's target,
loaded on the live server. Each instance's ``model.py`` logs the ``NEURON_RT_VISIBLE_CORES`` it
set; the check reads those lines from the server's log, sends one request, then unloads the model.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from labkit.errors import ConfigError, ServerError
from labkit.exercises.check import Check, Exercise, failed, passed, register
from labkit.neuron.gen import GenOptions, TensorSpec, assign_cores, generate_model
from labkit.neuron.vllm import INSTANCE_CORES
from labkit.repository import read_config
from labkit.server import reload, served_config

KEY = "05-split-cores"
TITLE = "Two instances, each on its own NeuronCores"
TODO = (
    "MY_FLAGS: the labkit neuron gen-model flags that split the host's NeuronCores across two "
    'instances, as text (e.g. "--neuron_core_range A:B --triton_model_instance_count N").'
)
#: The served model's name; the inf2 folder has the same.
MODEL = "add_sub_split"
#: The guide's add_sub command (notebook 05 shows it whole), less the split the learner gives:
#: two INT64 inputs and outputs of 4, dynamic batching up to 8.
GUIDE = dict(
    inputs=[TensorSpec(f"INPUT__{i}", "INT64", (4,)) for i in range(2)],
    outputs=[TensorSpec(f"OUTPUT__{i}", "INT64", (4,)) for i in range(2)],
    enable_dynamic_batching=True,
    max_batch_size=8,
)
_INSTANCE_LINE = re.compile(
    rf"{MODEL}_(?P<group>\d+)_(?P<index>\d+): target (?P<target>\S+), Neuron cores (?P<cores>[\d-]+)"
)


class _Parser(argparse.ArgumentParser):
    """The split's two flags, spelled and typed as ``labkit neuron gen-model`` takes them; it
    raises instead of exiting (a check never ends the kernel)."""

    def __init__(self) -> None:
        super().__init__(prog="labkit neuron gen-model", add_help=False, allow_abbrev=False)
        self.add_argument("--neuron_core_range", required=True)
        self.add_argument("--triton_model_instance_count", type=int, default=1)

    def error(self, message: str):
        raise ConfigError(message)


def gen_options(flags: str | list[str], *, target: str, compiled_model: str, model_dir: Path):
    """The generator's options for the guide's add_sub command with the split ``flags`` give."""
    mine = shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags]
    split = _Parser().parse_args(mine)
    return GenOptions(
        model_dir,
        compiled_model,
        target=target,
        neuron_core_range=split.neuron_core_range,
        triton_model_instance_count=split.triton_model_instance_count,
        **GUIDE,
    )


def host_cores(instance_type: str, neuron_hardware=None) -> tuple[str, int]:
    """``(what the host is, its NeuronCores)``: the device's own count on a Neuron host, else the
    count of ``instance_type`` (the host the folders are written for)."""
    if neuron_hardware is not None and neuron_hardware.present:
        return str(neuron_hardware), neuron_hardware.cores
    if instance_type not in INSTANCE_CORES:
        raise ConfigError(
            f"instance type {instance_type!r} is not one of {', '.join(INSTANCE_CORES)}; set "
            "INSTANCE_TYPE to the Neuron host the folders are for"
        )
    return instance_type, INSTANCE_CORES[instance_type]


def check_split(
    flags: Any,
    *,
    server=None,
    compiled,
    run_dir,
    instance_type: str = "inf2.xlarge",
    neuron_hardware=None,
) -> Check:
    """Judge the split ``flags`` give on the host, then serve the split on the live server."""
    if not isinstance(flags, str | list | tuple):
        return failed(
            TITLE,
            f"MY_FLAGS = {flags!r}",
            "the flags as text, as typed after labkit neuron gen-model",
            'write them in quotes: "--neuron_core_range A:B --triton_model_instance_count N".',
        )
    host, cores = host_cores(instance_type, neuron_hardware)
    target = compiled.target if compiled.target != "cpu" else "inf2"
    # a Neuron-compiled artifact is copied in; for a cpu one, the folder names the file that
    # `labkit neuron compile --target inf2` makes on the device host, as the notebook's inf2
    # folders do: an inf2 config never points at the CPU stand-in
    copy = compiled.target != "cpu"
    artifact = str(compiled.path) if copy else f"1/add_sub.{target}.pt"
    folder = Path(run_dir) / "exercise" / target / MODEL
    try:
        opts = gen_options(flags, target=target, compiled_model=artifact, model_dir=folder)
        opts.copy_compiled_model, opts.compiled_elsewhere = copy, not copy
        made = generate_model(opts)
    except ConfigError as exc:
        return failed(
            TITLE,
            f"the generator refused the flags {flags!r}: {exc}",
            f"a split of {host}'s {cores} NeuronCores between 2 instances",
            "give only --neuron_core_range (first:last, both included) and "
            "--triton_model_instance_count: the check adds the guide's tensors, target and folder.",
        )
    split = _split_in(read_config(folder / "config.pbtxt"))
    wrong = _judge(split, host, cores, made.warnings)
    if wrong:
        return wrong
    said = (
        f"the folder made for {target} has {len(split)} instances on NeuronCores "
        f"{' and '.join(split)} of {host}'s {cores} (each sets NEURON_RT_VISIBLE_CORES to its own)"
    )
    if server is None or not getattr(server, "running", True):
        return passed(TITLE, said + "; no live server to load it on (it was stopped).")
    return _served(server, compiled, flags, split, said)


def _split_in(config) -> list[str]:
    """Each instance's NeuronCores (``"0"``, ``"2-3"``) as the generated ``config.pbtxt`` gives
    them: its instance count and core range, split as the generator's ``model.py`` splits them."""
    count = sum(g.count or 1 for g in config.instance_group)
    start = int(config.parameters["NEURON_CORE_START_INDEX"].string_value)
    end = int(config.parameters["NEURON_CORE_END_INDEX"].string_value)
    assigned = assign_cores(start, end, count)
    return [assigned.visible_cores(i) for i in range(count)]


def _cores_of(visible: str) -> set[int]:
    first, _, last = visible.partition("-")
    return set(range(int(first), int(last or first) + 1))


def _judge(split: list[str], host: str, cores: int, warnings: list[str]) -> Check | None:
    """A failed Check for a split that is not two instances on disjoint cores of the host."""
    expected = f"2 instances, each on its own NeuronCores among {host}'s {cores} (0 to {cores - 1})"
    seen = f"{len(split)} instance(s) on NeuronCores {', '.join(split)}"
    if len(split) != 2:
        return failed(
            TITLE,
            seen,
            expected,
            "--triton_model_instance_count sets how many instances share the range; make it 2.",
        )
    beyond = sorted(c for v in split for c in _cores_of(v) if c >= cores)
    if beyond:
        return failed(
            TITLE,
            f"{seen}: NeuronCore(s) {', '.join(map(str, beyond))} do not exist on {host}",
            expected,
            f"{host} has {cores} NeuronCores, numbered from 0; the range's end is included.",
        )
    first, second = (_cores_of(v) for v in split)
    if first & second:
        return failed(
            TITLE,
            f"{seen}: they share NeuronCore(s) {', '.join(map(str, sorted(first & second)))}",
            expected,
            "two instances on one NeuronCore take turns on it; give each its own.",
        )
    if warnings:
        return failed(
            TITLE,
            f"{seen}; the generator warned: {' '.join(warnings)}",
            expected,
            "choose a range whose core count the instance count divides.",
        )
    return None


def _served(server, compiled, flags, split: list[str], said: str) -> Check:
    """Write the split for this host's target into the server's repository, load it, read each
    instance's cores from the server's log, ask it once, and unload it again."""
    import numpy as np  # noqa: PLC0415 (only a served check sends tensors)

    folder = Path(server.model_repository) / MODEL
    opts = gen_options(
        flags, target=compiled.target, compiled_model=str(compiled.path), model_dir=folder
    )
    opts.copy_compiled_model = True
    generate_model(opts)
    start = server.log_path.stat().st_size if server.log_path else 0
    try:
        reload(server, MODEL, warm=False)  # the one request below is the check's own
        served = served_config(server, MODEL)
        instances = sum(int(g.get("count", 1)) for g in served.get("instance_group", []))
        a, b = np.array([[5, 7, 9, 11]]), np.array([[1, 2, 3, 4]])
        plus, minus = _ask(server, a, b)
        logged = _logged_instances(server, start)
    finally:
        _remove(server, folder)
    seen_cores = sorted(set(logged.values()))
    where = f"target {compiled.target}"
    if instances != 2 or sorted(logged.values()) != sorted(split) or len(seen_cores) != 2:
        return failed(
            TITLE,
            f"the server reports {instances} instance(s) of {MODEL}; their model.py logged "
            f"NEURON_RT_VISIBLE_CORES {', '.join(f'{k}: {v}' for k, v in logged.items()) or 'none'}",
            f"2 instances that set {' and '.join(split)}",
            "read the server log's lines for add_sub_split: each instance names the cores it set.",
        )
    if not (np.array_equal(plus, a + b) and np.array_equal(minus, a - b)):
        return failed(
            TITLE,
            f"the split model answered {plus.tolist()} and {minus.tolist()}",
            f"the sum {(a + b).tolist()} and the difference {(a - b).tolist()}",
            "the served folder is not the guide's add_sub; run the notebook from section 2 again.",
        )
    return passed(
        TITLE,
        f"{said}. Served here ({where}): the server reports 2 instances, which set "
        f"NEURON_RT_VISIBLE_CORES={' and '.join(f'{v} ({k})' for k, v in logged.items())}, and "
        "answered a request; the model was then unloaded.",
    )


def _ask(server, a, b):
    """The split model's two answers to one request of ``a`` and ``b``."""
    import tritonclient.http as httpclient  # noqa: PLC0415 (the HTTP client's network stack)

    tensors = []
    for name, value in (("INPUT__0", a), ("INPUT__1", b)):
        tensors.append(httpclient.InferInput(name, list(value.shape), "INT64"))
        tensors[-1].set_data_from_numpy(value)
    with server.client() as client:
        result = client.infer(MODEL, tensors)
    return result.as_numpy("OUTPUT__0"), result.as_numpy("OUTPUT__1")


def _logged_instances(server, start: int) -> dict[str, str]:
    """``{instance name: NEURON_RT_VISIBLE_CORES}`` from the lines the instances logged since
    ``start`` (a byte offset of the server's log)."""
    if not server.log_path:
        return {}
    with open(server.log_path, "rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", "replace")
    found = {
        f"{MODEL}_{m['group']}_{m['index']}": m["cores"] for m in _INSTANCE_LINE.finditer(text)
    }
    return dict(sorted(found.items()))


def _remove(server, folder: Path) -> None:
    """Unload the exercise's model (if loaded) and delete its folder: the server is left as the
    notebook had it."""
    try:
        server.unload_model(MODEL)
    except ServerError:
        pass  # never loaded: nothing to unload
    shutil.rmtree(folder, ignore_errors=True)


def solve_split(*, instance_type: str = "inf2.xlarge", neuron_hardware=None, **_: Any) -> str:
    """The reference flags: every NeuronCore of the host, split between 2 instances."""
    _, cores = host_cores(instance_type, neuron_hardware)
    return f"--neuron_core_range 0:{cores - 1} --triton_model_instance_count 2"


register(Exercise(KEY, TITLE, TODO, check_split, solve_split))
