"""The ``labkit`` command: the only argparse code, and the only module that prints.

Each module of this package adds its subcommands with ``register(subparsers)``; a handler takes
the parsed ``argparse.Namespace`` and returns an exit code. Nothing outside ``labkit.cli``
imports it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from labkit.cli import (
    bench,
    deploy,
    doctor,
    gpu,
    image,
    models,
    neuron,
    rehearse,
    run,
    serve,
)
from labkit.errors import LabkitError

#: ``labkit --help`` lists the subcommands in this order.
REGISTRARS = [
    serve.register,
    run.register,
    models.register,
    models.register_prepare,
    bench.register,
    neuron.register,
    deploy.register,
    rehearse.register,
    doctor.register,
    image.register,
    gpu.register,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labkit",
        description="triton-labkit: serve Hugging Face transformers on Triton, and the lab around it",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args) or 0)
    except LabkitError as exc:
        print(f"labkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
