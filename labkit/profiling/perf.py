"""perf_analyzer: the one module that builds and runs its command lines; results as DataFrames.

perf_analyzer comes from the ``tritonclient==2.51.0`` manylinux wheel (``bin/perf_analyzer``), or
from ``LABKIT_PERF_ANALYZER`` / ``PATH`` (the SDK container on GPU hosts). It links ``libb64.so.0d``
(Debian ``libb64-0d``) and ``libcudart.so.12`` (PyPI ``nvidia-cuda-runtime-cu12``, whose folder
labkit puts on ``LD_LIBRARY_PATH``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from labkit import proc
from labkit.errors import ConfigError, MissingDependencyError, ToolError, ToolTimeoutError
from labkit.settings import perf_analyzer_path

log = logging.getLogger(__name__)

#: A sweep's progress as a learner reads it: levels done and time so far. tqdm's default adds a
#: rate ("12.97s/level") and an estimate that a sweep of two or three unequal levels cannot give.
LEVELS_BAR = "{desc}: {percentage:3.0f}% |{bar}| {n_fmt} of {total_fmt} levels, {elapsed}{postfix}"

#: perf_analyzer's CSV headers (``--verbose-csv``) and the names labkit gives them.
_CSV_COLUMNS = {
    "Concurrency": "concurrency",
    "Inferences/Second": "throughput",
    "p50 latency": "p50_ms",
    "p90 latency": "p90_ms",
    "p95 latency": "p95_ms",
    "p99 latency": "p99_ms",
    "Avg latency": "avg_latency_ms",
    "Server Queue": "queue_ms",
    "Server Compute Input": "compute_input_ms",
    "Server Compute Infer": "compute_infer_ms",
    "Server Compute Output": "compute_output_ms",
    "Client Send": "client_send_ms",
    "Network+Server Send/Recv": "network_ms",
    "Client Recv": "client_recv_ms",
    "Avg GPU Utilization": "gpu_utilization",
    "Avg GPU Power Usage": "gpu_power_w",
    "Max GPU Memory Usage": "gpu_memory_max_bytes",
    "Total GPU Memory": "gpu_memory_total_bytes",
}
_USEC_COLUMNS = [v for v in _CSV_COLUMNS.values() if v.endswith("_ms")]
_FIXES = {
    "libb64.so.0d": "install the Debian/Ubuntu package: `sudo apt-get install -y libb64-0d`",
    "libcudart.so.12": "install the CUDA runtime wheel: `pip install nvidia-cuda-runtime-cu12`",
}
_UNSTABLE = "Failed to obtain stable measurement"
#: perf_analyzer calls its last three windows stable when max/min of their throughputs, and of
#: their average latencies, are within 1 + this percentage / 100, and no window is empty. 1000%
#: (max/min <= 11) still failed on a loaded 2-core machine, where one window's latency was 16x
#: another's; at this value only an empty window can fail, which count_windows never has.
_NO_STABILITY_RULE = 1e8

#: perf_analyzer's flags for a measurement of exactly three windows (its stability window)
#: without the stability rule: what ``stability_percentage=None`` asks for, and the retry of a
#: level that did not settle. The last of a repeated flag is the one perf_analyzer keeps.
FIXED_WINDOWS_FLAGS = {"stability-percentage": int(_NO_STABILITY_RULE), "max-trials": 3}
#: The share of a level's bound its first run (with the stability rule) may use; the rest is left
#: to the run without the rule, so one level never takes more than its bound.
_FIRST_RUN_SHARE = 2 / 3


@dataclass(frozen=True)
class Tool:
    """A located executable and the environment it must run with."""

    path: Path
    source: str
    env: dict[str, str] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def _cuda_runtime_lib() -> str | None:
    """The ``nvidia/cuda_runtime/lib`` folder of the ``nvidia-cuda-runtime-cu12`` wheel, if any."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "lib"
        if lib.is_dir():
            return str(lib)
    return None


