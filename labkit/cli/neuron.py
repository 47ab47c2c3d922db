"""``labkit neuron``: ``detect``, ``compile`` and ``gen-model`` (upstream gen_triton_model.py's options)."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from labkit.errors import ConfigError, MissingFileError
from labkit.hardware import detect_neuron
from labkit.neuron import compiler
from labkit.neuron.compiler import TARGETS
from labkit.neuron.gen import MODEL_TYPES, GenOptions, TensorSpec, generate_model


def register(sub) -> None:
    p = sub.add_parser("neuron", help="AWS Inferentia/Trainium: detect, compile, generate models")
    nsub = p.add_subparsers(dest="neuron_command", metavar="SUBCOMMAND", required=True)
    d = nsub.add_parser("detect", help="report the Neuron hardware of this host")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(handler=_detect_command)
    c = nsub.add_parser(
        "compile", help="trace a saved module (torch.save / TorchScript) for a target"
    )
    c.add_argument("model", help="a TorchScript file or a torch.save'd nn.Module")
    c.add_argument(
        "--example",
        action="append",
        required=True,
        help="example input DTYPE:SHAPE, e.g. int64:1x128; repeat per input, in order",
    )
    c.add_argument(
        "--target", choices=TARGETS, default=None, help="default: this host's (cpu if none)"
    )
    c.add_argument("--compiler-args", default="", help="arguments for neuron-cc / neuronx-cc")
    c.add_argument("--compiler-workdir", default=None)
    c.add_argument("--dynamic-batch-size", action="store_true")
    c.add_argument("--output", default=None, help="copy the artifact here too")
    c.set_defaults(handler=_compile_command)
    g = nsub.add_parser("gen-model", help="write a Triton model (gen_triton_model.py's options)")
    add_gen_arguments(g)
    g.set_defaults(handler=gen_model_command)


def _detect_command(args) -> int:
    hw = detect_neuron()
    print(json.dumps({**asdict(hw), "target": hw.target}) if args.json else str(hw))
    return 0


def _compile_command(args) -> int:
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

    source = Path(args.model)
    if not source.is_file():
        raise MissingFileError(f"model file {str(source)!r} does not exist")
    try:
        model = compiler.load(source)
    except RuntimeError:
        model = torch.load(str(source), weights_only=False)
    examples = []
    for spec in args.example:
        dtype, _, shape = spec.partition(":")
        try:
            dims = [int(d) for d in shape.split("x")]
            examples.append(torch.zeros(dims, dtype=getattr(torch, dtype)))
        except (ValueError, AttributeError, TypeError):
            raise ConfigError(f"--example {spec!r} is not DTYPE:SHAPE, e.g. int64:1x128") from None
    target = args.target or detect_neuron().target
    made = compiler.compile(
        model,
        examples,
        target,
        compiler_args=args.compiler_args.split(),
        compiler_workdir=args.compiler_workdir,
        dynamic_batch_size=args.dynamic_batch_size,
    )
    if args.output:
        shutil.copy2(made.path, args.output)
    print(f"{made.path} ({target}, {'cached' if made.cached else 'compiled'})")
    return 0


def add_gen_arguments(p: argparse.ArgumentParser) -> None:
    """The options of upstream ``gen_triton_model.py``, same names, plus ``--target``."""
    t = p.add_mutually_exclusive_group()
    t.add_argument(
        "--target",
        choices=TARGETS,
        default=None,
        help="where the model runs: inf1 (torch-neuron), inf2/trn1 (torch-neuronx), "
        "or cpu (torch.jit, for development and CI). Default inf1, as upstream",
    )
    t.add_argument("--inf2", action="store_true", help="same as --target inf2 (upstream flag)")
    t.add_argument("--cpu", action="store_true", help="same as --target cpu")
    p.add_argument(
        "--model_type",
        choices=MODEL_TYPES,
        default="pytorch",
        help="the compiled model's kind (default pytorch)",
    )
    p.add_argument(
        "--triton_input",
        action="append",
        nargs="*",
        default=[],
        help="NAME,DATATYPE,SHAPE, e.g. INPUT__0,INT64,4x384; repeatable; names "
        "<name>__<index> for pytorch; optional for tensorflow",
    )
    p.add_argument(
        "--triton_output",
        action="append",
        nargs="*",
        default=[],
        help="NAME,DATATYPE,SHAPE, e.g. OUTPUT__0,FP32,4x384; repeatable",
    )
    p.add_argument(
        "--compiled_model",
        required=True,
        help="the compiled TorchScript file or SavedModel dir (relative paths are "
        "read from the triton model directory)",
    )
    p.add_argument(
        "--neuron_core_range",
        required=True,
        help="cores <start>:<end>, inclusive, split equally between instances: with "
        "4 instances 0:7 gives 0-1, 2-3, 4-5, 6-7",
    )
    p.add_argument(
        "--triton_model_instance_count",
        type=int,
        default=1,
        help="number of Triton model instances (default 1)",
    )
    p.add_argument(
        "--threads_per_core",
        type=int,
        default=1,
        help="threads per Neuron core; an instance runs cores x this many",
    )
    p.add_argument(
        "--enable_dynamic_batching",
        action="store_true",
        help="let Triton batch requests (needs --max_batch_size >= 1)",
    )
    p.add_argument(
        "--max_batch_size",
        type=int,
        default=0,
        help="largest batch Triton sends; 0 means the model has no batch dimension",
    )
    p.add_argument(
        "--preferred_batch_size",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes the dynamic batcher aims for; best a multiple of the cores per instance",
    )
    p.add_argument(
        "--max_queue_delay_microseconds",
        type=int,
        default=None,
        help="how long, in microseconds, a request may wait for a batch to fill",
    )
    p.add_argument(
        "--disable_batch_requests_to_neuron",
        action="store_true",
        help="call the model once per request instead of once per batch",
    )
    p.add_argument("--tag_set", default="serve", help="SavedModel tag set (tensorflow only)")
    p.add_argument(
        "--signature_def_key",
        default="serving_default",
        help="SavedModel signature (tensorflow only)",
    )
    p.add_argument(
        "--triton_model_dir",
        required=True,
        help="the model directory to write; its name is the model's name",
    )
    p.add_argument("--model_version", type=int, default=1, help="version directory (default 1)")
    p.add_argument(
        "--copy_compiled_model",
        action="store_true",
        help="copy the compiled model into the version directory",
    )


def options_from_args(args: argparse.Namespace) -> GenOptions:
    target = args.target or ("inf2" if args.inf2 else "cpu" if args.cpu else "inf1")
    flat = lambda groups: [TensorSpec.parse(s) for group in groups for s in group]  # noqa: E731
    return GenOptions(
        triton_model_dir=args.triton_model_dir,
        compiled_model=args.compiled_model,
        neuron_core_range=args.neuron_core_range,
        target=target,
        model_type=args.model_type,
        inputs=flat(args.triton_input),
        outputs=flat(args.triton_output),
        triton_model_instance_count=args.triton_model_instance_count,
        threads_per_core=args.threads_per_core,
        enable_dynamic_batching=args.enable_dynamic_batching,
        max_batch_size=args.max_batch_size,
        preferred_batch_size=args.preferred_batch_size,
        max_queue_delay_microseconds=args.max_queue_delay_microseconds,
        disable_batch_requests_to_neuron=args.disable_batch_requests_to_neuron,
        tag_set=args.tag_set,
        signature_def_key=args.signature_def_key,
        model_version=args.model_version,
        copy_compiled_model=args.copy_compiled_model,
    )


def gen_model_command(args: argparse.Namespace) -> int:
    made = generate_model(options_from_args(args))
    print(
        f"wrote {made.path}/config.pbtxt and {made.path}/{made.config.version_policy.specific.versions[0]}/model.py"
    )
    for i in range(len(made.cores.ranges)):
        print(f"  instance {i}: NEURON_RT_VISIBLE_CORES={made.cores.visible_cores(i)}")
    return 0
