"""``labkit run``: run lab notebooks headless (papermill) into a run folder."""

from __future__ import annotations

from labkit import headless


def register(sub) -> None:
    p = sub.add_parser("run", help="run lab notebooks headless (papermill) into a run folder")
    p.add_argument(
        "notebooks",
        nargs="*",
        metavar="NOTEBOOK",
        help="notebook path, name or prefix (default: every notebook in notebooks/)",
    )
    p.add_argument("--out", help="run folder (default: runs/<timestamp>)")
    p.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="set a notebook parameter (YAML-typed value)",
    )
    p.add_argument("--params", metavar="FILE.yaml", help="a YAML mapping of parameters")
    p.add_argument(
        "--solutions",
        action="store_true",
        help="put each exercise's reference solution in (SOLUTIONS=True); a failing check stops "
        "its notebook",
    )
    p.add_argument("--kernel", help="Jupyter kernel name (default: python3, this Python)")
    p.add_argument(
        "--cell-timeout",
        type=float,
        metavar="SECONDS",
        help="fail a notebook whose cell runs longer than this",
    )
    p.add_argument(
        "--stop-on-failure",
        action="store_true",
        help="do not run the notebooks after a failing one",
    )
    p.set_defaults(handler=_cli)


def _cli(args) -> int:
    params = headless.parse_parameters(args.parameter, args.params)
    if args.solutions:
        params[headless.SOLUTIONS_PARAMETER] = True
    report = headless.run_notebooks(
        args.notebooks,
        args.out,
        params,
        kernel_name=args.kernel,
        cell_timeout_s=args.cell_timeout,
        stop_on_failure=args.stop_on_failure,
    )
    print(report.table())
    print(f"\nrun folder: {report.run_dir}\nindex: {report.index}")
    return 0 if report.ok else 1
