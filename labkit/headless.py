"""Execute the lab's notebooks headless with papermill, one run folder per invocation.

``labkit run [NOTEBOOK...] [--out DIR] [-p NAME VALUE]... [--params FILE.yaml]`` runs the named
notebooks (all of ``notebooks/`` in order when none is named) into ``runs/<timestamp>/``:

- ``<stem>.ipynb`` the executed notebook (saved even when a cell fails, with the error in it);
  each widget output also carries a text transcript of the widget's last state (a progress bar's
  final count, a prompt box's prompt and answer), see :func:`labkit.report.transcribe_widgets`,
- ``<stem>.html`` its nbconvert HTML, which renders offline (plots embed plotly.js, widgets show
  their transcript, nothing is loaded from the network), and ``index.html`` linking them with
  each notebook's recorded figures,
- ``<stem>/`` the notebook's own working folder (passed as the ``RUN_DIR`` parameter when the
  notebook declares it; the notebook gets it back from :func:`labkit.runs.run_folder`),
- ``summary.json`` the summary table that is also printed at the end.

Every input is checked before any notebook starts: unknown notebooks, parameters that no selected
notebook declares, a run folder that cannot be written, a kernel that is not this Python.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from labkit import runs, settings
from labkit.errors import ConfigError, MissingFileError
from labkit.report import (
    FIGURES_FILE,
    TAKEAWAY_FILE,
    NotebookResult,
    RunReport,
    purpose,
    to_html,
    write_index,
)
from labkit.settings import project_root
from labkit.shown import not_for_a_learner

log = logging.getLogger(__name__)

#: The parameter through which the runner hands a notebook its own working folder.
RUN_DIR_PARAMETER = "RUN_DIR"
#: The parameter ``labkit run --solutions`` sets: each exercise's reference solution is put in.
SOLUTIONS_PARAMETER = "SOLUTIONS"


# -- inputs -------------------------------------------------------------------------------------
def find_notebooks(
    names: Sequence[str] = (), directory: str | os.PathLike | None = None
) -> list[Path]:
    """Resolve notebook names (a path, a name in ``notebooks/`` with or without ``.ipynb``, or a
    unique prefix such as ``01``); with no names, every notebook in ``notebooks/`` in order."""
    folder = Path(directory) if directory else project_root() / "notebooks"
    available = sorted(folder.glob("*.ipynb")) if folder.is_dir() else []
    if not names:
        if not available:
            raise MissingFileError(f"no notebooks found in {str(folder)!r}; name one to run")
        return available
    found = []
    for name in names:
        path = Path(name).expanduser()
        candidates = [path, folder / name, folder / f"{name}.ipynb"]
        hit = next((c for c in candidates if c.is_file() and c.suffix == ".ipynb"), None)
        if hit is None:
            prefixed = [p for p in available if p.name.startswith(name)]
            hit = prefixed[0] if len(prefixed) == 1 else None
        if hit is None:
            listing = ", ".join(p.name for p in available) or "(none)"
            raise MissingFileError(
                f"notebook {name!r} does not exist; give a path or one of the notebooks in "
                f"{str(folder)!r}: {listing}"
            )
        found.append(hit.resolve())
    return found


def parse_value(text: str) -> Any:
    """A ``-p`` value, typed the way papermill types it: ``True``/``False``/``None``, ints and
    floats; also YAML's ``true``/``false``/``null``, flow lists/maps (``[1, 2]``) and quoted
    strings (``'8000'`` stays a string). Anything else is the string itself."""
    from papermill.iorw import NoDatesSafeLoader  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    special = {
        "True": True,
        "False": False,
        "None": None,
        "true": True,
        "false": False,
        "null": None,
    }
    if text in special:
        return special[text]
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    if text[:1] in ("[", "{", "'", '"'):
        try:
            return yaml.load(text, Loader=NoDatesSafeLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"cannot parse parameter value {text!r} as YAML: {exc}") from exc
    return text


def parse_parameters(
    pairs: Sequence[Sequence[str]] = (), params_file: str | os.PathLike | None = None
) -> dict[str, Any]:
    """Merge ``--params FILE.yaml`` (a mapping) and then ``-p NAME VALUE`` pairs (which win)."""
    from papermill.iorw import NoDatesSafeLoader  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    params: dict[str, Any] = {}
    if params_file:
        path = Path(params_file)
        if not path.is_file():
            raise MissingFileError(f"parameters file {str(path)!r} does not exist")
        try:
            loaded = yaml.load(path.read_text(), Loader=NoDatesSafeLoader) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"parameters file {str(path)!r} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"parameters file {str(path)!r} must hold a mapping of NAME: VALUE, "
                f"got a {type(loaded).__name__}"
            )
        params.update(loaded)
    for name, value in pairs:
        params[name] = parse_value(value)
    return params


def declared_parameters(notebook: str | os.PathLike) -> dict[str, Any]:
    """The parameters a notebook declares in its ``parameters`` cell, with their defaults."""
    import papermill  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    return {name: p["default"] for name, p in papermill.inspect_notebook(str(notebook)).items()}


def plan_parameters(
    notebooks: Sequence[Path], parameters: Mapping[str, Any]
) -> dict[Path, dict[str, Any]]:
    """Each notebook's parameters: those it declares. A parameter no notebook declares is an error
    naming what they do declare (papermill would only warn and run with the default)."""
    if RUN_DIR_PARAMETER in parameters:
        raise ConfigError(
            f"parameter {RUN_DIR_PARAMETER!r} is set by labkit run itself; use --out DIR instead"
        )
    declared = {nb: declared_parameters(nb) for nb in notebooks}
    unknown = [name for name in parameters if not any(name in d for d in declared.values())]
    if unknown:
        listing = "; ".join(
            f"{nb.name}: {', '.join(sorted(d)) or '(none)'}" for nb, d in declared.items()
        )
        raise ConfigError(
            f"parameter {', '.join(repr(u) for u in unknown)} is not declared by "
            f"{'the notebook' if len(notebooks) == 1 else 'any of the notebooks'}; "
            f"declared parameters are {listing}"
        )
    return {nb: {k: v for k, v in parameters.items() if k in d} for nb, d in declared.items()}


def check_kernel(kernel_name: str) -> str:
    """Return the Python the kernel runs; raise unless it is this environment's Python."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel as exc:
        raise ConfigError(
            f"Jupyter kernel {kernel_name!r} is not installed; use --kernel python3 or register "
            f"one with `{sys.executable} -m ipykernel install --sys-prefix --name {kernel_name}`"
        ) from exc
    program = spec.argv[0]
    # jupyter_client starts a kernel whose program is a bare python/python3 with sys.executable.
    if program in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return sys.executable
    if Path(program).parent.resolve() != Path(sys.executable).parent.resolve():
        raise ConfigError(
            f"Jupyter kernel {kernel_name!r} runs {program}, not this environment's Python "
            f"({sys.executable}), so the notebooks would miss its packages; run "
            f"`{sys.executable} -m ipykernel install --sys-prefix --name labkit` and pass "
            "--kernel labkit"
        )
    return program


