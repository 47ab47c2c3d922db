"""What a notebook needs, in one place: its run folder, its copy of the model repository, its
server, the code it shows and the figures it records.

Each notebook makes its server with :func:`start_server` (or :func:`serving`, which stops it
after), so every notebook's server binds free loopback ports, keeps its log in the run folder and
is stopped with the kernel.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
from pathlib import Path

from labkit import proc
from labkit.errors import ConfigError, LabkitError, MissingFileError
from labkit.lessons.takeaway import Takeaway
from labkit.report import FIGURES_FILE, TAKEAWAY_FILE
from labkit.repository import apply_edits, full_model, prepare_run_repository, read_config
from labkit.runs import run_folder
from labkit.server import (
    TritonServer,
    index,
    reload,
    serve_streaming_twin,
    served_config,
    serving,
    start_server,
)
from labkit.server.image import build_command as image_build_command
from labkit.server.image import compare_with_tutorial as image_beside_tutorial


def show_warnings_in_notebooks() -> None:
    """In a Jupyter kernel, print labkit's warnings as ordinary output (``labkit: ...``).

    Without a handler Python would write them to stderr, which a notebook shows as a red box
    that reads like a failure. Called when this module is imported; harmless outside a kernel.
    """
    if "ipykernel" not in sys.modules:
        return
    logger = logging.getLogger("labkit")
    if any(getattr(h, "labkit_notebook", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("labkit: %(message)s"))
    handler.labkit_notebook = True
    logger.addHandler(handler)


show_warnings_in_notebooks()

#: What a notebook needs, from one module: its run folder, its repository copy and its edits, its
#: server and live changes to it, the code it shows and the figures it records.
__all__ = [
    "apply_edits",
    "describe_repository",
    "expect_error",
    "full_model",
    "image_beside_tutorial",
    "image_build_command",
    "index",
    "labkit_command",
    "prepare_run_repository",
    "read_config",
    "record",
    "reload",
    "run_folder",
    "serve_streaming_twin",
    "served_config",
    "serving",
    "show_code",
    "show_table",
    "start_server",
    "startup_lines",
    "takeaway",
]


def describe_repository(repository: str | os.PathLike, models: list[str] | None = None) -> str:
    """A tree of the repository's model folders (only ``models`` when given), as the tutorial
    shows it (weights excluded)."""
    root = Path(repository)
    lines = [f"{root.name}/"]
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if models is not None and model_dir.name not in models:
            continue
        lines.append(f"  {model_dir.name}/")
        for item in sorted(model_dir.rglob("*")):
            if "__pycache__" in item.parts or item.is_dir() and not item.is_symlink():
                continue
            rel = item.relative_to(model_dir)
            shown = f"{rel} -> {os.readlink(item)}" if item.is_symlink() else str(rel)
            lines.append(f"    {shown}")
    return "\n".join(lines)


def show_code(path: str | os.PathLike, *names: str) -> str:
    """The source of the named functions or methods (``TritonPythonModel.execute``) in a file.

    The file is parsed, not imported: a model's ``model.py`` imports the server's
    ``triton_python_backend_utils``, which only exists inside Triton.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"no file {str(path)!r} to show code from")
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    shown = []
    for name in names:
        node = _find(tree, name.split("."))
        if node is None:
            raise ConfigError(f"{str(path)!r} defines no {name!r}; check the name")
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        lines = text.splitlines()[start - 1 : node.end_lineno]
        shown.append(f"# {path.name}, lines {start}-{node.end_lineno}\n" + "\n".join(lines))
    return "\n\n".join(shown)


def _find(tree: ast.AST, parts: list[str]) -> ast.AST | None:
    for node in getattr(tree, "body", []):
        defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, defines) and node.name == parts[0]:
            return node if len(parts) == 1 else _find(node, parts[1:])
    return None


def expect_error(call, *args: object, **kwargs: object) -> LabkitError:
    """Call ``call`` and return the :class:`LabkitError` it raised; no error is an AssertionError.

    For a notebook cell that shows a refusal: the lesson is the error, so its absence fails.
    """
    try:
        call(*args, **kwargs)
    except LabkitError as error:
        return error
    raise AssertionError(f"{getattr(call, '__name__', call)} raised no error for {args!r}")


