"""triton-labkit: the helpers behind the lab's notebooks."""

from .errors import LabkitError
from .server import TritonServer, locate_tritonserver

__all__ = ["LabkitError", "TritonServer", "locate_tritonserver"]
