"""``labkit bench threads``: the torch threads per model instance that serve best on this host.

For one model, on this host's cores, with dynamic batching on and perf_analyzer beside the
servers (as a learner runs it), three cases:

- ``one server, 1 instance``;
- ``one server, 2 instances`` (``instance_group { count: 2 }``);
- ``2 replicas behind HAProxy``, one instance each, measured through the balancer;

each at every thread count asked for (``num_threads`` of each instance) and every concurrency.
Every (case, threads) is a twin of the model (``<model>_<case>_t<threads>``) loaded beside the
others, on the first replica, or on both for the replicas case, so all of them are measured in
turns, round after round, with no reload between them: a busier moment of a shared host falls
on all of them. Each round starts at another place in the order. The other replica sits idle
while a one-server case is measured. The twins are removed at the end.

The result (``<run_dir>/threads.json`` and a table) gives, per case and concurrency, each thread
count's median infer/s over the rounds and its spread, its ratio to the fewest threads' taken
round by round (median and range), the best one, and how the thread count
that labkit's budget gives by default (:func:`labkit.repository.textgen.thread_budget`) compares
with the best.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from labkit import profiling
from labkit.cluster.pool import start_cluster
from labkit.errors import ConfigError, LabkitError
from labkit.hardware import host_facts
from labkit.repository import Repository, apply_edits, prepare_run_repository
from labkit.repository.textgen import thread_budget
from labkit.runs import write_result
from labkit.server import reload

log = logging.getLogger(__name__)

#: The cases: (key, label, instances in a server, servers that serve the twin).
CASES = (
    ("one", "one server, 1 instance", 1, 1),
    ("two", "one server, 2 instances", 2, 1),
    ("rep", "2 replicas behind HAProxy", 1, 2),
)

#: A short input the encoder step takes as it comes from the tokenizer ("Where is the nearest
#: station?" in MiniLM's vocabulary), so that perf_analyzer sends real token ids.
ENCODER_IDS = [101, 2073, 2003, 1996, 7205, 2276, 1029, 102]


@dataclass
class ThreadsSettings:
    """What one model's measurement asks for."""

    model: str = "smollm2"
    threads: tuple[int, ...] = (1, 2)
    concurrencies: tuple[int, ...] = (1, 8)
    rounds: int = 3
    max_tokens: int = 12  # new tokens a request, for the text-generation models
    max_batch_size: int = 8  # at least this, with dynamic batching on
    prompt: str = "Where is the nearest"
    request_count: int = 16  # requests per window at concurrency 8 (half at 1); three windows
    timeout_s: float = 300.0  # one perf_analyzer level

    def check(self) -> ThreadsSettings:
        """The settings, thread counts and concurrencies in ascending order; raises
        :class:`ConfigError` naming what cannot be measured."""
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if not self.threads or min(self.threads) < 1:
            raise ConfigError(f"thread counts must be >= 1, got {self.threads}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ConfigError(f"concurrencies must be >= 1, got {self.concurrencies}")
        self.threads = tuple(sorted(set(self.threads)))
        self.concurrencies = tuple(sorted(set(self.concurrencies)))
        return self


@dataclass
class ThreadsResult:
    """Every round measured (``rounds``) and, per case and concurrency, the summary (``cases``)."""

    model: str
    settings: dict
    host: dict
    run_dir: str
    rounds: list[dict] = field(default_factory=list)
    cases: list[dict] = field(default_factory=list)
    wall_s: float | None = None
    partial: bool = False  # a measurement failed: the rounds are those measured before it


def measure_threads(
    run_dir: str | os.PathLike,
    settings: ThreadsSettings | None = None,
    *,
    source: str | os.PathLike | None = None,
    progress: bool = True,
) -> ThreadsResult:
    """Measure ``settings.model`` (see the module's docstring); write ``<run_dir>/threads.json``."""
    s = (settings or ThreadsSettings()).check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    repo = prepare_run_repository(run_dir, models=[s.model], source=source)
    base = _batching_config(repo, s)
    repo.write_config(s.model, base)
    perf = _perf_options(repo, s, run_dir, progress)
    result = ThreadsResult(
        model=s.model,
        settings={k: v for k, v in vars(s).items()},
        host=host_facts(),
        run_dir=str(run_dir),
    )
    try:
        with start_cluster(run_dir, repo.path, [s.model], 2) as cluster:
            _measure_all(cluster, repo, base, s, perf, result)
    except BaseException:
        # what was measured before the failure is kept, and said to be partial
        result.partial = True
        _finish(result, s, run_dir, started)
        raise
    _finish(result, s, run_dir, started)
    return result


def _finish(result: ThreadsResult, s: ThreadsSettings, run_dir: Path, started: float) -> None:
    result.cases = summarize(result.rounds, s.threads)
    result.host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result.wall_s = round(time.monotonic() - started, 1)
    write_result(run_dir, "threads", result)


def _measure_all(cluster, repo: Repository, base, s: ThreadsSettings, perf: dict, result) -> None:
    """Load every twin, measure them in turns, round after round (``result.rounds`` grows as
    they are measured); unload and remove the twins whatever happens."""
    twins: list[str] = []
    try:
        for key, _, instances, servers in CASES:
            for t in s.threads:
                name = f"{s.model}_{key}_t{t}"
                config = apply_edits(
                    base, instance_count=instances, parameters={"num_threads": str(t)}
                )
                repo.add_twin(s.model, name, config)
                twins.append(name)
                for r in range(servers):
                    reload(cluster.replica(r).server, name, repository=repo)
        order = [(case, t) for case in CASES for t in s.threads]
        for r in range(s.rounds):
            shift = r % len(order)
            for c in s.concurrencies:
                for case, t in order[shift:] + order[:shift]:
                    result.rounds.append(_measure_one(cluster, s, perf, case, t, c, r + 1))
    finally:
        for name in twins:
            for r in range(2):
                with contextlib.suppress(LabkitError):
                    cluster.replica(r).server.unload_model(name)
            with contextlib.suppress(LabkitError, OSError):
                repo.remove(name)


def _measure_one(cluster, s: ThreadsSettings, perf: dict, case, t: int, c: int, n: int) -> dict:
    """One (case, threads) at ``c`` clients in round ``n``: its perf_analyzer figures."""
    key, label, _, servers = case
    where = cluster if servers > 1 else cluster.replica(0).server
    frame = profiling.perf_analyzer(
        where,
        f"{s.model}_{key}_t{t}",
        concurrency=c,
        measurement_request_count=_window(s, c),
        label=f"{label}, {t} threads, c{c}, round {n}",
        **perf,
    )
    row = frame.iloc[0]
    return {
        "case": label,
        "threads": t,
        "concurrency": c,
        "round": n,
        "throughput": round(float(row["throughput"]), 3),
        "p99_ms": round(float(row["p99_ms"]), 1),
        "avg_batch_size": round(float(row["avg_batch_size"]), 2),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def summarize(rounds: Sequence[dict], threads: Sequence[int]) -> list[dict]:
    """Per case and concurrency: each thread count's median infer/s and its spread (max - min
    over the rounds, over the median), the best thread count, labkit's default for the case and
    its median over the best's."""
    cases = []
    for _, label, instances, servers in CASES:
        default = thread_budget(instances, servers)
        for c in sorted({r["concurrency"] for r in rounds}):
            rows = [r for r in rounds if r["case"] == label and r["concurrency"] == c]
            if not rows:
                continue
            entry: dict = {"case": label, "concurrency": c, "default_threads": default}
            medians = {}
            for t in threads:
                values = [r["throughput"] for r in rows if r["threads"] == t]
                if not values:
                    continue
                median = statistics.median(values)
                medians[t] = median
                entry[f"t{t}_median"] = round(median, 2)
                entry[f"t{t}_spread"] = round((max(values) - min(values)) / median, 3)
                entry[f"t{t}_batch"] = round(
                    statistics.median(r["avg_batch_size"] for r in rows if r["threads"] == t), 2
                )
            entry.update(_round_ratios(rows, sorted(medians)))
            best = max(medians, key=medians.get)
            entry["best_threads"] = best
            if default in medians:
                entry["default_over_best"] = round(medians[default] / medians[best], 3)
            entry["load_1m"] = [min(r["load_1m"] for r in rows), max(r["load_1m"] for r in rows)]
            cases.append(entry)
    return cases


def _round_ratios(rows: Sequence[dict], measured: Sequence[int]) -> dict:
    """Each thread count's infer/s over the fewest threads', round by round (both measured in
    the same round): ``t<N>_over_t<least>`` is their median, ``..._range`` the lowest and
    highest."""
    least, ratios = measured[0], {}
    by = {(r["round"], r["threads"]): r["throughput"] for r in rows}
    for t in measured[1:]:
        each = [
            by[(n, t)] / by[(n, least)]
            for n in sorted({r["round"] for r in rows})
            if (n, t) in by and by.get((n, least))
        ]
        if each:
            ratios[f"t{t}_over_t{least}"] = round(statistics.median(each), 3)
            ratios[f"t{t}_over_t{least}_range"] = [round(min(each), 3), round(max(each), 3)]
    return ratios


def table(result: ThreadsResult) -> str:
    """The summary as text: one line per case and concurrency."""
    threads = result.settings["threads"]
    least, more = threads[0], list(threads[1:])
    head = ["case", "c", *[f"{t} thr infer/s (spread)" for t in threads],
            *[f"{t}/{least} thr by round" for t in more], "best", "default", "default/best",
            "load"]  # fmt: skip
    lines = [head]
    for e in result.cases:
        lines.append(
            [
                e["case"],
                str(e["concurrency"]),
                *[
                    f"{e[f't{t}_median']:.2f} ({e[f't{t}_spread']:.0%})"
                    if f"t{t}_median" in e
                    else "-"
                    for t in threads
                ],
                *[
                    "x{:.2f} ({:.2f}-{:.2f})".format(
                        e[f"t{t}_over_t{least}"], *e[f"t{t}_over_t{least}_range"]
                    )
                    if f"t{t}_over_t{least}" in e
                    else "-"
                    for t in more
                ],
                str(e["best_threads"]),
                str(e["default_threads"]),
                f"{e['default_over_best']:.2f}" if "default_over_best" in e else "-",
                "{:.1f}-{:.1f}".format(*e["load_1m"]),
            ]
        )
    width = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, width, strict=True)) for line in lines]
    return f"{result.model} on {result.host.get('cores')} cores\n" + "\n".join(text)


