"""``labkit models list|show|edit|add|remove|lora``, ``labkit prepare`` and ``labkit catalog``."""

from __future__ import annotations

import argparse
import os

from labkit.capacity import estimate
from labkit.errors import ConfigError
from labkit.llm_serving import warm
from labkit.repository import KINDS, Repository, catalog, config_to_text, prepare_repository
from labkit.repository.lora import serve_adapters
from labkit.server import TritonServer, index, reload
from labkit.settings import vllm_cache_root


def register(sub) -> None:
    models = sub.add_parser(
        "models", help="list, add, remove, show or edit the repository's models"
    )
    verbs = models.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, summary: str, handler) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=summary)
        p.add_argument(
            "--model-repository", default="model_repository", help="the model repository"
        )
        p.set_defaults(handler=handler)
        return p

    p = verb("list", "the models, their versions and batching settings", list_models)
    p.add_argument("--url", help="a running server (host:port) whose model states to show")
    p = verb("show", "print a model's config.pbtxt", show_model)
    p.add_argument("name")
    p = verb("edit", "change a model's config.pbtxt (validated; prints the diff)", edit_model)
    p.add_argument("name")
    p.add_argument("--max-batch-size", type=int)
    batching = p.add_mutually_exclusive_group()
    batching.add_argument(
        "--dynamic-batching", dest="dynamic_batching", action="store_true", default=None
    )
    batching.add_argument("--no-dynamic-batching", dest="dynamic_batching", action="store_false")
    p.add_argument("--preferred-batch-size", type=int, nargs="+", metavar="N")
    p.add_argument("--max-queue-delay-microseconds", type=int, dest="max_queue_delay_microseconds")
    p.add_argument("--instance-count", type=int)
    p.add_argument("--instance-kind", choices=KINDS)
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a parameter (repeatable)",
    )
    p.add_argument("--unset-param", action="append", default=[], metavar="KEY")
    p.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    p.add_argument("--reload", metavar="HOST:PORT", help="then reload it on this running server")
    p = verb("add", "add a model from the catalog, a local folder or a Hub id", add_model)
    p.add_argument("name")
    p.add_argument("source", help="catalog name, model folder, or Hub id (org/name)")
    p.add_argument("--template", choices=["textgen", "embedding"])
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p = verb("remove", "delete a model folder", remove_model)
    p.add_argument("name")
    p = verb("lora", "make a vLLM model serve LoRA adapters, built offline with peft", serve_lora)
    p.add_argument("name", help="a vLLM model of the repository, e.g. smollm2_vllm")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=BUILDER",
        help="an adapter requests call NAME, made by BUILDER (default: demo=smollm2-lora)",
    )


def _params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"--param {pair!r} is not KEY=VALUE; write e.g. --param max_tokens=32"
            )
        out[key] = value
    return out


def list_models(args) -> int:
    repo = Repository(args.model_repository)
    states = {}
    if args.url:
        server = TritonServer(repo.path, mode="remote", url=args.url)
        states = {
            row.name: f"{row.state} {row.reason}".strip() for row in index(server).itertuples()
        }
    print(f"{'model':<20} {'versions':<9} {'batch':>5}  {'dynamic':<8} {'instances':<12} state")
    for name in repo.models():
        try:
            cfg = repo.config(name)
            versions = ",".join(map(str, repo.versions(name)))
        except Exception as exc:  # noqa: BLE001 (a broken model is listed, not fatal)
            print(f"{name:<20} error: {exc}")
            continue
        groups = " ".join(
            f"{g.count or 1}x{g.Kind.Name(g.kind).removeprefix('KIND_')}"
            for g in cfg.instance_group
        )
        dynamic = "yes" if cfg.HasField("dynamic_batching") else "no"
        print(
            f"{name:<20} {versions:<9} {cfg.max_batch_size:>5}  {dynamic:<8} {groups or '-':<12} "
            f"{states.get(name, '')}"
        )
    return 0


def show_model(args) -> int:
    print(config_to_text(Repository(args.model_repository).config(args.name)), end="")
    return 0


def edit_model(args) -> int:
    repo = Repository(args.model_repository)
    params: dict[str, str | None] = dict(_params(args.param))
    params.update({key: None for key in args.unset_param})
    change = repo.edit(
        args.name,
        dry_run=args.dry_run,
        max_batch_size=args.max_batch_size,
        dynamic_batching=args.dynamic_batching,
        preferred_batch_size=args.preferred_batch_size,
        max_queue_delay_microseconds=args.max_queue_delay_microseconds,
        instance_count=args.instance_count,
        instance_kind=args.instance_kind,
        parameters=params or None,
    )
    print(change or f"{args.name}: no change", end="" if change else "\n")
    if args.reload and not args.dry_run:
        reload(TritonServer(repo.path, mode="remote", url=args.reload), args.name, repository=repo)
        print(f"reloaded {args.name} on {args.reload}")
    return 0


def add_model(args) -> int:
    folder = Repository(args.model_repository).add(
        args.name, args.source, template=args.template, **_params(args.param)
    )
    print(f"added {args.name} at {folder}")
    return 0


def remove_model(args) -> int:
    Repository(args.model_repository).remove(args.name)
    print(f"removed {args.name}")
    return 0


def serve_lora(args) -> int:
    adapters = {}
    for pair in args.adapter:
        name, sep, builder = pair.partition("=")
        if not sep or not name or not builder:
            raise ConfigError(
                f"--adapter {pair!r} is not NAME=BUILDER; write e.g. demo=smollm2-lora"
            )
        adapters[name] = builder
    built = serve_adapters(args.model_repository, args.name, adapters or None)
    for name, folder in built.items():
        print(f"{args.name} serves LoRA adapter {name!r}: {folder}")
    first = next(iter(built))
    print(
        f'ask it with the request parameter "lora_name": "{first}" (or in sampling_parameters); '
        "load or reload the model for the change to take effect"
    )
    return 0


def register_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="build the offline weights the repository's models use")
    p.add_argument("--model-repository", default="model_repository", help="the model repository")
    p.add_argument(
        "--warm-vllm",
        action="store_true",
        help="also fill vLLM's compile cache for smollm2_vllm in float32 and bfloat16 (about 2 "
        "minutes each on 2 cores, once: make install runs it)",
    )
    p.set_defaults(handler=prepare)
    c = sub.add_parser("catalog", help="list the models the lab can add")
    c.set_defaults(handler=list_catalog)


def prepare(args) -> int:
    for link in prepare_repository(args.model_repository):
        print(f"{link} -> {os.path.realpath(link)}")
    if args.warm_vllm:
        print(f"vLLM's compile cache ({vllm_cache_root()}): smollm2_vllm in "
              f"{', '.join(warm.DTYPES)}, compiled where not done yet", flush=True)  # fmt: skip
        for done in warm.warm(args.model_repository):
            how = "already there" if done.seconds is None else f"compiled in {done.seconds:.0f} s"
            print(f"  {done.dtype}: {how}")
    return 0


def list_catalog(args) -> int:
    for e in catalog():
        where = "offline" if e.labkit_weights else e.huggingface_model
        size = estimate(e.name, device="gpu").weights_bytes / 2**30
        print(f"{e.name:12} {where:28} ~{size:6.1f} GiB fp16  {e.description}")
    return 0
