"""``labkit serve``: run a Triton server in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import threading

from labkit.repository import models_to_serve, prepare_repository
from labkit.server import TritonServer


def register(sub) -> None:
    p = sub.add_parser("serve", help="run a Triton server in the foreground until Ctrl+C")
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--mode", choices=["local", "docker"], default=None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to expose it)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--load-model", action="append", help="model to load (default: all)")
    p.add_argument("--tritonserver", help="path of a tritonserver executable")
    p.add_argument("--log-file", help="write the server's log here")
    p.add_argument(
        "--cache-size",
        type=int,
        help="turn on Triton's response cache with this many bytes (models opt in with "
        "response_cache { enable: true } in config.pbtxt)",
    )
    p.set_defaults(handler=serve)


def serve(args) -> int:
    prepare_repository(args.model_repository)
    server = TritonServer(
        args.model_repository,
        mode=args.mode,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        load_models=args.load_model or models_to_serve(args.model_repository),
        tritonserver=args.tritonserver,
        log_path=args.log_file,
        cache_size=args.cache_size,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        print(
            f"Triton is ready. HTTP: http://{server.http_url}  gRPC: {server.grpc_url}  "
            f"metrics: {server.metrics_url}",
            flush=True,
        )
        print(f"server log: {server.log_path}   (Ctrl+C to stop)", flush=True)
        stop.wait()
    print("Triton stopped.", flush=True)
    return 0