@functools.lru_cache(maxsize=8)
def locate_perf_analyzer(explicit: str | os.PathLike | None = None) -> Tool:
    """Find a perf_analyzer that loads: argument > ``LABKIT_PERF_ANALYZER`` > this env > PATH.

    Raises :class:`MissingDependencyError` naming what to install when it is missing or a shared
    library it needs cannot be loaded.
    """
    candidates = [
        (explicit, "argument"),
        (perf_analyzer_path(), "LABKIT_PERF_ANALYZER"),
        (Path(sys.executable).parent / "perf_analyzer", "python environment"),
        (shutil.which("perf_analyzer"), "PATH"),
    ]
    found = None
    for value, source in candidates:
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            found = (path, source)
            break
        if source in ("argument", "LABKIT_PERF_ANALYZER"):
            raise MissingDependencyError(
                f"perf_analyzer given by {source} is not an executable file: {str(path)!r}; "
                "fix the path, or unset it to use the one from tritonclient==2.51.0"
            )
    if found is None:
        raise MissingDependencyError(
            "perf_analyzer not found (LABKIT_PERF_ANALYZER, this Python environment, PATH); "
            "install it with `pip install 'tritonclient[all]==2.51.0'` (its manylinux wheel ships "
            "bin/perf_analyzer; later releases do not), or use the Triton SDK container"
        )
    path, source = found
    libs = [p for p in (_cuda_runtime_lib(), os.environ.get("LD_LIBRARY_PATH")) if p]
    tool = Tool(path, source, {"LD_LIBRARY_PATH": os.pathsep.join(libs)} if libs else {})
    result = proc.run([path, "--version"], timeout_s=30, env=tool.environ(), check=False)
    text = (result.stderr or "") + (result.stdout or "")
    missing = re.search(r"error while loading shared libraries: ([^:\s]+)", text)
    if missing:
        lib = missing.group(1)
        fix = _FIXES.get(lib, f"install the package that provides {lib}")
        raise MissingDependencyError(
            f"perf_analyzer at {str(path)!r} cannot load {lib}; {fix}.\n{proc.tail(text, 5)}"
        )
    log.debug("perf_analyzer %s (%s): %s", path, source, text.strip())
    return tool


def _endpoint(server, protocol: str) -> tuple[str, str | None]:
    """(url, metrics url) from a TritonServer or a ``host:port`` string."""
    if isinstance(server, str):
        return server.split("://", 1)[-1], None
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return url, getattr(server, "metrics_url", None)


def _concurrency_levels(concurrency: int | str | Iterable[int]) -> list[int]:
    """1, "2:16:2" (perf_analyzer's start:end:step) or a list -> sorted distinct levels."""
    if isinstance(concurrency, int):
        levels = [concurrency]
    elif isinstance(concurrency, str):
        parts = [int(p) for p in concurrency.split(":")]
        if not 1 <= len(parts) <= 3 or parts[0] < 1:
            raise ConfigError(
                f"concurrency range {concurrency!r} is not start[:end[:step]] with start >= 1; "
                "write it like '2:16:2'"
            )
        start, end, step = parts[0], parts[1] if len(parts) > 1 else parts[0], 1
        if len(parts) == 3:
            step = max(parts[2], 1)
        levels = list(range(start, end + 1, step))
    else:
        levels = [int(c) for c in concurrency]
    if not levels or min(levels) < 1:
        raise ConfigError(f"concurrency must be one or more levels >= 1, got {concurrency!r}")
    return sorted(set(levels))


def _parameter_args(parameters: Mapping[str, object] | None) -> list[str]:
    args = []
    for name, value in (parameters or {}).items():
        kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "string"
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args.append(f"--request-parameter={name}:{text}:{kind}")
    return args


