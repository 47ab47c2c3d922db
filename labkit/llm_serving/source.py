"""The lab's in-flight engine as a learner reads it: one function of the served model's own
``inflight.py``, taken from the model folder a run serves (never a copy that could drift)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from labkit.errors import ConfigError, MissingFileError
from labkit.repository import Repository


def engine_code(
    repository: str | os.PathLike | Repository,
    model: str = "smollm2_inflight",
    name: str = "InflightEngine._admit",
    *,
    module: str = "inflight.py",
    version: str = "1",
) -> str:
    """The source of ``name`` (a function, or ``Class.method``) in ``model``'s ``module``."""
    repo = repository if isinstance(repository, Repository) else Repository(repository)
    path = Path(repo.model_dir(model)) / version / module
    if not path.is_file():
        raise MissingFileError(f"{model} has no {version}/{module} in {repo.path}")
    text = path.read_text(encoding="utf-8")
    scope: list[ast.stmt] = ast.parse(text).body
    node = None
    for part in name.split("."):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == part
            ),
            None,
        )
        if node is None:
            raise ConfigError(f"{path} defines no {name!r}")
        scope = node.body
    lines = text.splitlines()[node.lineno - 1 : node.end_lineno]
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)