#: Set in the kernel's environment for a headless run (an existing value wins). Plotly's own
#: mimetype alone cannot go into nbconvert HTML; its "notebook" renderer adds an HTML rendering
#: with plotly.js embedded, so the run's HTML shows the plots offline.
KERNEL_ENV = {"PLOTLY_RENDERER": "plotly_mimetype+notebook"}


@contextlib.contextmanager
def _kernel_environment() -> Iterator[None]:
    """The kernel inherits this process's environment: let it import this labkit even from a
    plain checkout (not installed), and render plots for HTML."""
    root = str(Path(__file__).resolve().parent.parent)
    before = dict(os.environ)
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *([pythonpath] if pythonpath else [])])
    for name, value in KERNEL_ENV.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


# -- running ------------------------------------------------------------------------------------
def run_notebooks(
    notebooks: Sequence[str | os.PathLike] = (),
    out: str | os.PathLike | None = None,
    parameters: Mapping[str, Any] | None = None,
    *,
    kernel_name: str | None = None,
    cell_timeout_s: float | None = None,
    stop_on_failure: bool = False,
    progress_bar: bool = True,
) -> RunReport:
    """Check every input, then execute each notebook into one run folder and write its index."""
    paths = find_notebooks([str(n) for n in notebooks])
    plan = plan_parameters(paths, dict(parameters or {}))
    kernel = settings.kernel_name(kernel_name)
    python = check_kernel(kernel)
    run_dir = runs.invocation_folder(out)
    log.info("run folder %s; kernel %r runs %s", run_dir, kernel, python)
    report = RunReport(run_dir)
    stems: set[str] = set()
    for path in paths:
        stem = path.stem if path.stem not in stems else f"{path.stem}-{len(stems) + 1}"
        stems.add(stem)
        params = dict(plan[path])
        if RUN_DIR_PARAMETER in declared_parameters(path):
            params[RUN_DIR_PARAMETER] = str(run_dir / stem)
        result = _execute(
            path, run_dir / f"{stem}.ipynb", params, kernel, cell_timeout_s, progress_bar
        )
        result.purpose = purpose(path)
        if RUN_DIR_PARAMETER in params:
            result.folder = params[RUN_DIR_PARAMETER]
            figures = Path(result.folder) / FIGURES_FILE
            if figures.is_file():
                result.figures = json.loads(figures.read_text())
            takeaway = Path(result.folder) / TAKEAWAY_FILE
            if takeaway.is_file():
                result.takeaway = json.loads(takeaway.read_text())
        report.results.append(result)
        if result.status != "ok" and stop_on_failure:
            break
    try:
        report.index = write_index(report)
        (run_dir / "summary.json").write_text(
            json.dumps([asdict(r) for r in report.results], indent=2) + "\n"
        )
    except OSError as exc:  # a disk that filled up, or went read-only, during the run
        done = ", ".join(f"{Path(r.notebook).name}: {r.status}" for r in report.results)
        raise ConfigError(
            f"cannot write the summary of run folder {str(run_dir)!r} "
            f"({exc.strerror or exc}); free space there or pass --out a folder on another disk. "
            f"Notebooks: {done}"
        ) from exc
    return report