def perf_analyzer(
    server,
    model: str,
    *,
    concurrency: int | str | Iterable[int] = 1,
    protocol: str = "http",
    string_data: str | None = None,
    input_data: str | os.PathLike | Sequence[Mapping] | Mapping | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    request_parameters: Mapping[str, object] | None = None,
    measurement_interval_ms: int = 2000,
    measurement_mode: str = "time_windows",
    measurement_request_count: int | None = None,
    stability_percentage: float | None = 30.0,
    max_trials: int = 8,
    collect_metrics: bool = True,
    metrics_url: str | None = None,
    run_dir: str | os.PathLike | None = None,
    label: str | None = None,
    timeout_s: float = 300.0,
    progress: bool = True,
    extra_args: Sequence[str] = (),
    perf_analyzer_path: str | os.PathLike | None = None,
    cores: Collection[int] | None = None,
) -> pd.DataFrame:
    """Measure ``model`` at each concurrency level and return one row per level.

    ``server`` is a :class:`~labkit.server.TritonServer` or a ``host:port`` URL. Levels run one
    perf_analyzer each (so a sweep shows progress and one unstable level does not sink the rest);
    every level's CSV and output stay in ``run_dir``. Latencies are in milliseconds; ``throughput``
    is in inferences per second; ``avg_batch_size`` is the server's inference count over its
    execution count during the level. ``timeout_s`` bounds each level, both of its runs together:
    a level whose numbers did not settle (perf_analyzer gave up, or was still trying after two
    thirds of the bound) is measured once more without the stability rule, in what is left of
    the bound, and kept with ``stable=False``. ``stability_percentage=None`` measures every level
    in exactly three windows, without the rule: a fixed amount of work, whatever the machine is
    doing (on a shared host the rule decides how long a sweep takes more than what it
    measures; repeats show the noise instead). Such levels have ``stable=True``: there was
    nothing to settle. ``cores`` pins perf_analyzer to those CPU cores (a server pinned to the
    others then never shares a core with its client).

    Raises :class:`ToolError` with perf_analyzer's own message (model not loaded, wrong input),
    and :class:`ToolTimeoutError` when a level cannot be measured within ``timeout_s`` even
    without the rule (its three windows did not fit in what was left: fewer requests per window,
    or a longer bound, fit a slow machine).
    """
    if protocol not in ("http", "grpc"):
        raise ConfigError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    if measurement_mode not in ("time_windows", "count_windows"):
        raise ConfigError(
            f"measurement_mode must be 'time_windows' or 'count_windows', got {measurement_mode!r}"
        )
    if request_parameters and protocol != "grpc":
        raise ConfigError(
            f"request_parameters {dict(request_parameters)} need protocol='grpc': perf_analyzer "
            "2.51 sends request parameters over gRPC only (or set them in the model's config)"
        )
    tool = locate_perf_analyzer(perf_analyzer_path)
    levels = _concurrency_levels(concurrency)
    url, default_metrics = _endpoint(server, protocol)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="labkit-perf-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    name = label or model
    base = [str(tool.path), "-m", model, "-u", url, "-i", protocol, "--verbose-csv"]
    base += [
        f"--measurement-interval={measurement_interval_ms}",
        f"--measurement-mode={measurement_mode}",
        f"--max-trials={max_trials}",
    ]
    if measurement_request_count:
        base.append(f"--measurement-request-count={measurement_request_count}")
    if string_data is not None:
        base.append(f"--string-data={string_data}")
    if input_data is not None:
        base.append(f"--input-data={_input_data_file(input_data, run_dir)}")
    for tensor, dims in (shapes or {}).items():
        base.append(f"--shape={tensor}:{','.join(str(d) for d in dims)}")
    base += _parameter_args(request_parameters)
    metrics_url = metrics_url or default_metrics
    if collect_metrics and metrics_url:
        base += ["--collect-metrics", f"--metrics-url={metrics_url.split('://', 1)[-1]}"]
    base += list(extra_args)

    from tqdm.auto import tqdm  # noqa: PLC0415 (only sweeps need it)

    rows = []
    bar = tqdm(levels, desc=f"perf_analyzer {name}", bar_format=LEVELS_BAR, disable=not progress)
    for level in bar:
        bar.set_postfix(concurrency=level)
        rows.append(
            _measure(tool, base, level, stability_percentage, run_dir, name, timeout_s, cores)
        )
    frame = pd.DataFrame(rows).sort_values("concurrency", ignore_index=True)
    frame.insert(0, "config", name)
    frame.attrs.update(run_dir=str(run_dir), model=model, url=url, protocol=protocol)
    frame.to_csv(run_dir / f"{_slug(name)}.csv", index=False)
    log.info("perf_analyzer %s: %d levels, results in %s", name, len(frame), run_dir)
    return frame


