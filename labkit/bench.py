"""``labkit bench batching``: one server, one model, one concurrency, dynamic batching off then on.

Both measurements come from the same server process in one run: the model's configuration is
rewritten in a copy of the repository (inside the run folder) and reloaded live between them, so
the only difference is the scheduler. The result is a table and a JSON file with both throughputs,
p50 and p99 latencies, the server's average batch size and the throughput ratio.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from labkit import client, profiling, streaming
from labkit.errors import ConfigError, ToolError
from labkit.repository import Repository, apply_edits
from labkit.repository.models import prepare_repository
from labkit.server import TritonServer, reload, unload
from labkit.soak import server_memory

log = logging.getLogger(__name__)

#: The figures kept per phase (perf_analyzer columns, see :func:`labkit.profiling.perf_analyzer`).
PHASE_FIGURES = (
    "throughput",
    "p50_ms",
    "p99_ms",
    "avg_latency_ms",
    "queue_ms",
    "compute_infer_ms",
    "avg_batch_size",
    "request_count",
    "stable",
)


@dataclass
class BatchingSettings:
    """What the benchmark measures, and how long each measurement window is."""

    model: str = "smollm2"
    concurrency: int = 8
    max_batch_size: int = 8
    max_queue_delay_microseconds: int = 0  # the tutorial's `dynamic_batching {}`
    string_data: str = "Where is the nearest"
    request_parameters: dict = field(default_factory=dict)
    measurement_mode: str = "count_windows"
    measurement_request_count: int | None = None  # default: the concurrency
    measurement_interval_ms: int = 5000
    stability_percentage: float = 30.0
    max_trials: int = 4
    startup_timeout_s: float = 600.0
    timeout_s: float = 900.0


def batching(
    repository: str | os.PathLike,
    run_dir: str | os.PathLike,
    settings: BatchingSettings | None = None,
    *,
    progress: bool = True,
) -> dict:
    """Measure ``settings.model`` with dynamic batching off, then on; return the figures.

    ``repository`` is copied into ``run_dir`` (weights are linked, not copied), so the source
    repository is never changed. Offline models get their weights built first when
    :mod:`labkit.models` knows them.
    """
    s = settings or BatchingSettings()
    if s.concurrency < 1 or s.max_batch_size < 1:
        raise ConfigError(
            f"concurrency ({s.concurrency}) and max_batch_size ({s.max_batch_size}) must be >= 1"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = Repository(repository).copy_to(run_dir / "model_repository")
    prepare_repository(repo.path)
    base = repo.config(s.model)
    off = apply_edits(base, dynamic_batching=False)
    on = apply_edits(
        base,
        max_batch_size=max(base.max_batch_size, s.max_batch_size),
        dynamic_batching=True,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
    )
    repo.write_config(s.model, off)
    result: dict = {
        "model": s.model,
        "concurrency": s.concurrency,
        "max_batch_size": on.max_batch_size,
        "max_queue_delay_microseconds": s.max_queue_delay_microseconds,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "run_dir": str(run_dir),
    }
    started = time.monotonic()
    with TritonServer(
        repo.path,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        load_models=[s.model],
        startup_timeout_s=s.startup_timeout_s,
        log_path=run_dir / "tritonserver.log",
    ) as server:
        for phase, config in (("off", off), ("on", on)):
            reload(server, s.model, config, repository=repo)
            result[phase] = _measure(server, s, phase, run_dir, progress)
    result["throughput_ratio"] = result["on"]["throughput"] / result["off"]["throughput"]
    result["p99_ratio"] = result["on"]["p99_ms"] / result["off"]["p99_ms"]
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _measure(
    server: TritonServer, s: BatchingSettings, phase: str, run_dir: Path, progress: bool
) -> dict:
    before = profiling.metrics(server)
    frame = profiling.perf_analyzer(
        server,
        s.model,
        concurrency=s.concurrency,
        string_data=s.string_data,
        shapes={_input_name(server, s.model): [1]},
        request_parameters=s.request_parameters,
        measurement_mode=s.measurement_mode,
        measurement_request_count=s.measurement_request_count or s.concurrency,
        measurement_interval_ms=s.measurement_interval_ms,
        stability_percentage=s.stability_percentage,
        max_trials=s.max_trials,
        run_dir=run_dir / f"batching-{phase}",
        label=f"batching {phase}",
        timeout_s=s.timeout_s,
        progress=progress,
    )
    row = frame.iloc[0]
    figures = {k: (bool(row[k]) if k == "stable" else float(row[k])) for k in PHASE_FIGURES}
    served = profiling.metrics(server, since=before).set_index("model")
    if s.model in served.index:  # over the whole phase, warm-up included
        figures["server_avg_batch_size"] = float(served.loc[s.model, "avg_batch_size"])
    frame.to_csv(run_dir / f"batching-{phase}.csv", index=False)
    return figures


def _input_name(server: TritonServer, model: str) -> str:
    with server.client() as client:
        inputs = client.get_model_metadata(model).get("inputs", [])
    if len(inputs) != 1:
        raise ConfigError(
            f"the batching benchmark sends one text input, but {model!r} has "
            f"{len(inputs)} inputs; pick a text-generation model such as smollm2"
        )
    return inputs[0]["name"]


def table(result: dict) -> str:
    """The result as a small text table."""
    rows = [
        ("", "batching off", "batching on"),
        *[
            (name, f"{result['off'][key]:.2f}", f"{result['on'][key]:.2f}")
            for name, key in (
                ("throughput (infer/s)", "throughput"),
                ("p50 latency (ms)", "p50_ms"),
                ("p99 latency (ms)", "p99_ms"),
                ("queue (ms)", "queue_ms"),
                ("compute infer (ms)", "compute_infer_ms"),
                ("average batch size", "avg_batch_size"),
            )
        ],
        ("stable measurement", str(result["off"]["stable"]), str(result["on"]["stable"])),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, width, strict=True))
        )
        for r in rows
    ]
    lines.append(
        f"{result['model']} at concurrency {result['concurrency']}: throughput x"
        f"{result['throughput_ratio']:.2f} with dynamic batching, p99 x{result['p99_ratio']:.2f}"
    )
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------


# -- labkit bench inflight ----------------------------------------------------------------------
#: The three ways the lab serves its text model, and the folders each one's clients reach.
SCHEDULERS = ("none", "dynamic", "inflight")
WORKLOADS = ("fixed16", "mixed")
#: What the issue asks of in-flight batching (float32, quiet 2-core host). The bench reports them
#: next to the figures and never asserts them: a benchmark is not a test of the machine.
TARGETS = {
    "inflight_vs_dynamic_output_tokens_per_s_c8_mixed": (">=", 2.0),
    "inflight_ttft_p99_vs_dynamic_c8_mixed": ("<=", 0.33),
    "inflight_ttft_p50_s_c4_streaming": ("<=", 1.0),
    "inflight_served_vs_limit_c8_mixed": (">=", 0.8),
    "failed_requests": ("==", 0),
}
#: The in-flight engine's limits (config.pbtxt parameters of smollm2_inflight) and their defaults,
#: as ``inflight.Limits`` has them in the model code (tests/test_inflight.py keeps them equal).
ENGINE_LIMITS = {
    "max_running_requests": 16,
    "kv_page_size": 16,
    "kv_blocks": 256,
    "max_batch_tokens": 64,
    "max_queue_size": 64,
}


def serving_threads() -> int:
    """torch threads per served model: one less than this host's usable cores (at least 1).

    Measured on 2 cores, AIPerf on the same host: torch's default (2 threads) served 8 output
    tokens/s, 1 thread 51-55 (``inflight.serving_threads`` in the model code says more).
    Every scheduler of the benchmark gets the same number, so that they compare fairly.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(1, cores - 1)


