"""``labkit rehearse``: run the pod of written Kubernetes or KServe manifests in Docker, with the
kubelet's probes, and say whether it became ready and answered."""

from __future__ import annotations

from labkit.deploy.rehearsal import rehearse


def register(sub) -> None:
    p = sub.add_parser(
        "rehearse",
        help="run the pod of `labkit deploy k8s` manifests in Docker, probed as the kubelet does",
    )
    p.add_argument(
        "--manifests",
        required=True,
        help="a folder `labkit deploy k8s --out` wrote (plain or KServe)",
    )
    p.add_argument(
        "--model-repository", required=True, help="the repository the manifests were written for"
    )
    p.add_argument(
        "--image",
        help="run this image instead of the manifests' (default: theirs when this host has it, "
        "else the lab's image on the CPU stand-in)",
    )
    p.add_argument(
        "--kill-stub",
        action="store_true",
        help="once ready, kill a Python stub: readiness must turn off and liveness restart it",
    )
    p.add_argument("--model", help="the model to ask (default: the first deployed text model)")
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="bound of the whole rehearsal (seconds)"
    )
    p.set_defaults(handler=_cli_rehearse)


def _cli_rehearse(args) -> int:
    result = rehearse(
        args.manifests,
        args.model_repository,
        image=args.image,
        kill_stub=args.kill_stub,
        model=args.model,
        timeout_s=args.timeout_s,
    )
    print(result.table().to_string(index=False))
    print()
    print(result)
    return 0 if result.passed else 1
