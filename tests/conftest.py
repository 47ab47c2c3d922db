"""Shared fixtures. Every server a test starts is stopped, even when the test fails."""

from __future__ import annotations

import os

import pytest

from labkit.server import TritonServer

# No test may reach a model hub: everything runs from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def start_server(tmp_path):
    """Factory: ``start_server(repo, **kwargs)`` starts a real Triton on free loopback ports."""
    started: list[TritonServer] = []

    def _start(repository, **kwargs) -> TritonServer:
        kwargs.setdefault("http_port", 0)
        kwargs.setdefault("grpc_port", 0)
        kwargs.setdefault("metrics_port", 0)
        kwargs.setdefault("startup_timeout_s", 240)
        kwargs.setdefault("log_path", tmp_path / f"tritonserver-{len(started)}.log")
        server = TritonServer(repository, **kwargs)
        started.append(server)
        return server.start()

    yield _start
    for server in started:
        server.stop()