@dataclass
class InflightSettings:
    """One server, one run: every scheduler against the same workloads and clients."""

    model: str = "smollm2"  # the plain folder: no batching, and the base of dynamic batching
    inflight_model: str = "smollm2_inflight"  # the in-flight folder (its limits are measured)
    schedulers: tuple[str, ...] = SCHEDULERS
    workloads: tuple[str, ...] = WORKLOADS
    streaming: tuple[bool, ...] = (True, False)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    requests: int = 32  # per level (at least twice the concurrency)
    fixed_tokens: int = 16
    mixed_low: int = 4
    mixed_high: int = 64
    seed: int = 0
    max_batch_size: int = 8  # dynamic batching, as in `labkit bench batching`
    max_queue_delay_microseconds: int = 0
    num_threads: int = field(default_factory=serving_threads)  # torch threads, every scheduler
    limit_concurrency: int = 8  # the in-process limit's concurrency
    precision: bool = True  # float32 against bfloat16, in-process
    answers: int = 16  # prompts whose served in-flight answers are compared with the answer alone
    startup_timeout_s: float = 600.0
    timeout_s: float = 1800.0  # the bound on one AIPerf level

    def check(self) -> InflightSettings:
        unknown = set(self.schedulers) - set(SCHEDULERS) or set(self.workloads) - set(WORKLOADS)
        if unknown:
            raise ConfigError(
                f"unknown scheduler or workload {sorted(unknown)}; schedulers are "
                f"{', '.join(SCHEDULERS)}, workloads {', '.join(WORKLOADS)}"
            )
        if not self.concurrency or min(self.concurrency) < 1 or self.requests < 1:
            raise ConfigError(
                f"concurrency {list(self.concurrency)} and requests ({self.requests}) must be >= 1"
            )
        if not self.streaming:
            raise ConfigError("choose streaming clients, non-streaming clients, or both")
        return self


def workload(name: str, s: InflightSettings) -> profiling.Workload:
    """The benchmark's workload ``name``: the same prompts and lengths for every scheduler."""
    count = max(s.requests, 2 * max(s.concurrency))
    if name == "fixed16":
        return profiling.fixed_workload(count, s.fixed_tokens, s.seed)
    return profiling.mixed_workload(count, s.mixed_low, s.mixed_high, s.seed)


