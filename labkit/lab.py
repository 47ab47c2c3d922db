"""Notebook glue: a run's own copy of the model repository, with the model it needs, ready to serve."""

from __future__ import annotations

import os
from pathlib import Path

from .models import add_model, catalog, prepare_repository
from .repository import Repository
from .runner import copy_model_repository


def prepare_run_repository(
    run_dir: str | os.PathLike,
    models: list[str] | None = None,
    source: str | os.PathLike | None = None,
    **overrides: object,
) -> Path:
    """Copy the lab's repository into ``run_dir``, add catalog models it lacks, build local weights.

    ``models`` names folders of the repository or catalog entries (``falcon7b``, ``opt125m``...);
    a name the repository lacks is added from the catalog with ``overrides`` (for example
    ``max_batch_size=8``). Returns the copy's path; the lab's own files are never touched.
    """
    repo = copy_model_repository(run_dir, source)
    present = set(Repository(repo).models())
    known = {entry.name for entry in catalog()}
    for name in models or []:
        if name not in present:
            if name not in known:
                raise_unknown(name, present, known)
            add_model(repo, name, **overrides)
    prepare_repository(repo)
    return repo


def raise_unknown(name: str, present: set[str], known: set[str]) -> None:
    from .errors import ConfigError  # noqa: PLC0415

    raise ConfigError(
        f"model {name!r} is neither in the model repository ({', '.join(sorted(present))}) nor in "
        f"the catalog ({', '.join(sorted(known))}); pick one of those"
    )


def describe_repository(repository: str | os.PathLike) -> str:
    """A tree of the repository's model folders, as the tutorial shows it (weights excluded)."""
    root = Path(repository)
    lines = [f"{root.name}/"]
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        lines.append(f"  {model_dir.name}/")
        for item in sorted(model_dir.rglob("*")):
            if "__pycache__" in item.parts or item.is_dir() and not item.is_symlink():
                continue
            rel = item.relative_to(model_dir)
            shown = f"{rel} -> {os.readlink(item)}" if item.is_symlink() else str(rel)
            lines.append(f"    {shown}")
    return "\n".join(lines)
