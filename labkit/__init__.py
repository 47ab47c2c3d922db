"""triton-labkit: the helpers behind the lab's notebooks.

The notebooks import the modules they use, at most five each (``from labkit import lab,
llm_serving, widgets``); :data:`__all__` lists the modules the notebooks use, which are labkit's
public surface. Importing this package loads none of them, and no model library.

- ``lab``: what every notebook needs (its run folder, repository copy, server, live changes, code
  to show, figures to record);
- ``client``, ``streaming``, ``widgets``: talk to a model (one answer, tokens as they come, a
  prompt box);
- ``profiling``, ``plots``, ``lessons``: measure a served model, chart it, say what it shows;
- ``exercises``: the learner's turn at a notebook's end, checked on the live server;
- ``capacity``, ``embedding``, ``llm_serving``, ``cluster``, ``deploy``, ``hardware``, ``neuron``,
  ``doctor``, ``pipeline``: one notebook's subject each.

Dependencies point one way, from the top layer down; ``tests/test_layers.py`` holds them:

1. base: ``errors``, ``settings``, ``proc``, ``runs``;
2. what the host has and what a model repository holds: ``hardware``, ``repository/``;
3. the server: ``server/`` (find, run, a server for a run, live control);
4. talking to a server and measuring it: ``client``, ``streaming``, ``load``, ``embedding``,
   ``profiling/``, ``capacity``, ``neuron/``, ``cluster/``, ``deploy/``;
5. the lab around it: ``lab``, ``headless``, ``report``, ``widgets``, ``plots``, ``lessons``,
   ``doctor``, ``bench``, ``llm_serving/``, ``soak``, ``pipeline``, ``gpu_check/``, ``exercises/``;
6. the command line: ``cli/``, which nothing imports.

A module imports only from its own layer or below, and no import cycle exists.
"""

import logging

__all__ = [
    "capacity",
    "client",
    "cluster",
    "deploy",
    "doctor",
    "embedding",
    "exercises",
    "hardware",
    "lab",
    "lessons",
    "llm_serving",
    "neuron",
    "pipeline",
    "plots",
    "profiling",
    "streaming",
    "widgets",
]

# A library logs and lets its user decide what to show (the CLI configures logging; notebooks get
# labkit's warnings as ordinary output, see labkit.lab).
logging.getLogger("labkit").addHandler(logging.NullHandler())
