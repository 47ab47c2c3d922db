"""AIPerf: what an LLM's users feel (time to first token, inter-token latency, tokens per second).

perf_analyzer (:mod:`.perf`) counts inferences per second; a text model's users wait for tokens.
AIPerf, NVIDIA's LLM benchmark (genai-perf's successor), measures those against Triton's
``/v2/models/<m>/generate_stream`` (streaming clients) or ``/generate`` (one answer each) through
its *template* endpoint. It lives in its own environment, ``.venv-aiperf`` (``make install``
pins ``aiperf==0.13.0`` there): it needs numpy 2, and the server's environment needs numpy<2.

Offline, as these machines are: AIPerf is given a local tokenizer folder (a served model's
``weights``), ``HF_HUB_OFFLINE`` is left unset for it (set, AIPerf hands the local path to
``snapshot_download``) and ``HF_ENDPOINT`` points at a closed loopback port, so that its hub
lookup of the name fails at once. The request body is a Jinja template in a file (given inline,
AIPerf cuts it at its first comma).

:func:`run_aiperf` runs one AIPerf per concurrency level on a :class:`Workload` (each request's prompt
and ``max_tokens``, in order) and returns one row per level: TTFT, ITL, request latency and
tokens per second per user at p50/p90/p99, output tokens/s and requests/s over the run, failed
requests, and what the measurement cost: AIPerf's own CPU seconds against the server's, with
the host's core count. AIPerf runs several processes; on a 2-core host they compete with the
server for the CPU, and those columns say how much. Every level's exports (AIPerf's CSV and JSON,
``profile_export.jsonl`` with one record per request, its log) stay in ``run_dir``;
:func:`request_records` reads the per-request records (arrival, first token, end) for a timeline.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import psutil

from labkit import proc
from labkit.errors import ConfigError, MissingDependencyError, ToolError
from labkit.profiling.perf import LEVELS_BAR
from labkit.repository import CONFIG_FILE, read_config
from labkit.settings import project_root

log = logging.getLogger(__name__)

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = ".venv-aiperf"
#: A closed loopback port: AIPerf's hub lookups fail at once instead of waiting on a network.
NO_HUB = "http://127.0.0.1:9"
TEMPLATE = (
    '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens or 16 }}, '
    '"return_full_text": false, "stream": %s}\n'
)
#: AIPerf's metrics kept per level, and the names labkit gives them (``<name>_p50`` ...).
PERCENTILE_METRICS = {
    "time_to_first_token": "ttft",
    "inter_token_latency": "itl",
    "request_latency": "request",
    "output_token_throughput_per_user": "tokens_per_user",
}
PERCENTILES = ("p50", "p90", "p99")
#: Open-ended prompts (a model keeps writing after them), picked from with the workload's seed.
PROMPTS = (
    "Once upon a time there was",
    "Tell me a story about a dragon who",
    "Where is the nearest",
    "I am going to",
    "The best way to learn a language is",
    "Write a poem about the sea:",
    "The history of the city began when",
    "Explain how a rainbow forms:",
    "My favourite recipe starts with",
    "In the year 2050, people will",
    "The old lighthouse keeper said",
    "Here are three reasons to read books:",
)


@dataclass(frozen=True)
class Workload:
    """What each request sends, in order: its prompt and the new tokens it asks for."""

    name: str
    prompts: tuple[str, ...]
    max_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompts or len(self.prompts) != len(self.max_tokens):
            raise ConfigError(
                f"workload {self.name!r} needs as many max_tokens ({len(self.max_tokens)}) as "
                f"prompts ({len(self.prompts)}), and at least one"
            )
        if min(self.max_tokens) < 1:
            raise ConfigError(f"workload {self.name!r}: every max_tokens must be >= 1")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def total_tokens(self) -> int:
        return sum(self.max_tokens)

    def write(self, path: str | os.PathLike) -> Path:
        """The workload as AIPerf's ``single_turn`` JSONL (``text``, ``output_length``)."""
        path = Path(path)
        lines = [
            json.dumps({"text": prompt, "output_length": tokens})
            for prompt, tokens in zip(self.prompts, self.max_tokens, strict=True)
        ]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path


def fixed_workload(count: int = 32, max_tokens: int = 16, seed: int = 0) -> Workload:
    """``count`` requests that each ask for ``max_tokens`` new tokens."""
    rng = random.Random(seed)
    prompts = tuple(rng.choice(PROMPTS) for _ in range(count))
    return Workload(f"fixed{max_tokens}", prompts, (max_tokens,) * count)


