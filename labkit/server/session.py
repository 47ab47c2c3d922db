"""A server for one run: free loopback ports, its log in the run folder, its models warm.

:func:`start_server` returns a started server (a notebook keeps it across cells and stops it
when done); :func:`serving` is the same as a ``with`` block that stops it after, for benchmarks
and tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .live import warm_up
from .process import TritonServer


def start_server(
    run_dir: str | os.PathLike,
    repository: str | os.PathLike,
    models: list[str] | str = "*",
    *,
    mode: str | None = None,
    url: str | None = None,
    http_port: int = 0,
    grpc_port: int = 0,
    metrics_port: int = 0,
    warm: bool = True,
    **options: object,
) -> TritonServer:
    """Start (or attach to) a Triton server on ``repository`` and return it once ready and warm.

    Ports default to free ones (the tutorial's are 8000, 8001 and 8002); the server's log is
    ``<run_dir>/tritonserver.log``; ``options`` go to :class:`~labkit.server.TritonServer`.
    Every loaded model is warmed up (:func:`~labkit.server.live.warm_up`) unless ``warm=False``;
    when a warm-up fails, the server is stopped before the error goes on.
    """
    server = TritonServer(
        repository,
        mode=mode,
        url=url or None,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        load_models=models,
        log_path=Path(run_dir) / "tritonserver.log",
        **options,
    )
    server.start()
    if warm:
        try:
            for row in server.model_index():
                if row.get("state") == "READY":
                    warm_up(server, row["name"])
        except BaseException:  # a model that fails its first request: no server left behind
            server.stop()
            raise
    return server


@contextlib.contextmanager
def serving(
    run_dir: str | os.PathLike,
    repository: str | os.PathLike,
    models: list[str] | str = "*",
    **options: object,
) -> Iterator[TritonServer]:
    """:func:`start_server` for a ``with`` block: the server is stopped when the block ends,
    however it ends."""
    server = start_server(run_dir, repository, models, **options)
    try:
        yield server
    finally:
        server.stop()
