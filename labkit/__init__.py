"""triton-labkit: the helpers behind the lab's notebooks.

The notebooks import the modules they use (``from labkit import client, lab, runner``); this
module re-exports the few names every notebook touches. Importing it loads no model library.

Dependencies point one way, from the top layer down; ``tests/test_layers.py`` holds them:

1. base: ``errors``, ``settings``, ``proc``;
2. what the host has and what a model repository holds: ``hardware``, ``repository/``;
3. the server: ``server/`` (find, run, live control);
4. talking to a server and measuring it: ``client``, ``streaming``, ``embedding``,
   ``profiling/``, ``capacity``, ``neuron/``;
5. the lab around it: ``lab``, ``runner``, ``report``, ``widgets``, ``plots``, ``doctor``,
   ``bench``, ``soak``;
6. the command line: ``cli/``, which nothing imports.

A module imports only from its own layer or below, and no import cycle exists.
"""

import logging

from labkit.errors import LabkitError
from labkit.repository import Repository
from labkit.server import TritonServer, locate_tritonserver

__all__ = ["LabkitError", "Repository", "TritonServer", "locate_tritonserver"]

# A library logs and lets its user decide what to show (the CLI configures logging; notebooks get
# labkit's warnings as ordinary output, see labkit.lab).
logging.getLogger("labkit").addHandler(logging.NullHandler())
