"""``labkit serve``: run a Triton server in the foreground until SIGINT or SIGTERM.

``--mode docker`` runs it in a container of ``--image`` (default: ``LABKIT_TRITON_IMAGE``, else
the lab's built image); without ``--load-model`` it loads every model the image can run and says
which it leaves out (a model whose stub needs one of this checkout's environments, such as
``smollm2_vllm`` in an image without vLLM). Ctrl+C or SIGTERM while the server starts stops it,
and its container, as it does once it is ready.

``--openai`` (docker mode) runs Triton's OpenAI-compatible frontend from the NGC image instead of
``tritonserver``; without ``--load-model`` it loads the models that take the frontend's tensors.
"""

from __future__ import annotations

import argparse
import signal
import threading

from labkit.errors import ConfigError
from labkit.repository import models_to_serve, prepare_repository
from labkit.server import TritonServer
from labkit.server.frontend import DEFAULT_OPENAI_PORT, frontend_models


def _port(text: str) -> int:
    """A TCP port for argparse: 0..65535 (0 picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535, 0: a free one)")
    return port


def register(sub) -> None:
    p = sub.add_parser("serve", help="run a Triton server in the foreground until Ctrl+C")
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--mode", choices=["local", "docker"], default=None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to expose it)")
    p.add_argument("--http-port", type=_port, default=8000)
    p.add_argument("--grpc-port", type=_port, default=8001)
    p.add_argument("--metrics-port", type=_port, default=8002)
    p.add_argument("--load-model", action="append", help="model to load (default: all)")
    p.add_argument("--tritonserver", help="path of a tritonserver executable")
    p.add_argument(
        "--image",
        help="docker mode: the server's image (default: LABKIT_TRITON_IMAGE, else the lab's "
        "image that `labkit image build` builds)",
    )
    p.add_argument(
        "--gpus",
        choices=["auto", "all", "none"],
        default="auto",
        help="docker mode: pass --gpus all (auto: where a GPU and Docker's NVIDIA runtime exist)",
    )
    p.add_argument("--log-file", help="write the server's log here")
    p.add_argument(
        "--cache-size",
        type=int,
        help="turn on Triton's response cache with this many bytes (models opt in with "
        "response_cache { enable: true } in config.pbtxt)",
    )
    p.add_argument(
        "--openai",
        action="store_true",
        help="docker mode: run Triton's OpenAI-compatible frontend (the NGC image's "
        "python/openai) instead of tritonserver, with KServe HTTP/gRPC on the ports above",
    )
    p.add_argument(
        "--openai-port",
        type=_port,
        default=None,
        help=f"the OpenAI API's port with --openai (default {DEFAULT_OPENAI_PORT}, the frontend's)",
    )
    p.set_defaults(handler=serve)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _openai_port(args) -> int | None:
    if not args.openai:
        return None
    return DEFAULT_OPENAI_PORT if args.openai_port is None else args.openai_port


def serve(args) -> int:
    if args.openai_port is not None and not args.openai:
        raise ConfigError(f"--openai-port {args.openai_port} needs --openai")
    load = args.load_model or models_to_serve(args.model_repository)
    if args.openai and not args.load_model:  # only what the frontend can drive
        load = frontend_models(args.model_repository, load) or load  # none: refused, with why
    server = TritonServer(
        args.model_repository,
        mode=args.mode,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        load_models=load,
        tritonserver=args.tritonserver,
        log_path=args.log_file,
        cache_size=args.cache_size,
        openai_port=_openai_port(args),
        image=args.image,
        gpus={"auto": None, "all": True, "none": False}[args.gpus],
    )
    if not args.load_model:  # every model the image can run; a named one is refused with why
        for model, why in server.image_refuses().items():
            print(f"not loading {why}", flush=True)
            server.load_models.remove(model)
    prepare_repository(args.model_repository)  # after the checks above: a refusal builds nothing
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(server)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _serve(server: TritonServer) -> int:
    """Run ``server`` until SIGINT or SIGTERM. Either one while it starts interrupts the start
    (KeyboardInterrupt), which stops what it began: its container, in docker mode."""
    signal.signal(signal.SIGTERM, _interrupt)
    with server:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        if server.openai_url:
            print(
                f"Triton's OpenAI frontend is ready. OpenAI: {server.openai_url}  "
                f"models: {', '.join(server.load_models)}",
                flush=True,
            )
        print(
            f"Triton is ready. HTTP: http://{server.http_url}  gRPC: {server.grpc_url}  "
            f"metrics: {server.metrics_url}",
            flush=True,
        )
        for model in server.container_configs():
            if model in server.load_models or "*" in server.load_models:
                print(
                    f"{model} runs on the image's own Python and its packages: the container "
                    "reads a copy of its config without EXECUTION_ENV_PATH (this checkout's "
                    "virtualenv, which the container neither mounts nor could run)",
                    flush=True,
                )
        print(f"server log: {server.log_path}   (Ctrl+C to stop)", flush=True)
        stop.wait()
    print("Triton stopped.", flush=True)
    return 0
