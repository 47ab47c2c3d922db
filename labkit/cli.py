"""The ``labkit`` command. Each module that offers subcommands defines ``register_cli(subparsers)``.

A subcommand's handler takes the parsed ``argparse.Namespace`` and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import LabkitError

# Modules that contribute subcommands, in the order `labkit --help` lists them.
COMMAND_MODULES = [
    "labkit.server_cli",
    "labkit.runner",
    "labkit.repository",
    "labkit.models",
    "labkit.profiling",
    "labkit.analyzer",
    "labkit.bench",
    "labkit.soak",
    "labkit.neuron",
    "labkit.doctor",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labkit",
        description="triton-labkit: serve Hugging Face transformers on Triton, and the lab around it",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that part of the lab is not installed in this checkout
                continue
            raise
        register = getattr(module, "register_cli", None)
        if register:
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
