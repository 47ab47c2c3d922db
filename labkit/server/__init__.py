"""The Triton server: find it, run it, and change what it serves while it runs.

- :mod:`.locate`: find a ``tritonserver`` and arrange its Python backend (the bundled wheel's);
- :mod:`.process`: :class:`TritonServer`, one object per server process group (start, wait for
  every endpoint, stop, logs with tokens redacted);
- :mod:`.live`: live control through Triton's repository API (index, reload, unload, the
  Python stubs, recover a model whose stub died).
"""

from .live import index, recover, reload, restart, served_config, stubs, unhealthy, unload
from .locate import ServerBinary, locate_tritonserver
from .process import MODES, TritonServer

__all__ = [
    "MODES",
    "ServerBinary",
    "TritonServer",
    "index",
    "locate_tritonserver",
    "recover",
    "reload",
    "restart",
    "served_config",
    "stubs",
    "unhealthy",
    "unload",
]
