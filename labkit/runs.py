"""Run folders: where one notebook run, one ``labkit run`` or one benchmark keeps its files.

Every run gets a fresh folder under ``runs/`` (``LABKIT_RUNS``), so two runs never share ports'
logs, repository copies or figures, and nothing a run writes lands in the checkout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from pathlib import Path

from labkit.errors import ConfigError
from labkit.settings import runs_root


def _unique_dir(parent: Path, name: str) -> Path:
    """Create ``parent/name`` (or ``name-2``, ``name-3``... when taken) and return it."""
    parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        path = parent / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"could not create a fresh folder named {name!r} in {str(parent)!r}")


def _timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def run_folder(out: str | os.PathLike | None = None, notebook: str | None = None) -> Path:
    """The notebook's (or benchmark's) own run folder.

    When papermill passes one (the ``RUN_DIR`` parameter) it is used as is; otherwise (a notebook
    opened in Jupyter) a fresh ``runs/<timestamp>-<notebook>`` is created, so two runs never share
    files. ``notebook`` defaults to the name Jupyter gives the kernel (``JPY_SESSION_NAME``).
    """
    if out is not None:
        path = Path(out).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create run folder {str(path)!r}: {exc}") from exc
        return path.resolve()
    name = notebook or Path(os.environ.get("JPY_SESSION_NAME") or "notebook").stem
    return _unique_dir(runs_root(), f"{_timestamp()}-{name}").resolve()


def invocation_folder(out: str | os.PathLike | None = None) -> Path:
    """Create a ``labkit run``'s folder (``--out`` or ``runs/<timestamp>``) and prove it writable."""
    try:
        path = Path(out).expanduser() if out else _unique_dir(runs_root(), _timestamp())
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".labkit-write-check"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"run folder {str(out or runs_root())!r} cannot be written ({exc.strerror or exc}); "
            "pass --out a folder you can write, or set LABKIT_RUNS"
        ) from exc
    return path.resolve()


def write_result(run_dir: str | os.PathLike, name: str, result: object) -> Path:
    """Write a benchmark's result to ``<run_dir>/<name>.json`` and return the path.

    The one rule for every benchmark: the benchmark function writes its own figures into its run
    folder (a dataclass is written as its fields), and returns them; the command line prints the
    table and, given ``--json FILE``, writes the same figures there too.
    """
    data = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result
    path = Path(run_dir) / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path