def scheduler_configs(repo: Repository, s: InflightSettings) -> dict[str, dict[bool, str]]:
    """Write each scheduler's model folders into the run's repository copy.

    Returns scheduler -> {streaming clients?: model name}. No batching and dynamic batching
    need a decoupled twin for streaming clients; the in-flight model serves both kinds.
    """
    base = repo.config(s.model)
    params = {"num_threads": str(s.num_threads)} if s.num_threads else {}
    plain = apply_edits(base, dynamic_batching=False, parameters=params)
    dynamic = apply_edits(
        base,
        max_batch_size=max(base.max_batch_size, s.max_batch_size),
        dynamic_batching=True,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
        parameters=params,
    )
    names: dict[str, dict[bool, str]] = {}
    for scheduler, config in (("none", plain), ("dynamic", dynamic)):
        names[scheduler] = {}
        for streams in (False, True):
            name = f"{s.model}_{scheduler}{'_stream' if streams else ''}"
            variant = type(config)()
            variant.CopyFrom(config)
            variant.model_transaction_policy.decoupled = streams
            if name in repo.models():
                repo.remove(name)
            repo.add_from_template(name, "textgen", variant)
            names[scheduler][streams] = name
    if params:
        repo.write_config(
            s.inflight_model, apply_edits(repo.config(s.inflight_model), parameters=params)
        )
    names["inflight"] = {False: s.inflight_model, True: s.inflight_model}
    prepare_repository(repo.path)
    return names


def inflight(
    repository: str | os.PathLike,
    run_dir: str | os.PathLike,
    settings: InflightSettings | None = None,
    *,
    progress: bool = True,
) -> dict:
    """Serve the text model three ways on one server and measure each with AIPerf.

    The schedulers are measured one after another (each one's models loaded, then unloaded) on
    the same workloads; then, with the server stopped, the in-process limit (the same engine on
    the same prompts, without Triton) and the precision figures. Returns the figures (see
    :func:`inflight_table`); ``<run_dir>/inflight.json`` gets them too.
    """
    s = (settings or InflightSettings()).check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = Repository(repository).copy_to(run_dir / "model_repository")
    prepare_repository(repo.path)
    names = scheduler_configs(repo, s)
    limits = engine_limits(repo.config(s.inflight_model))
    workloads = {name: workload(name, s) for name in s.workloads}
    result: dict = {
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(s).items()},
        "engine_limits": limits,
        "host": host_info(),
        "run_dir": str(run_dir),
    }
    started = time.monotonic()
    with TritonServer(
        repo.path,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        load_models=[],
        startup_timeout_s=s.startup_timeout_s,
        log_path=run_dir / "tritonserver.log",
    ) as server:
        reference = _reference_answers(server, names, workloads, s)

        def check_answers(scheduler: str) -> None:
            if scheduler != "inflight":
                return
            if reference:
                result["answers"] = _served_answers(server, s.inflight_model, reference, s)
            if "mixed" in workloads:  # the same level without AIPerf: what the client costs
                result["light_client"] = light_client(
                    server, s.inflight_model, workloads["mixed"], s.limit_concurrency
                )

        rows = compare_schedulers(
            server, names, workloads, s, progress=progress, then=check_answers
        )
        result["load_average_after_serving"] = [round(x, 2) for x in os.getloadavg()]
    result["results"] = rows
    result["limit"], figures = inprocess_figures(repo, s, workloads)
    if figures is not None:
        result["precision"] = figures
    result["ratios"] = ratios(rows, result["limit"])
    if "light_client" in result and "mixed" in result["limit"]:
        result["ratios"]["inflight_light_client_vs_limit_mixed"] = _ratio(
            result["light_client"]["output_tokens_per_s"],
            result["limit"]["mixed"]["output_tokens_per_s"],
        )
    result["targets"] = targets(result["ratios"])
    result["host"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - started, 1)
    (run_dir / "inflight.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def engine_limits(config) -> dict[str, int]:
    """The in-flight engine's limits that a model config sets (its parameters, else defaults)."""
    params = {key: value.string_value for key, value in config.parameters.items()}
    return {name: int(params.get(name, default)) for name, default in ENGINE_LIMITS.items()}


def host_info() -> dict:
    """Cores, CPU model, bfloat16 support, memory and load average: the context of the figures."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), "x86_64"):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "avx512_bf16": "avx512_bf16" in flags.split(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "machine": platform.machine(),
    }


def _warm(server: TritonServer, model: str) -> None:
    """Two short answers, through the endpoint the model serves, before it is measured."""
    decoupled = streaming.is_streaming(server.http_url, model)
    for _ in range(2):
        if decoupled:  # "stream" makes the in-flight model stream too
            "".join(streaming.stream(server.http_url, model, "Hello", max_tokens=2, stream=True))
        else:
            client.generate(server.http_url, model, "Hello", max_tokens=2)


def compare_schedulers(
    server: TritonServer,
    names: dict[str, dict[bool, str]],
    workloads: dict[str, profiling.Workload],
    s: InflightSettings,
    *,
    progress: bool = True,
    then=None,
) -> list[dict]:
    """Each scheduler in turn on one server: load its models, warm them, run AIPerf on every
    workload and client kind, call ``then(scheduler)`` while they are loaded, unload them."""
    rows: list[dict] = []
    for scheduler in s.schedulers:
        models = sorted({names[scheduler][streams] for streams in s.streaming})
        for model in models:
            server.load_model(model)
            _warm(server, model)
        rows += _measure_scheduler(server, scheduler, names[scheduler], workloads, s, progress)
        if then is not None:
            then(scheduler)
        for model in models:
            unload(server, model)
    return rows


def _measure_scheduler(
    server: TritonServer,
    scheduler: str,
    names: dict[bool, str],
    workloads: dict[str, profiling.Workload],
    s: InflightSettings,
    progress: bool,
) -> list[dict]:
    """AIPerf on every workload and client kind of one (loaded) scheduler; one row per level."""
    rows = []
    run_dir = Path(server.log_path).parent / "aiperf"
    for wname, w in workloads.items():
        for streams in s.streaming:
            label = f"{scheduler}-{wname}-{'stream' if streams else 'generate'}"
            frame = profiling.run_aiperf(
                server,
                names[streams],
                w,
                concurrency=s.concurrency,
                streaming=streams,
                run_dir=run_dir,
                label=label,
                timeout_s=s.timeout_s,
                progress=progress,
            )
            for record in frame.to_dict("records"):
                row = {"scheduler": scheduler, "model": names[streams], **_row(record)}
                rows.append({**row, "artifact_dir": record["artifact_dir"]})
    return rows


ROW_FIGURES = (
    "workload",
    "streaming",
    "concurrency",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "request_p50_ms",
    "request_p99_ms",
    "requests",
    "failed",
    "wall_s",
    "aiperf_cpu_s",
    "server_cpu_s",
    "aiperf_cpu_share",
)


def _row(record: dict) -> dict:
    row = {}
    for key in ROW_FIGURES:
        value = record.get(key)
        if isinstance(value, float):
            value = None if value != value else round(value, 3)
        elif hasattr(value, "item"):
            value = value.item()
        row[key] = value
    return row


def _reference_answers(server, names, workloads, s: InflightSettings) -> dict:
    """The plain model's answer to each prompt alone (one at a time): what in-flight must give."""
    if "inflight" not in s.schedulers or not s.answers:
        return {}
    w = workloads.get("mixed") or next(iter(workloads.values()))
    pairs = list(dict.fromkeys(zip(w.prompts, w.max_tokens, strict=True)))[: s.answers]
    model = names["none"][False]
    server.load_model(model)
    try:
        return {
            pair: client.generate(server.http_url, model, pair[0], max_tokens=pair[1]).text
            for pair in pairs
        }
    finally:
        unload(server, model)


def _served_answers(server, model: str, reference: dict, s: InflightSettings) -> dict:
    """The in-flight model's answers under concurrency, streamed and not, against the alone ones."""

    def whole(pair):
        return client.generate(server.http_url, model, pair[0], max_tokens=pair[1]).text

    def streamed(pair):
        pieces = streaming.stream(server.http_url, model, pair[0], max_tokens=pair[1], stream=True)
        return "".join(pieces)

    figures: dict = {"compared": len(reference), "concurrency": s.limit_concurrency}
    for kind, call in (("nonstreaming", whole), ("streaming", streamed)):
        with ThreadPoolExecutor(s.limit_concurrency) as pool:
            got = dict(zip(reference, pool.map(call, reference), strict=True))
        differing = [pair[0] for pair, text in got.items() if text != reference[pair]]
        figures[f"equal_{kind}"] = len(reference) - len(differing)
        figures[f"differing_{kind}"] = differing[:3]
    return figures


def light_client(server, model: str, w: profiling.Workload, concurrency: int) -> dict:
    """The workload streamed by ``concurrency`` threads of this process (labkit.streaming), not
    AIPerf: output tokens/s and the CPU seconds the client and the server used. Next to AIPerf's
    row at the same level, it says how much of the gap to the in-process limit is the client's."""
    lock, pending, tokens = threading.Lock(), list(range(len(w))), [0]

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop(0)
            got = streaming.responses(
                server.http_url, model, w.prompts[i], max_tokens=w.max_tokens[i], stream=True
            )
            count = sum(1 for _ in got) - 1  # one response per token, then the closing one
            with lock:
                tokens[0] += count

    server_before, client_before = profiling.server_cpu_s(server), time.process_time()
    started = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": round(tokens[0] / seconds, 2),
        "seconds": round(seconds, 2),
        "client_cpu_s": round(time.process_time() - client_before, 2),
        "server_cpu_s": round(profiling.server_cpu_s(server) - server_before, 2),
    }