def _execute(
    path: Path,
    output: Path,
    params: dict,
    kernel: str,
    cell_timeout_s: float | None,
    progress_bar: bool,
) -> NotebookResult:
    import papermill  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)
    from papermill.exceptions import PapermillExecutionError  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    result = NotebookResult(str(path), str(output), "ok", 0.0)
    log.info("running %s with %s", path.name, params or "its defaults")
    start = time.monotonic()
    try:
        with _kernel_environment():
            papermill.execute_notebook(
                str(path),
                str(output),
                parameters=params,
                kernel_name=kernel,
                cwd=str(path.parent),
                progress_bar=progress_bar,
                execution_timeout=cell_timeout_s,
            )
    except PapermillExecutionError as exc:
        result.status, result.cell = "failed", exc.cell_index
        result.source = next(iter(exc.source.strip().splitlines()), "")
        result.error = f"{exc.ename}: {exc.evalue}"
    except Exception as exc:  # noqa: BLE001 (a dead kernel or a timeout fails this notebook only)
        result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
        # a timeout or a dead kernel: the cell it happened in is the last one papermill began
        if output.is_file():
            result.cell, result.source = _last_started_cell(output)
    result.duration_s = round(time.monotonic() - start, 2)
    if result.cell is not None and output.is_file():
        result.cell = _error_cell(output, result.cell)
    if result.status != "ok":
        log.error(
            "%s failed at cell %s: %s (saved to %s)", path.name, result.cell, result.error, output
        )
    if result.status == "ok" and output.is_file():
        result.not_for_a_learner = _not_for_a_learner(output)
        for shown in result.not_for_a_learner:
            log.warning("%s showed what a lesson must not: %s", path.name, shown)
    if output.is_file():
        try:
            result.html = to_html(output)
        except OSError as exc:  # the executed notebook is there; its HTML did not fit
            result.status = "failed"
            result.error = f"cannot write {output.with_suffix('.html')}: {exc.strerror or exc}"
            log.error("%s: %s", path.name, result.error)
    return result


def _not_for_a_learner(notebook: Path) -> list[str]:
    """What the executed ``notebook`` showed a learner that a lesson must not (stderr, errors,
    benchmark keys, reprs, target verdicts: :mod:`labkit.shown`), a line each."""
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    try:
        nb = nbformat.read(notebook, as_version=4)
    except (OSError, ValueError) as exc:  # a notebook papermill saved but cannot be read back
        return [f"its executed notebook cannot be read: {exc}"]
    return [f"cell {index}: {shown}" for index, shown in not_for_a_learner(nb)]


def _last_started_cell(notebook: Path) -> tuple[int | None, str | None]:
    """The index and first line of the last cell papermill began, from the metadata it saves."""
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    try:
        cells = nbformat.read(notebook, as_version=4).cells
    except (OSError, ValueError):  # cut short (a full disk): the error says what happened
        return None, None
    started = [i for i, c in enumerate(cells) if c.metadata.get("papermill", {}).get("start_time")]
    if not started:
        return None, None
    return started[-1], next(iter(cells[started[-1]].source.strip().splitlines()), "")


def _error_cell(notebook: Path, fallback: int) -> int:
    """The index of the failing cell in the saved notebook (papermill adds a banner cell above)."""
    import nbformat  # noqa: PLC0415 (notebook machinery, loaded when notebooks run)

    cells = nbformat.read(notebook, as_version=4).cells
    for i, cell in enumerate(cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return i
    return fallback
