"""Notebook 06's comparison: the lab's in-flight model, vLLM in Triton, vLLM's own server and vLLM
in bfloat16, all up at once on the server's cores and measured in turns, round after round.

This host's speed drifts by 2x within minutes, so two blocks measured one after the other carry
the drift. Here every way is loaded and warm before the first measurement, and each round
measures every way once, in the opposite order to the round before (A B C D, then D C B A): a
drift falls on every way alike, and the spread of the rounds says how far a ratio can be trusted.
The answers are checked first: each way's greedy answers under concurrency against the plain
model's answers alone.

:func:`compare` returns a :class:`Comparison` and writes it to ``<run_dir>/inflight.json``.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit import profiling
from labkit.errors import ConfigError
from labkit.hardware import format_cores, host_facts
from labkit.repository import prepare_run_repository
from labkit.repository.textgen import serving_threads
from labkit.runs import write_result
from labkit.server import serving, warm_up

from . import apis
from .measure import reference_answers, row_figures, served_answers
from .schedulers import StudySettings, workload, write_scheduler_folders
from .standalone import SERVED_NAME, start_standalone

#: The ways a comparison can measure, in the order they are shown.
WAYS = ("inflight", "vllm", "vllm-standalone", "vllm_bf16")
#: The order of a first round: each ratio the lesson reads (vLLM against the in-flight model, and
#: bfloat16 against float32) is of two measurements taken one after the other.
FIRST_ROUND = ("inflight", "vllm", "vllm_bf16", "vllm-standalone")
#: The file a comparison writes into its run folder (the study's name: one run, one record).
RESULT_NAME = "inflight"


@dataclass
class CompareSettings:
    """One server (and vLLM's own beside it), every way up at once, measured in rounds."""

    model: str = "smollm2"  # the plain folder: the answers alone, the reference
    inflight_model: str = "smollm2_inflight"  # the lab's own in-flight engine
    vllm_model: str = "smollm2_vllm"  # vLLM's engine (float32; its bfloat16 twin is written)
    ways: tuple[str, ...] = WAYS
    concurrency: int = 8  # streaming clients at once
    requests: int = 32  # per measurement (at least twice the concurrency)
    low: int = 4  # each request asks for a number of new tokens drawn from low..high (seeded)
    high: int = 64
    rounds: int = 2
    answers: int = 8  # prompts whose answers under concurrency are compared with the answer alone
    seed: int = 0
    pin: bool | None = None  # servers on every core but the last, AIPerf on the last (2+ cores)
    num_threads: int = field(default_factory=serving_threads)  # the in-flight model's torch threads
    startup_timeout_s: float = 900.0
    timeout_s: float = 900.0  # the bound on one AIPerf measurement

    def check(self) -> CompareSettings:
        unknown = [w for w in self.ways if w not in WAYS]
        if unknown or "inflight" not in self.ways:
            raise ConfigError(
                f"ways must include 'inflight' and come from {', '.join(WAYS)}; got "
                f"{', '.join(self.ways) or 'none'}"
            )
        if self.concurrency < 1 or self.rounds < 1 or self.requests < self.concurrency:
            raise ConfigError(
                f"concurrency ({self.concurrency}) and rounds ({self.rounds}) must be >= 1, and "
                f"requests ({self.requests}) at least the concurrency"
            )
        self.study().check()
        return self

    def study(self) -> StudySettings:
        """The same choices as the benchmark's settings, which write the model folders."""
        return StudySettings(
            model=self.model,
            inflight_model=self.inflight_model,
            vllm_model=self.vllm_model,
            standalone="vllm-standalone" in self.ways,
            pin=self.pin,
            schedulers=tuple(w for w in self.ways if w != "vllm-standalone"),
            workloads=("mixed",),
            streaming=(True,),
            concurrency=(self.concurrency,),
            requests=self.requests,
            mixed_low=self.low,
            mixed_high=self.high,
            seed=self.seed,
            num_threads=self.num_threads,
            limit_concurrency=self.concurrency,
            precision=False,
            answers=self.answers,
            startup_timeout_s=self.startup_timeout_s,
            timeout_s=self.timeout_s,
        )

    def cores(self) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """``(server, client)`` cores when pinned, else ``(None, None)``."""
        return self.study().cores()


@dataclass
class Comparison:
    """What :func:`compare` measured: ``rows`` holds one AIPerf measurement each, with its
    ``way`` (``scheduler``) and ``round``; ``answers`` each served way's greedy answers under
    concurrency against the plain model's alone (``equal_streaming``, ``compared``, ...); ``apis``
    one request to vLLM's own server with the ``openai`` client and the same to vLLM in Triton with
    ``/generate``, their answers, finish reasons and token counts (:func:`.apis.ask_both`)."""

    settings: dict
    host: dict
    run_dir: str
    rows: list[dict] = field(default_factory=list)
    answers: dict = field(default_factory=dict)
    load_average: list[list[float]] = field(default_factory=list)  # at the start of each round
    apis: list[dict] = field(default_factory=list)  # one request each way (apis.ask_both)
    wall_s: float | None = None

    def way_rows(self, way: str) -> list[dict]:
        return [r for r in self.rows if r["scheduler"] == way]

    @property
    def ways(self) -> list[str]:
        """The ways measured, in the order they are shown (:data:`WAYS`, then any other)."""
        measured = list(dict.fromkeys(r["scheduler"] for r in self.rows))
        return sorted(measured, key=lambda w: WAYS.index(w) if w in WAYS else len(WAYS))


def compare(
    run_dir: str | os.PathLike,
    settings: CompareSettings | None = None,
    *,
    source: str | os.PathLike | None = None,
    progress: bool = True,
) -> Comparison:
    """Serve the text model every way of ``settings.ways`` at once and measure each in turn.

    One Triton server holds the in-flight model and the vLLM models (float32, and its bfloat16
    twin when ``vllm_bf16`` is asked); vLLM's own OpenAI server starts beside it with the
    float32 model's settings, on the same cores. Each model is warmed up, each served way's
    answers under concurrency are checked against the plain model's answers alone, then each
    round measures every way with AIPerf (``concurrency`` streaming clients, ``requests``
    requests of ``low..high`` new tokens), in the opposite order to the round before. Then, both
    servers still up, one request goes to vLLM's own server through the ``openai`` client and the
    same to vLLM in Triton through ``/generate`` (``Comparison.apis``; a failure is kept as text).

    ``source`` (default: the lab's ``model_repository/``) is copied into the run folder first.
    """
    s = (settings or CompareSettings()).check()
    study = s.study()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = prepare_run_repository(run_dir, source=source)
    names = write_scheduler_folders(repo, study)
    w = workload("mixed", study)
    server_cores, client_cores = s.cores()
    result = Comparison(settings=plain_settings(asdict(s)), host=host_facts(), run_dir=str(run_dir))
    if server_cores is not None:
        result.host["server_cores"] = format_cores(server_cores)
        result.host["client_cores"] = format_cores(client_cores)
    started = time.monotonic()
    served = [way for way in s.ways if way != "vllm-standalone"]
    plain = names["none"][False]
    with ThreadPoolExecutor(len(served) + 2) as pool, serving(
        run_dir, repo.path, [], startup_timeout_s=s.startup_timeout_s, warm=False,
        cores=server_cores,
    ) as server:  # fmt: skip
        own = None
        if "vllm-standalone" in s.ways:  # vLLM's own server starts while Triton loads
            own = pool.submit(
                start_standalone, run_dir, repo, names["vllm"][True], cores=server_cores,
                timeout_s=s.startup_timeout_s,
            )  # fmt: skip
        try:
            # Triton loads the models together: their starts overlap where they wait.
            models = (plain, *served_models(names, served))
            for loading in [pool.submit(server.load_model, m) for m in models]:
                loading.result()
            reference = reference_answers(server, names, {"mixed": w}, study, loaded=True)
            server.unload_model(plain)
            for way in served:
                warm_up(server, names[way][True])
                result.answers[way] = served_answers(
                    server, names[way][True], reference, study, kinds=("streaming",)
                )
            standalone = own.result() if own is not None else None
            targets = {way: (server, names[way][True], None) for way in served}
            if standalone is not None:
                standalone.warm_up()  # Triton's ways were warmed and asked for answers above
                tokenizer = profiling.model_weights(repo.path, names["vllm"][True])
                targets["vllm-standalone"] = (standalone, SERVED_NAME, tokenizer)
            result.rows = _rounds(run_dir, targets, w, s, client_cores, result, progress)
            # One request each way while both servers are up (never raises: the rounds stay)
            result.apis = apis.ask_both(
                standalone.url if standalone is not None else None, SERVED_NAME,
                server.http_url if "vllm" in served else None, names.get("vllm", {}).get(True, ""),
            )  # fmt: skip
        finally:
            if own is not None:
                with contextlib.suppress(Exception):  # a server that never started has no stop
                    own.result().stop()
    result.host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result.wall_s = round(time.monotonic() - started, 1)
    write_result(run_dir, RESULT_NAME, result)
    return result


def served_models(names: dict, ways: list[str]) -> list[str]:
    """The Triton models of ``ways`` (each way's streaming model)."""
    return [names[way][True] for way in ways]


def round_order(ways: list[str], round_index: int) -> list[str]:
    """The order of round ``round_index`` (from 0): as given, then reversed, and so on."""
    return list(ways) if round_index % 2 == 0 else list(reversed(ways))


def _rounds(run_dir: Path, targets: dict, w, s: CompareSettings, cores, result, progress):
    rows = []
    for index in range(s.rounds):
        result.load_average.append([round(x, 2) for x in os.getloadavg()])
        for way in round_order([x for x in FIRST_ROUND if x in targets], index):
            server, model, tokenizer = targets[way]
            frame = profiling.run_aiperf(
                server, model, w, concurrency=s.concurrency, streaming=True,
                tokenizer=tokenizer, run_dir=run_dir / "aiperf", label=f"{way}-round{index + 1}",
                timeout_s=s.timeout_s, progress=progress, openai=way == "vllm-standalone",
                cores=cores,
            )  # fmt: skip
            for record in frame.to_dict("records"):
                row = {"scheduler": way, "model": model, "round": index + 1}
                rows.append({**row, **row_figures(record), "artifact_dir": record["artifact_dir"]})
    return rows


def plain_settings(settings: dict) -> dict:
    """``settings`` (a dataclass's ``asdict``) with its tuples as lists, as JSON writes them."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