# -- the in-process limit and the precision figures (no Triton) ---------------------------------
def load_model(weights: str | os.PathLike, dtype: str = "float32", num_threads: int = 0):
    """``(model, tokenizer)`` of a local checkpoint, in ``dtype``, for in-process figures."""
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (a model library: importing labkit loads none)

    if num_threads:
        torch.set_num_threads(num_threads)
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(weights, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=getattr(torch, dtype)).eval()
    return model, tokenizer


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars and no engine chatter on stderr (a notebook cell shows no stderr)."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 (a model library: importing labkit loads none)

    engine = logging.getLogger("ContinuousBatchingLogger")
    level, verbosity = engine.level, hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    engine.setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        engine.setLevel(level)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def inprocess_figures(repo: Repository, settings: InflightSettings, workloads: dict) -> tuple:
    """``(limit, precision)`` of the in-flight model's weights, without Triton: the engine's
    output tokens/s per workload, and float32 against bfloat16 (None when not asked)."""
    s = settings
    weights = profiling.model_weights(repo.path, s.inflight_model)
    if weights is None:
        raise ConfigError(
            f"{s.inflight_model!r} loads no local folder; the in-process limit needs its weights"
        )
    limits = engine_limits(repo.config(s.inflight_model))
    model32, tokenizer = load_model(weights, "float32", s.num_threads)
    limit = {
        name: inprocess_limit(model32, tokenizer, w, s.limit_concurrency, limits)
        for name, w in workloads.items()
    }
    figures = None
    if s.precision:
        w = workloads.get("mixed") or next(iter(workloads.values()))
        figures = precision(weights, model32, tokenizer, w, limits, s)
    return limit, figures