def mixed_workload(count: int = 32, low: int = 4, high: int = 64, seed: int = 0) -> Workload:
    """``count`` requests whose ``max_tokens`` are drawn uniformly from ``low..high`` (seeded)."""
    if not 1 <= low <= high:
        raise ConfigError(f"mixed lengths need 1 <= low <= high, got {low}..{high}")
    rng = random.Random(seed)
    prompts = tuple(rng.choice(PROMPTS) for _ in range(count))
    tokens = tuple(rng.randint(low, high) for _ in range(count))
    return Workload("mixed", prompts, tokens)


def locate_aiperf(explicit: str | os.PathLike | None = None) -> Path:
    """The ``aiperf`` executable: argument > ``<project>/.venv-aiperf`` > ``PATH``."""
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise MissingDependencyError(f"aiperf given as {str(explicit)!r} is not an executable")
    candidates = [
        project_root() / AIPERF_VENV / "bin" / "aiperf",
        Path(found) if (found := shutil.which("aiperf")) else None,
    ]
    for path in candidates:
        if path is not None and path.is_file() and os.access(path, os.X_OK):
            return path
    raise MissingDependencyError(
        f"aiperf not found ({AIPERF_VENV}/bin/aiperf, PATH); `make install` creates its own "
        f"environment, or run `python3 -m venv {AIPERF_VENV} && {AIPERF_VENV}/bin/pip install "
        f"aiperf=={AIPERF_VERSION}` (it needs numpy 2: keep it out of the server's environment)"
    )


