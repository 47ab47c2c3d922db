"""``labkit bench frontend``: what serving vLLM through Triton costs, against vLLM's own server,
measured in rounds.

One Triton server holds the vLLM model in each dtype asked (float32: the model as shipped;
bfloat16: its twin). Beside it, vLLM's own OpenAI server runs once per dtype with the same
engine settings (read from the same ``config.pbtxt`` by the model's own ``vllm_settings.py``) and,
with ``defaults``, once more per dtype with vLLM's own defaults (no ``--enforce-eager``:
compiled; the lab's model compiles too, so the two references differ only where its config is
set eager). Every server is up and warm before the first measurement, every one pinned
to the same server cores, AIPerf on the others. Each round measures every way once with the same
workload, in the opposite order to the round before (A B C, then C B A), so that the host's drift
falls on every way alike.

What it reports, per dtype and per reference: each round's ratio of Triton's output tokens/s to
the reference's, their median, their spread (half the range of the rounds), the load average at
each round's start, and the failed requests; then the greedy answers of Triton and of each
reference to the same prompts, asked alone. A target is met when the median clears it by more
than the spread. :func:`run` writes ``<run_dir>/frontend.json``; :func:`table` prints it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit import profiling
from labkit.errors import ConfigError
from labkit.hardware import format_cores, host_facts
from labkit.repository import Repository, apply_edits, prepare_run_repository
from labkit.runs import write_result
from labkit.server import serving, warm_up

from . import apis
from .measure import row_figures
from .rounds import plain_settings
from .schedulers import VLLM_DTYPES, StudySettings, check_vllm_environment, workload
from .standalone import SERVED_NAME, start_standalone

#: The file a run writes into its run folder.
RESULT_NAME = "frontend"
#: The references each served way is compared with: vLLM's own server on the model's settings,
#: and on vLLM's own defaults (compiled).
REFERENCES = ("own", "own_defaults")
#: How many of the workload's (prompt, new tokens) pairs are asked alone, greedy, of each way.
ANSWERS = 8
#: The frontend bench's targets: Triton against vLLM's own server on the same settings, and on its
#: defaults, in every dtype.
TARGETS = {"own": 1.0, "own_defaults": 0.95}


@dataclass
class FrontendSettings:
    """Which dtypes and references, the workload, and how many rounds."""

    vllm_model: str = "smollm2_vllm"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    defaults: bool = False  # also vLLM's own server with its defaults (a compiled first start)
    rounds: int = 3
    concurrency: int = 8  # streaming clients at once
    requests: int = 32  # per measurement (at least twice the concurrency)
    low: int = 4  # each request asks for low..high new tokens (seeded)
    high: int = 64
    seed: int = 0
    streaming: bool = True
    stream_interval: int = 0  # > 0: the served and the reference engines' stream_interval
    pin: bool | None = None  # servers on every core but the last, AIPerf on the last (2+ cores)
    startup_timeout_s: float = 900.0
    timeout_s: float = 900.0  # the bound on one AIPerf measurement

    def check(self) -> FrontendSettings:
        known = tuple(VLLM_DTYPES.values())
        if not self.dtypes or set(self.dtypes) - set(known):
            raise ConfigError(f"dtypes must come from {', '.join(known)}; got {self.dtypes}")
        if self.rounds < 1 or self.concurrency < 1 or self.requests < self.concurrency:
            raise ConfigError(
                f"rounds ({self.rounds}) and concurrency ({self.concurrency}) must be >= 1, and "
                f"requests ({self.requests}) at least the concurrency"
            )
        if self.stream_interval < 0:
            raise ConfigError(
                f"stream_interval must be >= 1 (0: the model's), got {self.stream_interval}"
            )
        self.study().check()
        return self

    def study(self) -> StudySettings:
        return StudySettings(
            vllm_model=self.vllm_model,
            pin=self.pin,
            schedulers=(),
            workloads=("mixed",),
            streaming=(self.streaming,),
            concurrency=(self.concurrency,),
            requests=self.requests,
            mixed_low=self.low,
            mixed_high=self.high,
            seed=self.seed,
            precision=False,
        )

    def ways(self) -> list[str]:
        """Every way measured: ``triton_<dtype>``, ``own_<dtype>``, ``own_defaults_<dtype>``."""
        kinds = ("triton", "own", *(("own_defaults",) if self.defaults else ()))
        return [f"{kind}_{dtype}" for dtype in self.dtypes for kind in kinds]


@dataclass
class FrontendResult:
    settings: dict
    host: dict
    run_dir: str
    rows: list[dict] = field(default_factory=list)  # one AIPerf measurement each: way, round
    load_average: list[list[float]] = field(default_factory=list)  # at each round's start
    ratios: dict = field(default_factory=dict)  # "<dtype>_vs_<reference>": ratios()'s figures
    answers: dict = field(default_factory=dict)  # "<dtype>_vs_<reference>": greedy_answers()'s
    wall_s: float | None = None


def run(
    run_dir: str | os.PathLike,
    settings: FrontendSettings | None = None,
    *,
    source: str | os.PathLike | None = None,
    progress: bool = True,
) -> FrontendResult:
    """Start every way, warm each, measure them in rounds; write and return the result."""
    s = (settings or FrontendSettings()).check()
    study = s.study()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = prepare_run_repository(run_dir, source=source)
    folders = write_folders(repo, s)
    w = workload("mixed", study)
    server_cores, client_cores = study.cores()
    result = FrontendResult(
        settings=plain_settings(asdict(s)), host=host_facts(), run_dir=str(run_dir)
    )
    if server_cores is not None:
        result.host["server_cores"] = format_cores(server_cores)
        result.host["client_cores"] = format_cores(client_cores)
    started = time.monotonic()
    own = {way: folder for way, folder in folders.items() if not way.startswith("triton_")}
    served = {way: folder for way, folder in folders.items() if way.startswith("triton_")}
    with ThreadPoolExecutor(len(own) + len(served) or 1) as pool, serving(
        run_dir, repo.path, [], startup_timeout_s=s.startup_timeout_s, warm=False,
        cores=server_cores,
    ) as server:  # fmt: skip
        starting = {
            way: pool.submit(
                start_standalone,
                run_dir,
                repo,
                folder,
                cores=server_cores,
                timeout_s=s.startup_timeout_s,
            )  # fmt: skip
            for way, folder in own.items()
        }
        try:
            for loading in [pool.submit(server.load_model, m) for m in served.values()]:
                loading.result()
            for model in served.values():
                warm_up(server, model)
            tokenizer = profiling.model_weights(repo.path, s.vllm_model)
            targets = {way: (server, model, None) for way, model in served.items()}
            for way, future in starting.items():
                future.result().warm_up()  # as warm as Triton's models, before any round
                targets[way] = (future.result(), SERVED_NAME, tokenizer)
            result.rows = _rounds(run_dir, targets, w, s, client_cores, result, progress)
            write_result(run_dir, RESULT_NAME, result)  # the rounds survive a failed question
            result.answers = greedy_answers(targets, w, s)
        finally:
            for future in starting.values():
                with contextlib.suppress(Exception):  # a server that never started has no stop
                    future.result().stop()
    result.ratios = ratios(result.rows, s)
    result.host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result.wall_s = round(time.monotonic() - started, 1)
    write_result(run_dir, RESULT_NAME, result)
    return result


def write_folders(repo: Repository, s: FrontendSettings) -> dict[str, str]:
    """Each way's model folder in the run's repository copy: way -> folder name. The references
    start from a folder too (``start_standalone`` reads its config), so a reference and its
    served way cannot be configured apart."""
    check_vllm_environment(repo, s.vllm_model)
    base = repo.config(s.vllm_model)
    interval = {"stream_interval": str(s.stream_interval)} if s.stream_interval else {}
    folders = {}
    for dtype in s.dtypes:
        params = {"dtype": dtype, **interval}
        name = s.vllm_model if dtype == "float32" else f"{s.vllm_model}_{dtype}"
        config = apply_edits(base, parameters=params)
        if name == s.vllm_model:
            repo.write_config(name, config)
        else:
            repo.add_twin(s.vllm_model, name, config)
        folders[f"triton_{dtype}"] = name
        folders[f"own_{dtype}"] = name
        if s.defaults:
            compiled = f"{s.vllm_model}_defaults_{dtype}"
            repo.add_twin(
                s.vllm_model,
                compiled,
                apply_edits(base, parameters={**params, "enforce_eager": "false"}),
            )
            folders[f"own_defaults_{dtype}"] = compiled
    return folders


def _rounds(run_dir: Path, targets: dict, w, s: FrontendSettings, cores, result, progress):
    rows = []
    ways = [way for way in s.ways() if way in targets]
    for index in range(s.rounds):
        result.load_average.append([round(x, 2) for x in os.getloadavg()])
        for way in ways if index % 2 == 0 else list(reversed(ways)):
            server, model, tokenizer = targets[way]
            frame = profiling.run_aiperf(
                server, model, w, concurrency=s.concurrency, streaming=s.streaming,
                tokenizer=tokenizer, run_dir=run_dir / "aiperf", label=f"{way}-round{index + 1}",
                timeout_s=s.timeout_s, progress=progress, openai=not way.startswith("triton_"),
                cores=cores,
            )  # fmt: skip
            for record in frame.to_dict("records"):
                row = {"way": way, "model": model, "round": index + 1}
                rows.append({**row, **row_figures(record), "artifact_dir": record["artifact_dir"]})
    return rows


def greedy_answers(targets: dict, w, s: FrontendSettings) -> dict:
    """After the rounds, each of the workload's first :data:`ANSWERS` (prompt, new tokens) pairs
    asked alone and greedy of Triton (``/generate``) and of each reference (the ``openai``
    client), per dtype: how many answers are the same text, and the first that differ. Raises
    the failed request's error (the rounds are written before)."""
    pairs = list(dict.fromkeys(zip(w.prompts, w.max_tokens, strict=True)))[:ANSWERS]
    requests = [apis.Request(prompt, (), tokens) for prompt, tokens in pairs]
    out = {}
    for dtype in s.dtypes:
        server, model, _ = targets[f"triton_{dtype}"]
        ours = [apis.ask_triton(server.http_url, model, r)["answer"] for r in requests]
        for reference in REFERENCES:
            if f"{reference}_{dtype}" not in targets:
                continue
            own, name, _ = targets[f"{reference}_{dtype}"]
            theirs = [apis.ask_openai(own.url, name, r)["answer"] for r in requests]
            differ = [
                {"prompt": r.prompt, "max_tokens": r.max_tokens, "triton": a, "reference": b}
                for r, a, b in zip(requests, ours, theirs, strict=True)
                if a != b
            ]
            out[f"{dtype}_vs_{reference}"] = {
                "compared": len(requests),
                "equal": len(requests) - len(differ),
                "differ": differ[:3],
            }
    return out