def engine_config(limits: dict[str, int]) -> dict:
    """transformers' ``ContinuousBatchingConfig`` arguments for ``limits``: the served engine's
    (``inflight.engine_settings`` in the model code; tests/test_inflight.py keeps them equal)."""
    return {
        "page_size": limits["kv_page_size"],
        "num_blocks": limits["kv_blocks"],
        "max_batch_tokens": limits["max_batch_tokens"],
        "max_requests_per_batch": limits["max_running_requests"],
        "allow_block_sharing": False,
        "auto_switch_to_flash": False,
        "safety_margin": 0.0,
    }


def engine_run(model, tokenizer, w: profiling.Workload, concurrency: int, limits: dict) -> dict:
    """The in-flight engine alone: ``concurrency`` clients, each sending the workload's next
    request when its previous one is answered (as AIPerf's clients do). Tokens and answers."""
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)
    from transformers import GenerationConfig  # noqa: PLC0415 (a model library: importing labkit loads none)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: PLC0415 (a model library: importing labkit loads none)

    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    ids = [tokenizer(prompt)["input_ids"] for prompt in w.prompts]
    with quiet_transformers():
        with torch.inference_mode():
            manager = model.init_continuous_batching(
                generation_config=GenerationConfig(
                    max_new_tokens=max(w.max_tokens),
                    do_sample=False,
                    eos_token_id=sorted(eos_ids) or -1,
                    pad_token_id=tokenizer.pad_token_id,
                ),
                continuous_batching_config=ContinuousBatchingConfig(**engine_config(limits)),
            )
            manager.start()
        try:
            manager.add_request(ids[0], request_id="warmup", max_new_tokens=2)
            _wait(manager, {"warmup"})
            answers, seconds = _closed_loop(manager, ids, w.max_tokens, concurrency, eos_ids)
        finally:
            manager.stop(block=True, timeout=60)
    tokens = sum(len(a) for a in answers)
    return {
        "output_tokens_per_s": round(tokens / seconds, 2),
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "requests": len(ids),
        "concurrency": concurrency,
        "answers": answers,
    }


def _closed_loop(manager, ids, max_tokens, concurrency: int, eos_ids: set[int]) -> tuple:
    """``(each request's new tokens up to EOS, seconds)`` with ``concurrency`` in flight."""
    answers: dict[int, list[int]] = {}
    sent = 0

    def send() -> None:
        nonlocal sent
        manager.add_request(ids[sent], request_id=str(sent), max_new_tokens=max_tokens[sent])
        sent += 1

    started = time.perf_counter()
    for _ in range(min(concurrency, len(ids))):
        send()
    while len(answers) < len(ids):
        result = manager.get_result(timeout=120)
        if result is None or result.error:
            reason = result.error if result else "no output for 120 s"
            raise ToolError(f"the in-process engine failed: {reason}")
        if result.is_finished() and result.request_id.isdigit():
            tokens = list(result.generated_tokens)
            cut = next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
            answers[int(result.request_id)] = tokens[:cut]
            if sent < len(ids):
                send()
    return [answers[i] for i in range(len(ids))], time.perf_counter() - started


def _wait(manager, ids: set[str]) -> None:
    while ids:
        result = manager.get_result(timeout=120)
        if result is None:
            raise ToolError("the in-process engine gave no output for 120 s")
        if result.is_finished():
            ids.discard(result.request_id)