def aiperf_environ() -> dict[str, str]:
    """The environment AIPerf runs offline in (see the module's docstring)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_ENDPOINT"] = NO_HUB
    env.pop("VIRTUAL_ENV", None)
    return env


def model_weights(repository: str | os.PathLike, model: str) -> Path | None:
    """The local folder a repository model loads (its ``huggingface_model``), if it has one."""
    folder = Path(repository) / model
    if not (folder / CONFIG_FILE).is_file():
        return None
    params = read_config(folder / CONFIG_FILE).parameters
    source = params["huggingface_model"].string_value if "huggingface_model" in params else ""
    path = Path(source).expanduser() if source else None
    if path is not None and not path.is_absolute():
        path = folder / path
    return path.resolve() if path is not None and (path / "config.json").is_file() else None


def _tokenizer(server, model: str, tokenizer: str | os.PathLike | None) -> str:
    if tokenizer is not None:
        return str(tokenizer)
    repository = getattr(server, "model_repository", None)
    weights = model_weights(repository, model) if repository else None
    if weights is None or not (weights / "tokenizer_config.json").is_file():
        raise ConfigError(
            f"AIPerf counts tokens with the model's tokenizer, and {model!r} has no local "
            "weights folder to read it from; pass tokenizer=<a folder saved with save_pretrained>"
        )
    return str(weights)


def run_aiperf(
    server,
    model: str,
    workload: Workload,
    *,
    concurrency: int | Iterable[int] = 1,
    streaming: bool = True,
    request_count: int | None = None,
    warmup_request_count: int = 0,
    duration_s: float | None = None,
    tokenizer: str | os.PathLike | None = None,
    run_dir: str | os.PathLike,
    label: str | None = None,
    timeout_s: float = 900.0,
    progress: bool = True,
    aiperf_path: str | os.PathLike | None = None,
    openai: bool = False,
    cores: tuple[int, ...] | None = None,
) -> pd.DataFrame:
    """Measure ``model`` with AIPerf at each concurrency level; one row per level.

    ``server`` is a :class:`~labkit.server.TritonServer` (or a ``host:port`` URL with
    ``tokenizer=`` given). Each level sends ``request_count`` requests (default: the workload's
    length, at least twice the concurrency; with ``duration_s``, as many as that many seconds
    take), cycling through ``workload`` in order, to
    ``/generate_stream`` with ``"stream": true`` when ``streaming``, else to ``/generate``.
    Latencies are in milliseconds. Raises :class:`ToolError` with AIPerf's own message.

    ``openai=True`` measures an OpenAI-compatible server instead (vLLM's own, the reference of
    :mod:`labkit.llm_serving.standalone`): ``model`` is the name it serves, the requests go to
    ``/v1/completions`` with the same prompts and lengths, and ``tokenizer=`` is required.

    ``cores`` pins AIPerf's processes to those CPU cores (keep them off the server's).
    """
    levels = sorted({concurrency} if isinstance(concurrency, int) else set(concurrency))
    if not levels or levels[0] < 1:
        raise ConfigError(f"concurrency must be one or more levels >= 1, got {concurrency!r}")
    tool = locate_aiperf(aiperf_path)
    url = server if isinstance(server, str) else server.http_url
    url = url.split("://", 1)[-1].rstrip("/")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    name = label or model
    slug = _slug(name)
    dataset = workload.write(run_dir / f"{_slug(workload.name)}.jsonl")
    if openai:
        if tokenizer is None:
            raise ConfigError("an OpenAI-compatible server needs tokenizer=<the model's folder>")
        how = ["--endpoint-type", "completions"]
    else:
        template = run_dir / f"template-{'stream' if streaming else 'generate'}.json"
        template.write_text(TEMPLATE % ("true" if streaming else "false"), encoding="utf-8")
        endpoint = f"/v2/models/{model}/{'generate_stream' if streaming else 'generate'}"
        how = [
            "--endpoint-type", "template", "--custom-endpoint", endpoint,
            "--extra-inputs", f"payload_template:{template}",
            "--extra-inputs", "response_field:text_output",
        ]  # fmt: skip
    base = [
        str(tool), "profile", "-m", model, "--url", url, *how,
        "--tokenizer", _tokenizer(server, model, tokenizer),
        "--input-file", str(dataset), "--custom-dataset-type", "single_turn",
        "--dataset-sampling-strategy", "sequential", "--random-seed", "0",
        "--ui-type", "none", "--no-server-metrics",
    ]  # fmt: skip
    if duration_s is not None:
        base += ["--benchmark-duration", f"{duration_s:g}"]
    if warmup_request_count:
        base += ["--warmup-request-count", str(warmup_request_count)]
    if streaming:
        base.append("--streaming")

    from tqdm.auto import tqdm  # noqa: PLC0415 (only sweeps need it)

    rows = []
    bar = tqdm(levels, desc=f"aiperf {name}", bar_format=LEVELS_BAR, disable=not progress)
    for level in bar:
        bar.set_postfix(concurrency=level)
        count = request_count or max(len(workload), 2 * level)
        if duration_s is not None and request_count is None:
            count = 1_000_000  # the duration ends the level
        out = run_dir / f"{slug}-c{level}"
        args = [*base, "--concurrency", str(level), "--request-count", str(count)]
        args += ["--artifact-dir", str(out)]
        rows.append(_measure(args, out, server, timeout_s, name, level, cores))
    frame = pd.DataFrame(rows)
    frame.insert(0, "config", name)
    frame.insert(1, "streaming", streaming)
    frame.insert(2, "workload", workload.name)
    frame.attrs.update(run_dir=str(run_dir), model=model, url=url)
    frame.to_csv(run_dir / f"{slug}.csv", index=False)
    log.info("aiperf %s: %d levels, exports in %s", name, len(frame), run_dir)
    return frame


# A unix socket path has at most 107 bytes. AIPerf's longest is
# <temp>/tmpXXXXXXXX/aiperf/dataset_manager_proxy_frontend.ipc.
_SOCKET_PATH_MAX = 107
_SOCKET_TAIL = len("/tmpXXXXXXXX/aiperf/dataset_manager_proxy_frontend.ipc")


def _measure(
    args: list[str], out: Path, server, timeout_s: float, name: str, level: int, cores=None
) -> dict:
    if out.exists():
        shutil.rmtree(out)  # a rerun in the same run folder measures afresh
    before_cpu, before_server = _children_cpu_s(), server_cpu_s(server)
    started = time.monotonic()
    # AIPerf leaves in the temp folder what it makes there: its dataset maps, aiperf_mmap_<id>/
    # (66 such folders were in /tmp after one session), and two folders a run for its ZMQ
    # sockets, tmpXXXXXXXX/ and tmpXXXXXXXX/aiperf/. So each level runs with a temp folder of
    # its own, removed when the level ends, and no content cache in ~/.cache (no eviction).
    with tempfile.TemporaryDirectory(prefix="labkit-aiperf-") as temp:
        env = aiperf_environ()
        env.update(AIPERF_DATASET_MMAP_BASE_PATH=temp, AIPERF_DATASET_MMAP_CACHE_ENABLED="false")
        if len(temp) + _SOCKET_TAIL <= _SOCKET_PATH_MAX:
            env["TMPDIR"] = temp  # else AIPerf's sockets would not fit: it leaves their folders
        result = proc.run(args, timeout_s=timeout_s, env=env, check=False, cores=cores)
    wall = time.monotonic() - started
    aiperf_cpu, server_cpu = _children_cpu_s() - before_cpu, server_cpu_s(server) - before_server
    out.mkdir(parents=True, exist_ok=True)
    (out / "aiperf-command.log").write_text(
        f"$ {' '.join(args)}\n# status {result.returncode} after {wall:.1f} s\n"
        f"{result.stdout}\n{result.stderr}",
        encoding="utf-8",
    )
    summary = out / "profile_export_aiperf.json"
    if result.returncode != 0 or not summary.is_file():
        text = (result.stderr or "") + (result.stdout or "")
        lines = [line.strip(" │╭╮╰╯─") for line in text.splitlines()]
        raise ToolError(
            f"aiperf failed for {name!r} at concurrency {level} (status {result.returncode}): "
            f"{proc.tail(chr(10).join(line for line in lines if line), 12)}\nfull output in "
            f"{out / 'aiperf-command.log'}"
        )
    row = summary_row(json.loads(summary.read_text(encoding="utf-8")))
    row.update(
        concurrency=level,
        wall_s=round(wall, 2),
        aiperf_cpu_s=round(aiperf_cpu, 2),
        server_cpu_s=round(server_cpu, 2) if server_cpu == server_cpu else server_cpu,
        cores=os.cpu_count(),
        artifact_dir=str(out),
    )
    row["aiperf_cpu_share"] = round(aiperf_cpu / (wall * (os.cpu_count() or 1)), 3)
    return row


def summary_row(summary: dict) -> dict:
    """The figures labkit keeps from AIPerf's ``profile_export_aiperf.json``."""

    def value(metric: str, stat: str = "avg") -> float:
        entry = summary.get(metric)
        return float(entry.get(stat, float("nan"))) if isinstance(entry, dict) else float("nan")

    failed = sum(int(e.get("count", 1)) for e in summary.get("error_summary") or [])
    answered = value("request_count")  # AIPerf's request_count counts the successful ones
    row: dict = {
        "requests": (int(answered) if answered == answered else 0) + failed,
        "failed": failed,
        "output_tokens_per_s": value("output_token_throughput"),
        "requests_per_s": value("request_throughput"),
        "output_tokens": value("total_output_tokens"),
        "duration_s": value("benchmark_duration"),
    }
    for metric, short in PERCENTILE_METRICS.items():
        unit = "" if short == "tokens_per_user" else "_ms"
        for stat in PERCENTILES:
            row[f"{short}_{stat}{unit}"] = value(metric, stat)
    return row