def record(run_dir: str | os.PathLike, **figures: object) -> dict:
    """Write a notebook's headline figures to ``<run_dir>/figures.json`` (merged with earlier ones).

    ``labkit run`` shows them in its summary table and in ``index.html``. Numbers are rounded to
    4 significant digits; every value must be JSON (a number, a string, a bool, a list).
    """
    path = Path(run_dir) / FIGURES_FILE
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    for name, value in figures.items():
        if hasattr(value, "as_figure"):
            value = value.as_figure()
        if isinstance(value, float):
            value = float(f"{value:.4g}")
        recorded[name] = value
    # In the order the notebook recorded them, its headline first: the index shows them so.
    text = json.dumps(recorded, indent=2)  # refuses what JSON cannot hold
    path.write_text(text + "\n", encoding="utf-8")
    return recorded


def labkit_command(*args: str, timeout_s: float = 3600.0) -> str:
    """Run the ``labkit`` command (``python -m labkit.cli`` of this kernel's Python) and return what it
    printed; a failure raises :class:`~labkit.errors.ToolError` with what it said.
    ``labkit_command("image", "build", "--dry-run")`` prints the build without running it."""
    return proc.run([sys.executable, "-m", "labkit.cli", *args], timeout_s=timeout_s).stdout


def takeaway(run_dir: str | os.PathLike, what) -> Takeaway:
    """A notebook's last word: show it, and keep it in ``<run_dir>/takeaway.json`` for the index.

    ``what`` is a lesson's :class:`~labkit.lessons.Conclusion` (its takeaway), a
    :class:`~labkit.lessons.Takeaway`, or one to three lines.
    """
    said = Takeaway.of(what)
    path = Path(run_dir) / TAKEAWAY_FILE
    path.write_text(json.dumps(list(said.lines), indent=2) + "\n", encoding="utf-8")
    return said


#: Lines a CPU-only host logs at start: the GPU monitors find no GPU, and Triton carries on.
NO_GPU_NOISE = ("Failed to initialize NVML", "DCGM", "Unable to get power limit", "GPU metrics")


def startup_lines(server: TritonServer) -> str:
    """The lines of the server's log that say it is up (``Started ...``), as the tutorial shows
    them, and a word on the NVML/DCGM errors a host without a GPU logs (they are harmless)."""
    if not server.log_path or not Path(server.log_path).is_file():
        raise MissingFileError(f"{server!r} keeps no log here (a remote server's log is remote)")
    lines = Path(server.log_path).read_text(encoding="utf-8", errors="replace").splitlines()
    started = [line for line in lines if "Started " in line]
    noise = [line for line in lines if any(n in line for n in NO_GPU_NOISE)]
    text = "\n".join(started)
    if noise:
        text += (
            f"\n\n({len(noise)} log line(s) about NVML/DCGM and GPU metrics are left out: "
            "without an NVIDIA GPU Triton cannot start its GPU monitors, says so, and serves "
            "on the CPU. They are harmless here.)"
        )
    return text


def show_table(frame):
    """A DataFrame as a notebook shows it best for text: every cell whole (pandas cuts at 50
    characters by default), left-aligned, no index, and numbers as they were rounded (a styled
    table otherwise pads every float to 6 decimals: ``10.100000``), and text as text (escaped,
    so ``/v2/models/<model>/generate`` shows whole)."""
    left = [{"selector": "th", "props": [("text-align", "left")]}]
    floats = frame.select_dtypes("float").columns
    others = [c for c in frame.columns if c not in set(floats)]
    return (
        frame.style.hide(axis="index")
        .format(_number, subset=list(floats))
        .format(escape="html", subset=others)  # a cell's "<model>" is text, not a tag
        .set_properties(**{"text-align": "left", "white-space": "pre-wrap"})
        .set_table_styles(left)
    )


def _number(value: float) -> str:
    """A float as it reads: its own digits (up to 6 significant), whole from a million up."""
    if value != value:  # NaN: not measured
        return ""
    return f"{value:.0f}" if abs(value) >= 1e6 else f"{value:.6g}"