def alone_answers(model, tokenizer, w: profiling.Workload) -> list[list[int]]:
    """Each request's greedy answer with ``generate``, one at a time (the reference)."""
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    answers = []
    with torch.inference_mode():
        for prompt, tokens in zip(w.prompts, w.max_tokens, strict=True):
            batch = tokenizer(prompt, return_tensors="pt")
            out = model.generate(
                **batch, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            new = out[0, batch["input_ids"].shape[1] :].tolist()
            cut = next((i for i, t in enumerate(new) if t in eos_ids), len(new))
            answers.append(new[:cut])
    return answers


def inprocess_limit(
    model, tokenizer, w: profiling.Workload, concurrency: int, limits: dict
) -> dict:
    """What the engine does without Triton on the benchmark's prompts: its output tokens/s."""
    figures = engine_run(model, tokenizer, w, concurrency, limits)
    figures.pop("answers")
    return figures


def precision(
    weights: Path, model32, tokenizer, w: profiling.Workload, limits: dict, s: InflightSettings
) -> dict:
    """float32 against bfloat16 on the engine: speed, and agreement of the greedy answers with
    the answer alone (same dtype) and with float32's answer alone."""
    subset = profiling.Workload(w.name, w.prompts[: s.answers], w.max_tokens[: s.answers])
    reference = alone_answers(model32, tokenizer, subset)
    figures: dict = {"compared": len(subset), "concurrency": s.limit_concurrency}
    for dtype in ("float32", "bfloat16"):
        model = model32 if dtype == "float32" else load_model(weights, dtype)[0]
        alone = reference if dtype == "float32" else alone_answers(model, tokenizer, subset)
        run = engine_run(model, tokenizer, subset, s.limit_concurrency, limits)
        figures[dtype] = {
            "output_tokens_per_s": run["output_tokens_per_s"],
            "equal_alone": sum(a == b for a, b in zip(run["answers"], alone, strict=True)),
            "equal_float32": sum(a == b for a, b in zip(run["answers"], reference, strict=True)),
            "alone_equal_float32": sum(a == b for a, b in zip(alone, reference, strict=True)),
        }
    figures["bfloat16_speedup"] = round(
        figures["bfloat16"]["output_tokens_per_s"] / figures["float32"]["output_tokens_per_s"], 2
    )
    return figures


# -- what the figures say -------------------------------------------------------------------------
def _pick(rows: list[dict], scheduler: str, workload: str, streams: bool, concurrency: int):
    for row in rows:
        if (row["scheduler"], row["workload"], row["streaming"], row["concurrency"]) == (
            scheduler,
            workload,
            streams,
            concurrency,
        ):
            return row
    return None


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(rows: list[dict], limit: dict, concurrency: int = 8) -> dict:
    """The ratios the targets are about (None where the run did not measure both sides).

    The targets are set at concurrency 8 on the mixed workload; notebook 06, sized for a CPU,
    asks for its own ``concurrency`` (the names then say ``c<concurrency>``).
    """
    out: dict = {}
    c = concurrency
    for streams, suffix in ((True, ""), (False, "_nonstreaming")):
        inflight, dynamic = (_pick(rows, k, "mixed", streams, c) for k in ("inflight", "dynamic"))

        def get(row, key):
            return row.get(key) if row else None

        out[f"inflight_vs_dynamic_output_tokens_per_s_c{c}_mixed{suffix}"] = _ratio(
            get(inflight, "output_tokens_per_s"), get(dynamic, "output_tokens_per_s")
        )
        out[f"inflight_ttft_p99_vs_dynamic_c{c}_mixed{suffix}"] = _ratio(
            get(inflight, "ttft_p99_ms"), get(dynamic, "ttft_p99_ms")
        )
        out[f"inflight_served_vs_limit_c{c}_mixed{suffix}"] = _ratio(
            get(inflight, "output_tokens_per_s"),
            limit.get("mixed", {}).get("output_tokens_per_s"),
        )
    c4 = _pick(rows, "inflight", "fixed16", True, 4) or _pick(rows, "inflight", "mixed", True, 4)
    out["inflight_ttft_p50_s_c4_streaming"] = (
        round(c4["ttft_p50_ms"] / 1000, 3) if c4 and c4.get("ttft_p50_ms") is not None else None
    )
    out["failed_requests"] = sum(int(row.get("failed") or 0) for row in rows)
    return out


def targets(measured: dict, concurrency: int = 8) -> dict:
    """Each target next to what was measured, and whether it was met (None: not measured)."""
    out = {}
    for name, (op, value) in TARGETS.items():
        name = name.replace("_c8_", f"_c{concurrency}_")
        got = measured.get(name)
        met = None
        if got is not None:
            met = {">=": got >= value, "<=": got <= value, "==": got == value}[op]
        out[name] = {"target": f"{op} {value:g}", "measured": got, "met": met}
    return out


def inflight_table(result: dict) -> str:
    """The figures as text: one line per measured row, then the limit, ratios and context."""
    head = ("scheduler", "workload", "clients", "c", "tok/s", "req/s", "TTFT p50", "TTFT p99",
            "ITL p50", "req p99", "failed", "aiperf CPU")  # fmt: skip
    lines = [head]
    for r in result["results"]:
        share = r.get("aiperf_cpu_share")
        lines.append(
            (
                r["scheduler"],
                r["workload"],
                "stream" if r["streaming"] else "whole",
                str(r["concurrency"]),
                *(_fmt(r.get(k)) for k in ("output_tokens_per_s", "requests_per_s")),
                *(
                    _fmt(r.get(k), 0)
                    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "request_p99_ms")
                ),
                str(r.get("failed")),
                f"{share:.0%}" if share is not None else "-",
            )
        )
    width = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [
        "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, width, strict=True))
        )
        for line in lines
    ]
    text.append(
        "(latencies in ms; aiperf CPU: AIPerf's CPU time over the level's wall time, of all cores)"
    )
    for name, figures in result.get("limit", {}).items():
        text.append(
            f"in-process limit, {name}, c{figures['concurrency']}: {figures['output_tokens_per_s']:.1f} tok/s"
        )
    for name, t in result.get("targets", {}).items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        text.append(f"{name}: {t['measured']} (target {t['target']}: {verdict})")
    p = result.get("precision")
    if p:
        for dtype in ("float32", "bfloat16"):
            d = p[dtype]
            text.append(
                f"{dtype}: {d['output_tokens_per_s']:.1f} tok/s in-process; greedy answers equal to "
                f"the answer alone {d['equal_alone']}/{p['compared']}, to float32's "
                f"{d['equal_float32']}/{p['compared']}"
            )
    light = result.get("light_client")
    if light:
        text.append(
            f"the same in-flight level without AIPerf (labkit's own streaming client, "
            f"c{light['concurrency']}): {light['output_tokens_per_s']:.1f} tok/s, client CPU "
            f"{light['client_cpu_s']} s, server CPU {light['server_cpu_s']} s in {light['seconds']} s"
        )
    a = result.get("answers")
    if a:
        text.append(
            f"in-flight answers under concurrency {a['concurrency']} equal to the answer alone: "
            f"{a['equal_nonstreaming']}/{a['compared']} whole, {a['equal_streaming']}/{a['compared']} streamed"
        )
    h = result["host"]
    text.append(
        f"host: {h['cores']} cores ({h['cpu_model']}), load average {h['load_average_start']} at the "
        f"start, {h.get('load_average_end')} at the end; {result.get('wall_s')} s in all"
    )
    return "\n".join(text)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# -- labkit bench inflight-soak -------------------------------------------------------------------
