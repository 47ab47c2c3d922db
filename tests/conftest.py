"""Shared fixtures. Every server a test starts is stopped, even when the test fails."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

from labkit.server import TritonServer

#: A Python-backend model config with one string input and one string output, no batching.
TEXT_MODEL_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "text_input" data_type: TYPE_STRING dims: [-1] }]
output [{ name: "text_output" data_type: TYPE_STRING dims: [-1] }]
"""


def write_python_model(repo, name, model_py, config=TEXT_MODEL_CONFIG):
    """Write ``repo/name/config.pbtxt`` and ``repo/name/1/model.py``."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py))


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


@contextlib.contextmanager
def imported_as_triton_does(version_dir: Path, module: str = "model"):
    """``version_dir/<module>.py`` imported the way the Python backend's stub imports model.py.

    The stub puts the model's folder on ``sys.path`` and imports ``<version>.model``: the version
    folder is a package, so the model's ``from . import ...`` finds its siblings. The server's own
    ``triton_python_backend_utils`` comes from the bundled backend. No ``__pycache__`` is left
    in the folder (a template's would be packaged).
    """
    import pytriton

    backend = str(Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python")
    package = version_dir.name
    saved_path, saved_bytecode = list(sys.path), sys.dont_write_bytecode
    sys.path[:0] = [str(version_dir.parent), backend]
    sys.dont_write_bytecode = True
    try:
        yield importlib.import_module(f"{package}.{module}")
    finally:
        sys.path[:], sys.dont_write_bytecode = saved_path, saved_bytecode
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]
