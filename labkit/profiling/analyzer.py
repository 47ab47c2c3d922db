"""Triton Model Analyzer (``model-analyzer profile``) run with labkit's server, read into DataFrames.

Model Analyzer launches ``tritonserver`` itself (``triton_launch_mode: local``). labkit writes a
small wrapper script into the run folder that starts the located server with its backend directory
and environment, and records the PID of every server it starts, so that a run that ends badly (a
timeout, an interrupt) still leaves no ``tritonserver`` behind: Model Analyzer starts each server
in a session of its own, out of reach of Model Analyzer's own process group. Model Analyzer is
sent SIGTERM if the kernel dies, and the servers and perf_analyzers it starts (through a second
wrapper) are sent SIGTERM when Model Analyzer dies, so a killed kernel leaves nothing either.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import psutil
import yaml
from tqdm.auto import tqdm
from tritonclient.grpc import model_config_pb2

from labkit import hardware
from labkit.errors import ConfigError, MissingDependencyError, ToolError, ToolTimeoutError
from labkit.proc import free_ports, kill_group, processes_using, spawn, tail, wait_until
from labkit.profiling.perf import FIXED_WINDOWS_FLAGS, locate_perf_analyzer, perf_analyzer
from labkit.repository import read_config
from labkit.server import locate_tritonserver, reload, unhealthy

log = logging.getLogger(__name__)

WRAPPER_MARKER = "labkit-tritonserver-wrapper"
#: Model Analyzer's measurement fields labkit asks for (its names; see its docs/config.md).
INFERENCE_FIELDS = [
    "model_name",
    "batch_size",
    "concurrency",
    "model_config_path",
    "instance_group",
    "max_batch_size",
    "satisfies_constraints",
    "perf_throughput",
    "perf_latency_p99",
    "perf_server_queue",
    "perf_server_compute_infer",
    "cpu_used_ram",
    "gpu_used_memory",
    "gpu_utilization",
]
_COLUMNS = {
    "Model": "model",
    "Model Config Path": "config",
    "Concurrency": "concurrency",
    "Batch": "batch_size",
    "Instance Group": "instance_group",
    "Max Batch Size": "max_batch_size",
    "Satisfies Constraints": "satisfies_constraints",
    "Throughput (infer/sec)": "throughput",
    "p50 Latency (ms)": "p50_ms",
    "p99 Latency (ms)": "p99_ms",
    "Server Queue time (ms)": "queue_ms",
    "Server Compute Infer time (ms)": "compute_infer_ms",
    "RAM Usage (MB)": "cpu_memory_mb",
    "GPU Memory Usage (MB)": "gpu_memory_mb",
    "GPU Utilization (%)": "gpu_utilization",
}


@dataclass
class AnalyzerSettings:
    """What to search. The defaults are sized for 2 CPU cores (a few configs, short windows);
    the tutorial's GPU search is ``max_instance_count=3, min_model_batch_size=8`` and wider."""

    models: list[str]
    search_mode: str = "brute"  # "quick" or "brute" (automatic brute search)
    max_instance_count: int = 1
    min_model_batch_size: int = 1
    max_model_batch_size: int = 4
    concurrency: list[int] = field(default_factory=lambda: [2])
    measurement_request_count: int = 20
    # perf_analyzer's stability rule for each measurement: the last 3 windows within
    # ``stability_percentage`` of each other, in at most ``max_trials`` windows. perf_analyzer's
    # own 10% in 10 windows is seldom met on a shared CPU with short windows; Model Analyzer then
    # measures the config all over again with 50 more requests a window, up to 10 times, and the
    # search's time goes into windows that rank nothing. The search only ranks configurations; a
    # winner is measured again, repeated, against the default (notebook 04's noise band).
    # ``stability_percentage=None`` drops the rule: every configuration is measured in exactly
    # three windows, the same work whatever the machine is doing (``max_trials`` is unused then).
    stability_percentage: int | None = 10
    max_trials: int = 10
    perf_analyzer_timeout_s: int = 120
    client_protocol: str = "http"
    cpu_only: bool | None = None  # None: True when the host has no NVIDIA GPU
    string_data: str | None = "Where is the nearest"
    shapes: dict[str, list[int]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # any other Model Analyzer option, as in its YAML


@dataclass
class AnalyzerResult:
    """What a profile run left: its DataFrames and where its files are."""

    run_dir: Path
    export_path: Path
    inference: pd.DataFrame
    gpu: pd.DataFrame | None
    server: pd.DataFrame | None
    configs: dict[str, dict]  # variant name -> max_batch_size, dynamic_batching, instances, path

    @property
    def reports(self) -> list[Path]:
        """Model Analyzer's own reports (HTML without wkhtmltopdf, else PDF)."""
        return sorted((self.export_path / "reports").rglob("*.htm*")) + sorted(
            (self.export_path / "reports").rglob("*.pdf")
        )


def find_model_analyzer() -> str | None:
    """The ``model-analyzer`` executable of this Python environment, else on PATH, else None."""
    beside = Path(sys.executable).parent / "model-analyzer"
    return str(beside) if beside.is_file() else shutil.which("model-analyzer")


def write_wrapper(run_dir: Path) -> Path:
    """``run_dir/bin/tritonserver``: starts the located server with its backend and environment."""
    binary = locate_tritonserver()
    backend = f" --backend-directory={shlex.quote(str(binary.backend_directory))}"
    return _write_script(
        run_dir / "bin" / "tritonserver",
        f"echo $$ >> {shlex.quote(str(run_dir / 'tritonserver.pids'))}",
        *[f"export {k}={shlex.quote(v)}" for k, v in binary.env.items()],
        f"exec {_death_guard()}{shlex.quote(str(binary.path))}"
        f'{backend if binary.backend_directory else ""} "$@"',
    )


def write_perf_wrapper(run_dir: Path) -> Path:
    """``run_dir/bin/perf_analyzer``: the located perf_analyzer, ended with Model Analyzer."""
    path = locate_perf_analyzer().path
    return _write_script(
        run_dir / "bin" / "perf_analyzer", f'exec {_death_guard()}{shlex.quote(str(path))} "$@"'
    )


def _death_guard() -> str:
    """``setpriv --pdeathsig TERM `` where util-linux has it: what a wrapper runs is sent SIGTERM
    when Model Analyzer dies, as labkit's own servers are when the kernel dies. Without it a
    killed search left its server, and the perf_analyzer whose open connections hold that
    server's shutdown for its 30 s exit timeout, running."""
    setpriv = shutil.which("setpriv")
    return f"{shlex.quote(setpriv)} --pdeathsig TERM " if setpriv else ""


def _write_script(path: Path, *body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# {WRAPPER_MARKER}: written by labkit.analyzer for Model Analyzer's local launch mode."
    )
    path.write_text("\n".join(["#!/bin/sh", header, *body]) + "\n")
    path.chmod(0o755)
    return path


def write_config(repository: str | os.PathLike, run_dir: Path, s: AnalyzerSettings) -> Path:
    """The Model Analyzer YAML for ``s``, with free loopback ports and paths in ``run_dir``."""

    if s.search_mode not in ("quick", "brute"):
        raise ConfigError(f"search_mode must be 'quick' or 'brute', got {s.search_mode!r}")
    if not s.models:
        raise ConfigError("AnalyzerSettings.models is empty; name at least one model to profile")
    cpu_only = (not hardware.has_gpu()) if s.cpu_only is None else s.cpu_only
    http, grpc, metrics = free_ports(3)
    flags = {
        "measurement-mode": "count_windows",
        "measurement-request-count": s.measurement_request_count,
        **(
            FIXED_WINDOWS_FLAGS
            if s.stability_percentage is None
            else {"stability-percentage": s.stability_percentage, "max-trials": s.max_trials}
        ),
    }
    data = _input_data(repository, run_dir, s)
    if data:
        flags["input-data"] = str(data)
    if len(s.shapes) > 1:
        raise ConfigError(
            f"Model Analyzer takes one --shape here, got {len(s.shapes)}: {s.shapes}; pass the "
            "others through extra={'perf_analyzer_flags': {...}} or an input_data JSON"
        )
    for tensor, dims in s.shapes.items():
        flags["shape"] = f"{tensor}:{','.join(map(str, dims))}"
    config = {
        "model_repository": str(Path(repository).resolve()),
        "profile_models": {
            m: {"cpu_only": cpu_only, "parameters": {"concurrency": list(s.concurrency)}}
            for m in s.models
        },
        "run_config_search_mode": s.search_mode,
        "run_config_search_max_instance_count": s.max_instance_count,
        "run_config_search_min_model_batch_size": s.min_model_batch_size,
        "run_config_search_max_model_batch_size": s.max_model_batch_size,
        "triton_launch_mode": "local",
        "triton_server_path": str(write_wrapper(run_dir)),
        "triton_http_endpoint": f"127.0.0.1:{http}",
        "triton_grpc_endpoint": f"127.0.0.1:{grpc}",
        "triton_metrics_url": f"http://127.0.0.1:{metrics}/metrics",
        "triton_server_flags": {
            "http-address": "127.0.0.1",
            "grpc-address": "127.0.0.1",
            "metrics-address": "127.0.0.1",
            "allow-cpu-metrics": "true",
        },
        "triton_output_path": str(run_dir / "tritonserver.log"),
        "perf_analyzer_path": str(write_perf_wrapper(run_dir)),
        "perf_analyzer_flags": flags,
        "perf_analyzer_timeout": s.perf_analyzer_timeout_s,
        "perf_output": True,
        "perf_output_path": str(run_dir / "perf_analyzer.log"),
        "client_protocol": s.client_protocol,
        "collect_cpu_metrics": True,
        "export_path": str(run_dir / "analysis"),
        "checkpoint_directory": str(run_dir / "analysis" / "checkpoints"),
        "output_model_repository_path": str(run_dir / "output_model_repository"),
        "override_output_model_repository": True,
        "inference_output_fields": INFERENCE_FIELDS,
        **s.extra,
    }
    (run_dir / "analysis").mkdir(parents=True, exist_ok=True)
    path = run_dir / "model-analyzer.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _input_data(repository: str | os.PathLike, run_dir: Path, s: AnalyzerSettings) -> Path | None:
    """``run_dir/input-data.json``: ``s.string_data`` in every string input of the models.

    Model Analyzer splits its perf_analyzer flags at spaces (``str.split``), so
    ``string-data: Where is the nearest`` reached perf_analyzer as ``--string-data Where`` and
    three stray words: the search's requests carried "Where" while a re-measurement sent the
    whole prompt. A JSON file (perf_analyzer's ``--input-data``) carries it whole.
    """
    if s.string_data is None:
        return None
    names = sorted(
        {
            tensor.name
            for model in s.models
            if (Path(repository) / model / "config.pbtxt").is_file()
            for tensor in read_config(Path(repository) / model / "config.pbtxt").input
            if tensor.data_type == model_config_pb2.TYPE_STRING
        }
    )
    if not names:
        return None
    path = run_dir / "input-data.json"
    if any(c.isspace() or c == "=" for c in str(path)):
        raise ConfigError(
            f"Model Analyzer cuts its perf_analyzer flags at spaces and '=', so the run folder "
            f"{str(run_dir)!r} cannot hold its input data; choose a run folder without them"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": [{name: [s.string_data] for name in names}]}))
    return path


def model_analyzer(
    repository: str | os.PathLike,
    run_dir: str | os.PathLike,
    settings: AnalyzerSettings,
    *,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> AnalyzerResult:
    """Run ``model-analyzer profile`` on ``settings.models`` and load what it measured.

    Stale checkpoints are removed first (Model Analyzer would otherwise reuse old results).
    Past ``timeout_s``, or on an interrupt, Model Analyzer and every server it started are
    killed and :class:`ToolTimeoutError` (or ``KeyboardInterrupt``) is raised.
    """
    executable = find_model_analyzer()
    if not executable:
        raise MissingDependencyError(
            "model-analyzer is not installed; `pip install triton-model-analyzer==1.58.0` "
            "(or `pip install -e .[analyzer]`)"
        )
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run_dir / "analysis" / "checkpoints", ignore_errors=True)
    config = write_config(repository, run_dir, settings)
    pa = locate_perf_analyzer()
    env = {**os.environ, **pa.env}
    env["PATH"] = os.pathsep.join(
        [str(run_dir / "bin"), str(Path(executable).parent), env.get("PATH", "")]
    )
    log_path = run_dir / "model-analyzer.log"
    cmd = [executable, "profile", "-f", str(config)]
    log.info("running %s (log: %s)", " ".join(cmd), log_path)
    with open(log_path, "w") as log_file:
        # spawn: Model Analyzer gets SIGTERM if this process dies (a killed kernel); its servers
        # and perf_analyzers get it from Model Analyzer's death (the wrappers' _death_guard).
        process = spawn(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=run_dir,
        )
        try:
            _follow(process, log_path, timeout_s, progress)
        finally:
            _end_everything(process, run_dir)
    if process.returncode != 0:
        raise ToolError(
            f"model-analyzer exited with status {process.returncode}; "
            f"see {log_path}\n{tail(log_path.read_text(), 25)}"
        )
    return load_results(run_dir)


def _follow(process: subprocess.Popen, log_path: Path, timeout_s: float, progress: bool) -> None:
    """Wait for Model Analyzer, showing each measurement it starts, up to the deadline."""

    seen = 0
    shown = "{desc}: {n} measurements started, {elapsed}{postfix}"  # no rate: they differ
    with tqdm(desc="model-analyzer", bar_format=shown, disable=not progress) as bar:

        def ended() -> bool:
            nonlocal seen
            if process.poll() is not None:
                return True
            lines = re.findall(r"Profiling (\S+): (.*)", log_path.read_text(errors="replace"))
            if len(lines) > seen:
                bar.update(len(lines) - seen)
                bar.set_postfix_str(" ".join(lines[-1])[:60])
                seen = len(lines)
            return False

        if not wait_until(ended, timeout_s, 1.0):
            raise ToolTimeoutError(
                f"model-analyzer ran past its bound of {timeout_s:g} s and was stopped; "
                f"narrow the search (fewer concurrencies, batch sizes, instances) or pass "
                f"timeout_s= a larger bound.\n{tail(log_path.read_text(), 10)}"
            )


#: model_analyzer.constants.MAX_NUMBER_OF_INTERRUPTS in 1.58.
INTERRUPTS_TO_EXIT_NOW = 3


def _end_everything(process: subprocess.Popen, run_dir: Path) -> None:
    """Stop Model Analyzer's process group and every server the wrapper recorded."""
    if process.poll() is None:
        # At its first SIGINT Model Analyzer waits for the measurement under way to end (a cut-short
        # search waited its whole 30 s grace here); at its third it saves its checkpoint, stops
        # its server (SIGTERM, then SIGKILL after 5 s) and exits.
        for _ in range(INTERRUPTS_TO_EXIT_NOW):
            kill_group(process.pid, signal.SIGINT)
            time.sleep(0.2)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    kill_group(process.pid, signal.SIGKILL)
    process.wait()
    pids = run_dir / "tritonserver.pids"
    for line in pids.read_text().split() if pids.is_file() else []:
        kill_group(int(line), signal.SIGKILL)  # each server leads its own session
    for left in processes_using(run_dir):
        kill_group(left.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            left.kill()  # psutil checks it is still the process found, not a reused PID


def leftover_servers(run_dir: str | os.PathLike) -> list[int]:
    """PIDs of processes with an argument in ``run_dir`` (servers, stubs, perf_analyzer)."""
    return [process.pid for process in processes_using(run_dir)]


def load_results(run_dir: str | os.PathLike) -> AnalyzerResult:
    """Read the CSVs of a finished run (``analysis/results``) and its model variants' configs.

    ``inference`` keeps Model Analyzer's own ranking as ``rank`` (1: the configuration its report
    names): it writes its results best first, and the CSV's throughput has one decimal, so two
    configurations can tie there that it told apart. Where its perf_analyzer log reads back, each
    row also gets that measurement's exact ``throughput`` and ``avg_batch_size`` (requests per
    execution: the server's inference count over its execution count).
    """
    run_dir = Path(run_dir)
    export = run_dir / "analysis"
    results = export / "results"
    inference_csv = results / "metrics-model-inference.csv"
    if not inference_csv.is_file():
        raise ToolError(
            f"Model Analyzer left no {inference_csv}; see {run_dir / 'model-analyzer.log'}"
        )
    inference = pd.read_csv(inference_csv).rename(columns=_COLUMNS)
    order = inference.drop_duplicates("config")["config"].tolist()
    inference["rank"] = inference["config"].map({c: i for i, c in enumerate(order, 1)})
    configs = _variant_configs(run_dir / "output_model_repository")
    for key in ("dynamic_batching", "instances"):
        inference[key] = inference["config"].map(lambda c, k=key: configs.get(c, {}).get(k))
    inference = _with_search_log(inference, run_dir)
    optional = {}
    for name, stem in (("gpu", "metrics-model-gpu"), ("server", "metrics-server-only")):
        path = results / f"{stem}.csv"
        optional[name] = pd.read_csv(path) if path.is_file() and path.stat().st_size else None
    inference = inference.sort_values(["config", "concurrency"], ignore_index=True)
    return AnalyzerResult(run_dir, export, inference, optional["gpu"], optional["server"], configs)


def _with_search_log(inference: pd.DataFrame, run_dir: Path) -> pd.DataFrame:
    """``inference`` with each measurement's exact throughput and requests per execution, read
    from perf_analyzer's own output (``perf_analyzer.log``), when that log matches the CSV."""
    measured = search_log(run_dir)
    frame = inference.assign(avg_batch_size=float("nan"))
    for i, row in frame.iterrows():
        found = measured.get((row["config"], int(row["concurrency"])))
        # the log's figure must round to the CSV's: a measurement repeated or skipped breaks
        # the pairing, and then the CSV's one decimal is all there is
        if found and abs(found["throughput"] - row["throughput"]) <= 0.051:
            frame.loc[i, ["throughput", "avg_batch_size"]] = [
                found["throughput"],
                found["avg_batch_size"],
            ]
    return frame


def search_log(run_dir: str | os.PathLike) -> dict[tuple[str, int], dict]:
    """``(configuration, concurrency) -> {throughput, avg_batch_size}`` from perf_analyzer's
    output during the search, paired in order with Model Analyzer's "Profiling" lines; empty
    when the two do not pair one to one."""
    run_dir = Path(run_dir)
    ma_log, perf_log = run_dir / "model-analyzer.log", run_dir / "perf_analyzer.log"
    if not ma_log.is_file() or not perf_log.is_file():
        return {}
    profiled = re.findall(r"Profiling (\S+): concurrency=(\d+)", ma_log.read_text(errors="replace"))
    runs = perf_log.read_text(errors="replace").split("Perf Analyzer Launched")[1:]
    if len(profiled) != len(runs):
        return {}
    out = {}
    for (config, level), text in zip(profiled, runs, strict=True):
        throughput = re.search(r"Throughput: ([\d.]+) infer/sec", text)
        inferences = re.search(r"Inference count: (\d+)", text)
        executions = re.search(r"Execution count: (\d+)", text)
        if throughput:
            batch = (
                int(inferences.group(1)) / int(executions.group(1))
                if inferences and executions and int(executions.group(1))
                else float("nan")
            )
            out[(config, int(level))] = {
                "throughput": float(throughput.group(1)),
                "avg_batch_size": batch,
            }
    return out


def _variant_configs(folder: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(folder.glob("*/config.pbtxt")):
        cfg = read_config(path)
        out[path.parent.name] = {
            "max_batch_size": cfg.max_batch_size,
            "dynamic_batching": cfg.HasField("dynamic_batching"),
            "instances": sum(g.count or 1 for g in cfg.instance_group) or 1,
            "path": path,
        }
    return out


def default_config(result: AnalyzerResult) -> str:
    """The name of the search's default configuration (the model's own, ``<model>_config_default``)."""
    found = [name for name in result.configs if name.endswith("_config_default")]
    if not found:
        raise ConfigError(
            f"the search measured no default configuration; measured: {', '.join(result.configs)}"
        )
    return found[0]


def change_from_default(result: AnalyzerResult, variant: str) -> str:
    """What ``variant`` changes from the default, in words: ``max batch size 8 -> 4``,
    ``2 instances``, or ``none`` for the default itself or a variant with its settings."""
    default = result.configs[default_config(result)]
    mine = result.configs[variant]
    changes = []
    if mine["max_batch_size"] != default["max_batch_size"]:
        changes.append(f"max batch size {default['max_batch_size']} -> {mine['max_batch_size']}")
    if mine["dynamic_batching"] != default["dynamic_batching"]:
        changes.append("dynamic batching " + ("on" if mine["dynamic_batching"] else "off"))
    if mine["instances"] != default["instances"]:
        changes.append(f"{mine['instances']} instances")
    return ", ".join(changes) or "none"


def ranked(result: AnalyzerResult) -> pd.DataFrame:
    """One row per configuration, at its best-throughput measurement, in Model Analyzer's own
    order: its winner first. Machine columns (``config``, ``rank``, ``throughput``, ...) for the
    lessons; :func:`summary` is the same table in a learner's words."""
    frame = result.inference
    best = frame.loc[frame.groupby("config")["throughput"].idxmax()].copy()
    best["max_batch_size"] = best["config"].map(lambda c: result.configs[c]["max_batch_size"])
    best["change"] = best["config"].map(lambda c: change_from_default(result, c))
    best["is_default"] = best["config"] == default_config(result)
    return best.sort_values("rank", ignore_index=True)


#: :func:`summary`'s columns: machine name -> what a learner reads.
SUMMARY_COLUMNS = {
    "rank": "rank",
    "config": "configuration",
    "change": "change from the default",
    "instances": "instances",
    "max_batch_size": "max batch size",
    "concurrency": "clients",
    "throughput": "infer/s",
    "p99_ms": "p99 latency (ms)",
    "avg_batch_size": "requests per execution",
    "gpu_memory_mb": "GPU memory (MB)",
    "gpu_utilization": "GPU utilization",
}


def summary(result: AnalyzerResult) -> pd.DataFrame:
    """The tutorial's table, in Model Analyzer's order (its winner first): per configuration,
    its best-throughput measurement, with what it changes from the default."""
    table = ranked(result)
    # cpu_memory_mb is left out: on a CPU host Model Analyzer reads the tritonserver process
    # alone (37 MB), not the Python stubs that hold the model, so it would mislead.
    if not table.get("gpu_memory_mb", pd.Series(dtype=float)).fillna(0).any():
        table = table.drop(columns=["gpu_memory_mb", "gpu_utilization"], errors="ignore")
    for column, digits in (("throughput", 2), ("p99_ms", 0), ("avg_batch_size", 1)):
        table[column] = table[column].map(lambda v, d=digits: f"{v:.{d}f}" if v == v else "")
    columns = [c for c in SUMMARY_COLUMNS if c in table]
    return table[columns].rename(columns=SUMMARY_COLUMNS)


def best_config(result: AnalyzerResult, p99_budget_ms: float | None = None) -> str:
    """Model Analyzer's winner: the configuration its report names (first in its ranking).

    With ``p99_budget_ms``, the highest throughput among measurements within that p99 latency.
    """
    frame = result.inference
    if p99_budget_ms is None:
        return str(frame.loc[frame["rank"].idxmin(), "config"])
    frame = frame[frame["p99_ms"] <= p99_budget_ms]
    if frame.empty:
        raise ConfigError(
            f"no measured configuration has p99 latency <= {p99_budget_ms:g} ms (lowest: "
            f"{result.inference['p99_ms'].min():.1f} ms); raise the budget or pass None"
        )
    return str(frame.loc[frame["throughput"].idxmax(), "config"])


def contenders(result: AnalyzerResult, winner: str) -> list[str]:
    """What to measure again: the default, then for each instance count the best-ranked
    configuration that changes something from the default, so that every answer the search
    gives (*does the max batch size matter? do more instances help?*) is measured whatever it
    ranked first. Model Analyzer's ``winner`` is among them (it is the best-ranked of its
    instance count), unless it has the default's own settings: then the default stands for it."""
    table = ranked(result)
    changed = table[table["change"] != "none"]
    chosen = [default_config(result)]
    chosen += [str(rows.iloc[0]["config"]) for _, rows in changed.groupby("instances", sort=True)]
    if change_from_default(result, winner) != "none":
        chosen.append(winner)  # a winner picked by a latency budget, not by rank
    return list(dict.fromkeys(chosen))


def serve_contenders(result: AnalyzerResult, repository, model: str, variants: list[str]) -> dict:
    """Each of ``variants`` as a model of ``repository`` beside ``model``: ``{variant: served
    name}``. The default is ``model`` itself; every other variant is a twin of ``model``'s folder
    named as Model Analyzer named it, with its configuration, so one server holds them all and
    they can be measured in turns."""
    served = {}
    for variant in variants:
        if variant == default_config(result):
            served[variant] = model
        else:
            repository.add_twin(model, variant, read_config(result.configs[variant]["path"]))
            served[variant] = variant
    return served


def measure_rounds(server, served: dict[str, str], *, rounds: int, **options) -> pd.DataFrame:
    """Every configuration of ``served`` (``{name: served model}``) measured once a round, in
    turns, the order reversed every other round (A B C, C B A, ...) so that a host that speeds
    up or slows down during the rounds weighs on all of them alike. ``options`` go to
    :func:`labkit.profiling.perf_analyzer` (one concurrency level). One row a measurement:
    ``round``, ``config``, ``throughput``, ``avg_batch_size``, ``compute_infer_ms``, ``p99_ms``."""
    if rounds < 2:
        raise ConfigError(f"rounds must be 2 or more, to show the spread of a round, got {rounds}")
    rows = []
    names = list(served)
    for r in range(1, rounds + 1):
        for name in names if r % 2 else names[::-1]:
            frame = _measure_once_more_if_starved(
                server, served[name], f"{name} round {r}", options
            )
            if len(frame) != 1:
                raise ConfigError(
                    f"measure_rounds() measures one concurrency level, got {len(frame)}: pass "
                    "concurrency= one number"
                )
            for row in frame.to_dict("records"):
                rows.append({**row, "config": name, "round": r})
    keep = ["round", "config", "concurrency", "throughput", "avg_batch_size", "compute_infer_ms"]
    return pd.DataFrame(rows)[[*keep, "p99_ms"]]


def _measure_once_more_if_starved(server, model: str, label: str, options: dict) -> pd.DataFrame:
    """perf_analyzer on ``model``, taken once more when it failed for a reason of the moment:

    - its requests failed with ``Stub process ... is not healthy`` while every stub still runs.
      Triton's Python backend calls a stub unhealthy when its heartbeat (every 300 ms) is not
      seen within a second, and a stub on a busy pinned core can miss that window for a moment:
      that moment's requests fail, the next ones are served (seen on 2 cores at load 12, once in
      three rounds);
    - a stub died during the measurement: a segfault inside Triton's own stub binary (error 7,
      a write at a page-aligned address), once in about ten runs of notebook 04 under
      ``make test``, never twice in a run. The server this process started is stopped and
      started again, its models with it, then the measurement is taken again. Not the model
      alone: unloading the dead stub's instance aborted tritonserver
      (``boost::interprocess::lock_exception``), and a whole restart leaves no state behind.

    A second failure raises. On a server this process did not start, or one that ended, no stub
    can be counted: "not healthy" is measured once more, anything else raised as it came."""
    try:
        return perf_analyzer(server, model, label=label, **options)
    except ToolError as exc:
        # only a server this process started and still runs has stubs to count
        dead = unhealthy(server) if getattr(server, "running", False) else {}
        if dead:
            said = "; ".join(f"{name}: {what}" for name, what in dead.items())
            log.warning(
                "%s: a Python stub died during the measurement (%s); restarting the server and "
                "measuring once more",
                label,
                said,
            )
            server.stop()
            server.start()
        elif "is not healthy" not in str(exc):
            raise
        else:
            log.warning("%s: a stub missed its health window (%s); measuring once more", label, exc)
    return perf_analyzer(server, model, label=f"{label}, again", **options)


def apply_config(result: AnalyzerResult, variant: str, server, model: str) -> str:
    """Write ``variant``'s configuration as ``model``'s in the server's repository and reload it
    live; returns the diff. Confirm with :func:`labkit.profiling.perf_analyzer` before and after."""
    if variant not in result.configs:
        raise ConfigError(
            f"unknown configuration {variant!r}; measured: {', '.join(result.configs)}"
        )
    cfg = read_config(result.configs[variant]["path"])
    cfg.name = model
    return reload(server, model, cfg)


def command_line(repository: str | os.PathLike, settings: AnalyzerSettings) -> str:
    """The ``model-analyzer profile`` command a learner would type for the same search.

    labkit itself runs ``model-analyzer profile -f <run>/model-analyzer.yaml``, which also holds
    the ports, paths and wrapper that keep the run inside its folder.
    """
    args = [
        "model-analyzer",
        "profile",
        "-m",
        str(Path(repository).resolve()),
        "--profile-models",
        ",".join(settings.models),
        "--run-config-search-mode",
        settings.search_mode,
        f"--run-config-search-max-instance-count={settings.max_instance_count}",
        f"--run-config-search-min-model-batch-size={settings.min_model_batch_size}",
        f"--run-config-search-max-model-batch-size={settings.max_model_batch_size}",
        "--concurrency",
        ",".join(str(c) for c in settings.concurrency),
        "--triton-launch-mode=local",
    ]
    return shlex.join(args)


def summary_report(result: AnalyzerResult):
    """Model Analyzer's own summary report, for display in a notebook (IPython HTML).

    The report is HTML when ``wkhtmltopdf`` is not installed (as here); its plots are embedded.
    """
    from IPython.display import HTML  # noqa: PLC0415 (a notebook display; the library needs no IPython)

    reports = [
        r for r in result.reports if r.suffix.startswith(".htm") and r.stem == "result_summary"
    ]
    if not reports:
        raise ToolError(
            f"Model Analyzer wrote no HTML summary report under {result.export_path / 'reports'}; "
            f"its reports: {', '.join(str(r) for r in result.reports) or 'none'}"
        )
    return HTML(reports[0].read_text(encoding="utf-8", errors="replace"))