@dataclass
class InflightSoakSettings:
    """Many streams for a while on the in-flight model (the issue's soak: 64 streams, 60 s)."""

    model: str = "smollm2_inflight"
    concurrency: int = 64
    duration_s: float = 60.0
    memory_window_s: float = 20.0
    streaming: bool = True
    startup_timeout_s: float = 600.0

    def check(self) -> InflightSoakSettings:
        if self.concurrency < 1 or not 0 < 2 * self.memory_window_s <= self.duration_s:
            raise ConfigError(
                f"concurrency {self.concurrency} must be >= 1 and duration_s="
                f"{self.duration_s:g} must hold two memory windows of {self.memory_window_s:g} s"
            )
        return self


def inflight_soak(
    repository: str | os.PathLike,
    run_dir: str | os.PathLike,
    settings: InflightSoakSettings | None = None,
) -> dict:
    """AIPerf keeps ``concurrency`` streams on the model for ``duration_s`` while the resident
    memory of tritonserver and its stubs is sampled each second. Figures, never a verdict of
    speed: requests answered and failed (refused busy included), tokens/s, memory growth."""
    s = (settings or InflightSoakSettings()).check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = Repository(repository).copy_to(run_dir / "model_repository")
    prepare_repository(repo.path)
    result: dict = {"settings": asdict(s), "host": host_info()}
    samples: list[tuple[float, int]] = []
    with TritonServer(
        repo.path,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        load_models=[s.model],
        startup_timeout_s=s.startup_timeout_s,
        log_path=run_dir / "tritonserver.log",
    ) as server:
        _warm(server, s.model)
        done = threading.Event()
        outcome: dict = {}

        def load() -> None:
            try:
                outcome["frame"] = profiling.run_aiperf(
                    server,
                    s.model,
                    profiling.mixed_workload(max(64, s.concurrency)),
                    concurrency=s.concurrency,
                    streaming=s.streaming,
                    duration_s=s.duration_s,
                    run_dir=run_dir / "aiperf",
                    label="soak",
                    timeout_s=s.duration_s * 5 + 300,
                    progress=False,
                )
            except Exception as exc:  # noqa: BLE001 (reported in the figures)
                outcome["error"] = str(exc)
            finally:
                done.set()

        started = time.monotonic()
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        while not done.wait(1.0):
            samples.append((round(time.monotonic() - started, 1), server_memory(server.pid)))
        worker.join()
        stats = [line for line in server.log_tail(400).splitlines() if "in-flight engine" in line]
    if "frame" in outcome:
        row = _row(outcome["frame"].iloc[0].to_dict())
        result.update({k: row[k] for k in ("requests", "failed", "output_tokens_per_s",
                                           "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                           "itl_p50_ms", "request_p99_ms", "aiperf_cpu_share")})  # fmt: skip
    else:
        result["error"] = outcome.get("error", "AIPerf did not finish")
    result["engine_log"] = stats[-2:]
    result["memory"] = memory_figures(samples, s.memory_window_s)
    result["host"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    (run_dir / "inflight-soak.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def memory_figures(samples: list[tuple[float, int]], window_s: float) -> dict:
    """Mean resident MiB over the first and the last ``window_s`` seconds, growth and peak."""
    end = samples[-1][0] if samples else 0.0
    first = [rss for t, rss in samples if t <= window_s]
    last = [rss for t, rss in samples if t >= end - window_s]
    figures: dict = {"samples": len(samples), "seconds": end}
    if first and last:
        first_mib, last_mib = statistics.fmean(first) / 2**20, statistics.fmean(last) / 2**20
        figures.update(
            first_window_mib=round(first_mib, 1),
            last_window_mib=round(last_mib, 1),
            growth_percent=round((last_mib - first_mib) / first_mib * 100, 2),
            peak_mib=round(max(rss for _, rss in samples) / 2**20, 1),
        )
    return figures


def soak_table(result: dict) -> str:
    s, m = result["settings"], result["memory"]
    rows = [
        f"{s['model']}: {s['concurrency']} {'streams' if s['streaming'] else 'clients'} for "
        f"{s['duration_s']:g} s",
        f"requests {result.get('requests')}, failed {result.get('failed')} (busy refusals count)",
        f"output tokens/s {result.get('output_tokens_per_s')}, TTFT p50/p99 "
        f"{result.get('ttft_p50_ms')}/{result.get('ttft_p99_ms')} ms",
        f"resident memory first/last {s['memory_window_s']:g} s: {m.get('first_window_mib')}/"
        f"{m.get('last_window_mib')} MiB ({m.get('growth_percent')}%), peak {m.get('peak_mib')}",
        f"load average {result['host']['load_average_start']} -> "
        f"{result['host'].get('load_average_end')} on {result['host']['cores']} cores",
    ]
    if "error" in result:
        rows.append(f"error: {result['error']}")
    return "\n".join(rows)


# -- for notebook 06 ----------------------------------------------------------------------------
def results_frame(rows: list[dict]):
    """The measured rows as a DataFrame, one line per scheduler, workload, client kind and level."""
    import pandas as pd  # noqa: PLC0415 (tables load when a notebook asks)

    columns = ["scheduler", "workload", "streaming", "concurrency", "output_tokens_per_s",
               "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "request_p99_ms",
               "failed", "aiperf_cpu_share"]  # fmt: skip
    return pd.DataFrame(rows)[columns]


def targets_frame(result: dict):
    """The targets next to what was measured, as a table."""
    import pandas as pd  # noqa: PLC0415 (tables load when a notebook asks)

    return pd.DataFrame(
        [{"figure": name, **figures} for name, figures in result["targets"].items()]
    ).set_index("figure")


def timeline_figure(records: dict, title: str | None = None):
    """One bar per request from when it was sent to its last token, a dot at its first token;
    one panel per scheduler (``records``: name -> :func:`labkit.profiling.request_records`)."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    fig = make_subplots(rows=len(records), cols=1, shared_xaxes=True, subplot_titles=list(records))
    for i, (name, frame) in enumerate(records.items(), start=1):
        fig.add_trace(
            go.Bar(
                base=frame["start_s"],
                x=frame["end_s"] - frame["start_s"],
                y=frame["request"],
                orientation="h",
                name=f"{name}: waiting and generating",
                marker_color="#8c8c8c" if i < len(records) else "#76b900",
                showlegend=False,
            ),
            row=i,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=frame["first_token_s"],
                y=frame["request"],
                mode="markers",
                marker={"color": "black", "size": 5},
                name="first token",
                showlegend=i == 1,
            ),
            row=i,
            col=1,
        )
        fig.update_yaxes(title_text="request", autorange="reversed", row=i, col=1)
    fig.update_xaxes(title_text="seconds since the first request", row=len(records), col=1)
    fig.update_layout(
        title=title or "Each request from arrival to its last token (dot: first token)",
        height=260 * len(records),
    )
    return fig


def schedulers_figure(rows: list[dict], title: str | None = None):
    """Output tokens/s, TTFT p50 and p99 and ITL p50 of each scheduler, side by side."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    panels = [("output_tokens_per_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p50_ms", "ITL p50 (ms)")]  # fmt: skip
    frame = results_frame(rows)
    frame = frame.assign(label=frame["workload"] + ", c" + frame["concurrency"].astype(str)
                         + frame["streaming"].map({True: "", False: " whole"}))  # fmt: skip
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for _, t in panels])
    colours = {"none": "#8c8c8c", "dynamic": "#1f77b4", "inflight": "#76b900"}
    for col, (key, _) in enumerate(panels, start=1):
        for scheduler, part in frame.groupby("scheduler", sort=False):
            fig.add_trace(
                go.Bar(
                    x=part["label"],
                    y=part[key],
                    name=scheduler,
                    showlegend=col == 1,
                    marker_color=colours.get(scheduler),
                ),  # fmt: skip
                row=1,
                col=col,
            )
    fig.update_layout(barmode="group", title=title or "Three schedulers, the same workload")
    return fig


def precision_figure(figures: dict, title: str | None = None):
    """Speed against agreement: tokens/s and greedy answers equal to float32's, per dtype."""
    import plotly.graph_objects as go  # noqa: PLC0415 (plotting loads when a chart is drawn)
    from plotly.subplots import make_subplots  # noqa: PLC0415 (plotting loads when a chart is drawn)

    dtypes = ["float32", "bfloat16"]
    total = figures["compared"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["output tokens/s (in-process)",
                        f"greedy answers of {total} equal to ..."])  # fmt: skip
    fig.add_trace(
        go.Bar(
            x=dtypes,
            y=[figures[d]["output_tokens_per_s"] for d in dtypes],
            marker_color=["#1f77b4", "#ff7f0e"],
            showlegend=False,
        ),  # fmt: skip
        row=1,
        col=1,
    )
    for key, name in (("equal_alone", "the answer alone, same dtype"),
                      ("equal_float32", "float32's answer alone")):  # fmt: skip
        fig.add_trace(
            go.Bar(x=dtypes, y=[figures[d][key] for d in dtypes], name=name), row=1, col=2
        )
    fig.update_yaxes(range=[0, total], row=1, col=2)
    fig.update_layout(barmode="group", title=title or "Precision: speed against agreement")
    return fig


def stream_boxes(server, model: str, prompts: list[str], prompt_ui, *, max_tokens: int = 24):
    """One prompt box per prompt on ``model``, all generating at once, streamed (``stream``).

    ``prompt_ui`` is :class:`labkit.widgets.PromptUI` (passed in: the command line, which
    imports this module, loads no widget library). Returns ``(box, uis)``: the boxes side by
    side, and each box (its ``output.value`` is its answer, ``error`` when its first text came).
    """
    import ipywidgets as w  # noqa: PLC0415 (widgets load when a notebook shows them)

    def generate(prompt: str, **params):
        return streaming.stream(server.http_url, model, prompt, stream=True, **params)

    uis = [prompt_ui(generate, prompt=p, max_tokens=max_tokens) for p in prompts]
    threads = [threading.Thread(target=ui.on_generate) for ui in uis]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return w.HBox([ui.widget for ui in uis]), uis