def _batching_config(repo: Repository, s: ThreadsSettings):
    base = repo.config(s.model)
    parameters = {"num_threads": None}
    if "max_tokens" in base.parameters:  # a text-generation model
        parameters["max_tokens"] = str(s.max_tokens)
    return apply_edits(
        base,
        max_batch_size=max(base.max_batch_size, s.max_batch_size),
        dynamic_batching=True,
        parameters=parameters,
    )


def _perf_options(repo: Repository, s: ThreadsSettings, run_dir: Path, progress: bool) -> dict:
    """perf_analyzer's settings: three windows of fixed size (no stability rule: the rounds show
    the noise), the prompt for a text input, token ids for the encoder step."""
    config = repo.config(s.model)
    names = [i.name for i in config.input]
    options: dict = {
        "measurement_mode": "count_windows",
        "stability_percentage": None,
        "run_dir": run_dir / "perf",
        "timeout_s": s.timeout_s,
        "progress": progress,
    }
    if names == ["input_ids", "attention_mask"]:
        options["input_data"] = [
            {
                "input_ids": {"content": ENCODER_IDS, "shape": [len(ENCODER_IDS)]},
                "attention_mask": {"content": [1] * len(ENCODER_IDS), "shape": [len(ENCODER_IDS)]},
            }
        ]
    elif len(names) == 1:
        options["string_data"] = s.prompt
        options["shapes"] = {names[0]: [1]}
    else:
        raise ConfigError(
            f"the threads benchmark sends a prompt or the encoder step's token ids, but "
            f"{s.model!r} takes {names}"
        )
    return options


def _window(s: ThreadsSettings, concurrency: int) -> int:
    """Requests per window: ``request_count`` at the highest concurrency, fewer below (at least
    eight), so that a window takes about as long at each."""
    return max(8, s.request_count * concurrency // max(s.concurrencies))