def ratios(rows: list[dict], s: FrontendSettings) -> dict:
    """Per dtype and reference: each round's Triton/reference output tokens/s, the median, the
    spread (half the range), the target and whether the median clears it by more than the
    spread."""
    tokens = {(r["way"], r["round"]): r.get("output_tokens_per_s") for r in rows}
    out = {}
    for dtype in s.dtypes:
        for reference in REFERENCES:
            per_round = []
            for index in range(1, s.rounds + 1):
                ours = tokens.get((f"triton_{dtype}", index))
                theirs = tokens.get((f"{reference}_{dtype}", index))
                if ours and theirs:
                    per_round.append(round(ours / theirs, 3))
            if not per_round:
                continue
            median = round(statistics.median(per_round), 3)
            spread = round((max(per_round) - min(per_round)) / 2, 3)
            target = TARGETS[reference]
            out[f"{dtype}_vs_{reference}"] = {
                "rounds": per_round,
                "median": median,
                "spread": spread,
                "target": target,
                "met": median - target > spread,
            }
    return out


def table(result: FrontendResult) -> str:
    """Each way's tokens/s per round, then each ratio against its target."""
    lines = [f"{'way':<26}" + "".join(f"{'round ' + str(i + 1):>10}" for i in range(
        len(result.load_average))) + f"{'failed':>8}"]  # fmt: skip
    ways = list(dict.fromkeys(r["way"] for r in result.rows))
    for way in ways:
        cells = [r for r in result.rows if r["way"] == way]
        lines.append(
            f"{way:<26}"
            + "".join(
                f"{r['output_tokens_per_s'] or 0:>10.1f}"
                for r in sorted(cells, key=lambda r: r["round"])
            )
            + f"{sum(r.get('failed') or 0 for r in cells):>8}"
        )
    lines.append("load average at each round's start: " + ", ".join(
        "/".join(f"{x:g}" for x in load) for load in result.load_average))  # fmt: skip
    lines.append("")
    lines.append(f"{'ratio (output tokens/s)':<26}{'rounds':>24}{'median':>8}{'spread':>8}"
                 f"{'target':>8}  met")  # fmt: skip
    for key, r in result.ratios.items():
        rounds = ", ".join(f"{x:.3f}" for x in r["rounds"])
        lines.append(
            f"{key:<26}{rounds:>24}{r['median']:>8.3f}{r['spread']:>8.3f}{r['target']:>8.2f}  "
            f"{'yes' if r['met'] else 'no'}"
        )
    for key, a in result.answers.items():
        lines.append(f"greedy answers, {key}: {a['equal']} of {a['compared']} the same text")
    return "\n".join(lines)