def _measure(
    tool: Tool,
    base: list[str],
    level: int,
    stability: float | None,
    run_dir: Path,
    name: str,
    timeout_s: float,
    cores: Collection[int] | None = None,
) -> dict:
    stem = run_dir / f"{_slug(name)}-c{level}"
    csv_path = stem.with_suffix(".raw.csv")
    args = [*base, f"--concurrency-range={level}", "-f", str(csv_path)]
    stable = True
    deadline = time.monotonic() + timeout_s
    first_bound = timeout_s * _FIRST_RUN_SHARE
    no_rule = [*args, *(f"--{flag}={value}" for flag, value in FIXED_WINDOWS_FLAGS.items())]
    if stability is None:  # three windows, as asked: nothing to settle, the whole bound for them
        try:
            result = _run(tool, no_rule, timeout_s, stem, cores)
        except ToolTimeoutError as exc:
            stem.with_suffix(".log").write_text(f"{exc}\n")
            raise ToolTimeoutError(
                f"perf_analyzer could not measure {name!r} at concurrency {level} in three "
                f"windows within its bound of {timeout_s:g} s. Its windows are too slow for this "
                "bound on this machine: lower measurement_request_count (or "
                f"measurement_interval_ms), or raise timeout_s. Output: {stem}.log"
            ) from None
        unsettled, why = False, ""
    else:
        try:
            rule = f"--stability-percentage={stability:g}"
            result = _run(tool, [*args, rule], first_bound, stem, cores)
            unsettled = result.returncode != 0 and _UNSTABLE in result.stdout + result.stderr
            why = f"within {stability:g}%"
        except ToolTimeoutError as exc:  # still trying to settle: a loaded machine, slow windows
            stem.with_suffix(".log").write_text(f"{exc}\n")
            unsettled, why = True, f"within {stability:g}% in {first_bound:.0f} s"
    if unsettled:
        left = max(deadline - time.monotonic(), 1.0)
        # Not a warning: the sweep's ``stable`` column and the lesson's words say it to the
        # learner; the retry itself belongs in the log (and the run's perf logs), not a cell.
        log.info(
            "%s at concurrency %d did not settle %s; measuring once more "
            "without the stability rule, within the %.0f s left of its bound",
            name,
            level,
            why,
            left,
        )
        stable = False
        stem.with_suffix(".log").replace(stem.with_suffix(".unsettled.log"))
        try:
            result = _run(tool, no_rule, left, stem, cores)
            retry_log = stem.with_suffix(".log")
            retry_log.write_text(
                f"# the run with the stability rule did not settle {why} ({stem.name}"
                ".unsettled.log); this one measured without it\n" + retry_log.read_text()
            )
        except ToolTimeoutError as exc:
            stem.with_suffix(".log").write_text(f"{exc}\n")
            raise ToolTimeoutError(
                f"perf_analyzer could not measure {name!r} at concurrency {level} within its "
                f"bound of {timeout_s:g} s: it did not settle {why}, and three windows without "
                f"the stability rule did not fit in the {left:.0f} s left. Its windows are too slow "
                "for this bound on this machine: lower measurement_request_count (or "
                f"measurement_interval_ms), or raise timeout_s. Outputs: {stem}.log and "
                f"{stem}.unsettled.log"
            ) from None
    if result.returncode != 0 or not csv_path.is_file():
        output = (result.stderr or "") + (result.stdout or "")
        errors = [line.strip() for line in output.splitlines() if "error" in line.lower()]
        message = "\n".join(errors[:5]) if errors else proc.tail(output, 15).strip()
        raise ToolError(
            f"perf_analyzer failed for {name!r} at concurrency {level} (status "
            f"{result.returncode}): {message}\nCheck that the model is loaded and that input "
            f"names and shapes match its config; full output in {stem}.log"
        )
    row = _parse_csv(csv_path)
    row.update(_parse_server_counts(result.stdout))
    row["concurrency"] = level
    row["stable"] = stable
    row["log"] = str(stem.with_suffix(".log"))
    return row


def _run(
    tool: Tool, args: list[str], timeout_s: float, stem: Path, cores: Collection[int] | None = None
):
    started = time.monotonic()
    result = proc.run(args, timeout_s=timeout_s, env=tool.environ(), check=False, cores=cores)
    stem.with_suffix(".log").write_text(
        f"$ {shlex.join(str(a) for a in args)}\n# status {result.returncode} after "
        f"{time.monotonic() - started:.1f} s\n{result.stdout}\n{result.stderr}"
    )
    return result


def _parse_csv(path: Path) -> dict:
    raw = pd.read_csv(path)
    if raw.empty:
        raise ToolError(f"perf_analyzer wrote no measurements to {path}")
    first = raw.iloc[0]
    row = {}
    for header, column in _CSV_COLUMNS.items():
        value = pd.to_numeric(first.get(header), errors="coerce")
        row[column] = value / 1000.0 if column in _USEC_COLUMNS else value
    return row