def request_records(artifact_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per request of one AIPerf level (``profile_export.jsonl``): when it was sent,
    its first token and its end (seconds from the first request's start), tokens, error."""
    path = Path(artifact_dir) / "profile_export.jsonl"
    if not path.is_file():
        raise MissingDependencyError(
            f"{str(path)!r} does not exist; run labkit.profiling.run_aiperf with its default export "
            "level (records) first"
        )
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        meta, metrics = record.get("metadata", {}), record.get("metrics", {})
        start, end = meta.get("request_start_ns"), meta.get("request_end_ns")
        if start is None or end is None:
            continue
        ttft = metrics.get("time_to_first_token", {}).get("value")
        rows.append(
            {
                "request": len(rows),
                "start_ns": int(start),
                "end_ns": int(end),
                "ttft_ms": float(ttft) if ttft is not None else float("nan"),
                "output_tokens": metrics.get("output_token_count", {}).get("value"),
                "error": (record.get("error") or {}).get("message") if record.get("error") else "",
            }
        )
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    origin = frame["start_ns"].min()
    frame["start_s"] = (frame["start_ns"] - origin) / 1e9
    frame["end_s"] = (frame["end_ns"] - origin) / 1e9
    frame["first_token_s"] = frame["start_s"] + frame["ttft_ms"] / 1e3
    return frame.drop(columns=["start_ns", "end_ns"]).sort_values("start_s", ignore_index=True)


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (AIPerf and the processes it waited on)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_cpu_s(server) -> float:
    """CPU seconds of a local server and its stubs so far; NaN for a server not run from here."""
    pid = getattr(server, "pid", None)
    if not pid:
        return float("nan")
    try:
        return proc.tree_total(pid, lambda process: sum(process.cpu_times()[:2]))  # user + system
    except psutil.Error:
        return float("nan")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
