"""``labkit gpu bundle | show``: the GPU check's bundle (built here) and its result (from there)."""

from __future__ import annotations

import json
from pathlib import Path

from labkit import gpu_check
from labkit.gpu_check import remote


def register(sub) -> None:
    parser = sub.add_parser("gpu", help="the self-contained GPU check: build its bundle, read it")
    kinds = parser.add_subparsers(dest="gpu", metavar="ACTION", required=True)
    p = kinds.add_parser("bundle", help="build what a bare GPU machine needs, at most 60 MiB")
    p.add_argument("dir", nargs="?", help="bundle folder (default: runs/gpu-bundle)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (default: 3.12)")
    p.add_argument("--bench-seconds", type=float, default=20.0, help="each benchmark's window")
    p.set_defaults(handler=_cli_bundle)
    p = kinds.add_parser("show", help="summarise a gpu-check.json that came back")
    p.add_argument("json", help="the gpu-check.json file")
    p.set_defaults(handler=_cli_show)


def _cli_bundle(args) -> int:
    info = gpu_check.build_bundle(args.dir, python=args.python, bench_seconds=args.bench_seconds)
    for name, size in info.files.items():
        print(f"{size / 2**20:8.1f} MiB  {name}")
    print(
        f"{info.total_bytes / 2**20:8.1f} MiB  in {info.path} "
        f"(limit {gpu_check.SIZE_LIMIT_BYTES / 2**20:.0f} MiB)"
    )
    where = _relative(info.path)
    print(
        "\non the GPU machine, from the checkout's root with this folder carried along:\n"
        f'  bash scripts/gpu-check.sh --run {where} --out "$OUT"'
    )
    return 0


def _cli_show(args) -> int:
    result = json.loads(Path(args.json).read_text())
    print(remote.summary(result))
    return {"passed": 0, "not_run": 3}.get(result.get("status"), 1)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