def _parse_server_counts(stdout: str) -> dict:
    """The server-side inference and execution counts perf_analyzer prints (not in its CSV)."""
    server = stdout.split("Server:", 1)[-1] if "Server:" in stdout else ""
    out = {"request_count": _number(r"Request count: (\d+)", stdout)}
    out["inference_count"] = _number(r"Inference count: (\d+)", server)
    out["execution_count"] = _number(r"Execution count: (\d+)", server)
    executions = out["execution_count"]
    out["avg_batch_size"] = out["inference_count"] / executions if executions else float("nan")
    return out


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else float("nan")


def _input_data_file(data, run_dir: Path) -> str:
    """A path as given, or JSON data (a list of requests, or perf_analyzer's {"data": [...]})."""
    if isinstance(data, (str, os.PathLike)):
        if str(data) in ("zero", "random"):
            return str(data)
        path = Path(data)
        if not path.exists():
            raise ConfigError(
                f"input_data file {str(path)!r} does not exist; pass a JSON file, "
                "a list of {input: [values]} requests, 'zero' or 'random'"
            )
        return str(path)
    document = data if isinstance(data, Mapping) else {"data": list(data)}
    path = run_dir / "input-data.json"
    path.write_text(json.dumps(document, indent=1))
    return str(path)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def write_perf_data(path: str | os.PathLike, inputs: list[dict], expected: list[dict]) -> Path:
    """An ``--input-data`` JSON with ``data`` and ``validation_data``, as the upstream QA uses.

    ``inputs`` / ``expected``: one dict per step, tensor name -> numpy array, shaped as the
    model's config declares it: without the batch dimension for a batching model (perf_analyzer
    adds it, ``-b``), with it for dims such as ``-1x4``. Outputs are compared flattened, and a
    mismatch makes :func:`perf_analyzer` fail with perf_analyzer's own message.
    """
    doc = {
        "data": [
            {
                k: {"content": v.reshape(-1).tolist(), "shape": list(v.shape)}
                for k, v in step.items()
            }
            for step in inputs
        ],
        "validation_data": [
            {k: v.reshape(-1).tolist() for k, v in step.items()} for step in expected
        ],
    }
    path = Path(path)
    path.write_text(json.dumps(doc))
    return path


def repeated(
    server, model: str, *, repeats: int, label: str | None = None, **options
) -> pd.DataFrame:
    """:func:`perf_analyzer` ``repeats`` times over; the rows of all runs, with a ``repeat`` column.

    Repeats show the noise of a measurement on a shared machine: a difference smaller than the
    spread between repeats of the same configuration is not a difference.
    """
    if repeats < 1:
        raise ConfigError(f"repeats must be 1 or more, got {repeats}")
    name = label or model
    runs = [
        perf_analyzer(server, model, label=f"{name} #{i + 1}", **options).assign(repeat=i + 1)
        for i in range(repeats)
    ]
    frame = pd.concat(runs, ignore_index=True)
    frame["config"] = name
    return frame


def report(frame: pd.DataFrame, concurrency: int) -> str:
    """perf_analyzer's own command and report for one level of a sweep, as a learner runs it.

    The command is quoted so that it pastes into a shell; the report is perf_analyzer's text
    from its ``Concurrency:`` line on, with the ``Client:`` and ``Server:`` breakdown (queue,
    compute input, compute infer, compute output) that the tutorial reads.
    """
    rows = frame[frame["concurrency"] == concurrency]
    if rows.empty:
        raise ConfigError(
            f"concurrency {concurrency} was not measured; the sweep has "
            f"{', '.join(str(c) for c in frame['concurrency'])}"
        )
    text = Path(rows.iloc[0]["log"]).read_text(encoding="utf-8")
    command = text.splitlines()[0].removeprefix("$ ")
    command = re.sub(r"^\S*/perf_analyzer ", "perf_analyzer ", command)
    body = text.split("Request concurrency:", 1)[-1]
    start = body.find("  Client:")
    block = body[start:] if start >= 0 else body
    block = block.split("Inferences/Second vs. Client", 1)[0]
    block = block.split("  Server Prometheus Metrics:", 1)[0].rstrip()  # GPU lines, empty on a CPU
    return f"$ {command}\n\nRequest concurrency: {concurrency}\n{block}"
