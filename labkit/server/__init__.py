"""The Triton server: find it, run it, and change what it serves while it runs.

- :mod:`.locate`: find a ``tritonserver`` and arrange its Python backend (the bundled wheel's);
- :mod:`.process`: :class:`TritonServer`, one object per server process group (start, wait for
  every endpoint, stop, logs with tokens redacted);
- :mod:`.image`: the docker mode's image (the ``docker build`` of ``docker/Dockerfile``, and the
  check that an image exists and imports transformers);
- :mod:`.session`: a server for one run (free ports, its log in the run folder, warm models),
  started or as a ``with`` block (:func:`serving`);
- :mod:`.live`: live control through Triton's repository API (index, reload, unload, the
  Python stubs, recover a model whose stub died).
"""

from .image import ImageInfo, inspect_image, require_image
from .live import (
    index,
    recover,
    reload,
    restart,
    serve_streaming_twin,
    served_config,
    stubs,
    unhealthy,
    warm_up,
)
from .locate import ServerBinary, locate_tritonserver
from .process import MODES, TritonServer
from .session import serving, start_server

__all__ = [
    "MODES",
    "ImageInfo",
    "ServerBinary",
    "TritonServer",
    "index",
    "inspect_image",
    "locate_tritonserver",
    "recover",
    "reload",
    "require_image",
    "restart",
    "serve_streaming_twin",
    "served_config",
    "serving",
    "start_server",
    "stubs",
    "unhealthy",
    "warm_up",
]
