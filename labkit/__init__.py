"""triton-labkit: the helpers behind the lab's notebooks.

The notebooks import the submodules they use (``from labkit import client, lab, runner``); this
module re-exports the few names every notebook touches. Importing it loads no model library.
"""

from .errors import LabkitError
from .repository import Repository
from .server import TritonServer, locate_tritonserver

__all__ = ["LabkitError", "Repository", "TritonServer", "locate_tritonserver"]
