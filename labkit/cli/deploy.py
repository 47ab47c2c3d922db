"""``labkit deploy k8s``: Kubernetes manifests for a model repository, validated offline;
``labkit cluster``: replicas of a repository behind HAProxy, in the foreground until Ctrl+C."""

from __future__ import annotations

import signal
import threading
from dataclasses import replace

from labkit.cluster import Cluster
from labkit.deploy import DeploySettings, ngc_image, validate_manifests, write_manifests
from labkit.repository import prepare_repository


def register(sub) -> None:
    parser = sub.add_parser("deploy", help="the model repository beyond this machine (Kubernetes)")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    d = DeploySettings()
    p = targets.add_parser(
        "k8s",
        help="write Kubernetes manifests (Deployment, Service, HPA) or a KServe InferenceService",
    )
    p.add_argument("--model-repository", default="model_repository", help="the repository to serve")
    p.add_argument("--out", required=True, help="folder for the manifests")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME",
        help="a model to deploy, with the models its pipeline calls (repeatable; default: every "
        "model the image can run)",
    )
    accelerator = p.add_mutually_exclusive_group()
    accelerator.add_argument("--gpu", action="store_true", help="request nvidia.com/gpu")
    accelerator.add_argument("--neuron", action="store_true", help="request aws.amazon.com/neuron")
    p.add_argument("--kserve", action="store_true", help="a KServe InferenceService instead")
    image = p.add_mutually_exclusive_group()
    image.add_argument("--image", default=d.image, help="server image (default: %(default)s)")
    image.add_argument("--ngc", action="store_true", help="NGC's tritonserver image instead")
    p.add_argument("--name", default=d.name)
    p.add_argument("--namespace")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--max-replicas", type=int, default=d.max_replicas)
    p.add_argument("--queue-target-us", type=int, default=d.queue_target_us, help="HPA target")
    p.add_argument("--hf-secret", default=d.hf_secret, help="Secret holding HF_TOKEN (by name)")
    p.add_argument(
        "--cache-size",
        type=int,
        help="bytes of Triton's response cache (default: none, or 256 MiB when a model of the "
        "repository enables response_cache)",
    )
    p.add_argument("--validate", action="store_true", help="validate the files offline after")
    p.set_defaults(handler=_cli_k8s)

    p = sub.add_parser("cluster", help="replicas of a repository behind HAProxy until Ctrl+C")
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--load-model", action="append", help="model to load (default: all)")
    p.add_argument("--http-port", type=int, default=8000, help="the balancer's HTTP port")
    p.add_argument("--grpc-port", type=int, default=8001, help="the balancer's gRPC port")
    p.add_argument("--run-dir", help="logs and HAProxy's configuration (default: a temp folder)")
    p.set_defaults(handler=_cli_cluster)


def _cli_k8s(args) -> int:
    accelerator = "gpu" if args.gpu else "neuron" if args.neuron else "cpu"
    settings = replace(
        DeploySettings(),
        name=args.name,
        namespace=args.namespace,
        accelerator=accelerator,
        kserve=args.kserve,
        image=ngc_image() if args.ngc else args.image,
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        queue_target_us=args.queue_target_us,
        hf_secret=args.hf_secret,
        cache_size=args.cache_size,
        models=tuple(args.model),
    )
    for path in write_manifests(args.model_repository, args.out, settings):
        print(path)
    if not args.validate:
        return 0
    report = validate_manifests(args.out)
    print(report[["file", "kind", "validator", "passed"]].to_string(index=False))
    for row in report[~report["passed"]].itertuples():
        print(f"\n{row.file}:\n{row.message}")
    return 0 if report["passed"].all() else 1


def _cli_cluster(args) -> int:
    prepare_repository(args.model_repository)
    cluster = Cluster(
        args.model_repository,
        args.replicas,
        load_models=args.load_model or "*",
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        run_dir=args.run_dir,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        print(
            f"{args.replicas} replicas behind HAProxy. HTTP: http://{cluster.http_url}  "
            f"gRPC: {cluster.grpc_url}  stats: {cluster.stats_url}",
            flush=True,
        )
        print(cluster.pool().to_string(index=False), flush=True)
        print(f"logs: {cluster.run_dir}   (Ctrl+C to stop)", flush=True)
        stop.wait()
    print("cluster stopped.", flush=True)
    return 0
