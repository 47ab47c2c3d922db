"""``labkit image base | build | check``: the docker mode's image (the tutorial's step 2), and
the CPU stand-in for NGC's image that it can be built on where no registry is reachable."""

from __future__ import annotations

import shlex

from labkit.server import base_image, image
from labkit.settings import TRITON_RELEASE, triton_image


def register(sub) -> None:
    parser = sub.add_parser("image", help="build or check the docker mode's Triton image")
    kinds = parser.add_subparsers(dest="image", metavar="ACTION", required=True)
    p = kinds.add_parser("build", help="docker build the lab's image from docker/Dockerfile")
    p.add_argument("--tag", help="image tag (default: the docker mode's default image)")
    p.add_argument(
        "--release", default=TRITON_RELEASE, help="NGC tritonserver release (default: %(default)s)"
    )
    p.add_argument(
        "--day-zero",
        metavar="REF",
        help="the tutorial's Day Zero variant: transformers from source at this git ref (main)",
    )
    p.add_argument("--torch-index-url", help="pip index of the torch CUDA build to install")
    p.add_argument(
        "--base",
        metavar="IMAGE",
        help="build FROM this image instead of NGC's, e.g. the CPU stand-in "
        f"{base_image.BASE_IMAGE} (labkit image base); the tag then ends in the base's tag",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.set_defaults(handler=_cli_build)
    p = kinds.add_parser(
        "base", help="build the CPU stand-in for NGC's tritonserver image (needs root, Docker)"
    )
    p.add_argument("--tag", default=base_image.BASE_IMAGE, help="(default: %(default)s)")
    p.set_defaults(handler=_cli_base)
    p = kinds.add_parser("check", help="check that an image exists and imports transformers")
    p.add_argument("--tag", help="image to check (default: the docker mode's image)")
    p.set_defaults(handler=_cli_check)


def _cli_build(args) -> int:
    command = image.build_command(
        args.tag,
        release=args.release,
        day_zero=args.day_zero,
        torch_index_url=args.torch_index_url,
        base=args.base,
    )
    print(shlex.join(command), flush=True)
    if not args.dry_run:
        image.build(command)
        print(f"built {command[command.index('-t') + 1]}")
    return 0


def _cli_check(args) -> int:
    info = image.require_image(args.tag or triton_image())
    cuda = f"CUDA {info.torch_cuda}" if info.torch_cuda else "a CPU-only build"
    print(
        f"{info.image} ({info.id[:19]}): Python {info.python}, numpy {info.numpy}, "
        f"torch {info.torch} ({cuda}), transformers {info.transformers}"
    )
    return 0


def _cli_base(args) -> int:
    print(f"building {args.tag}: debootstrap of Debian {base_image.SUITE}, then Triton 2.51 from "
          "the nvidia-pytriton wheel (about 2 minutes)", flush=True)  # fmt: skip
    print(f"built {base_image.build_base(args.tag)}")
    return 0
