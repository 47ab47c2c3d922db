"""``labkit bench vllm-start``: how long vLLM's own server takes to start on this host, eager and
compiled, and what its compile cache holds.

Unless ``enforce_eager`` is set, vLLM compiles the model with ``torch.compile`` as it starts and
keeps what it compiled under its cache root (``VLLM_CACHE_ROOT``, by default ``~/.cache/vllm``;
torch's inductor keeps its part in ``TORCHINDUCTOR_CACHE_DIR``, by default under ``/tmp``): a later start of the same model, settings and vLLM finds it there and skips most of the work.
Per dtype, with a cache root of its own that starts empty (both caches in it):

- **cold**: the first compiled start, the cache empty;
- then in turns (eager, warm, eager, warm, ...): an **eager** start and a **warm** compiled start
  (the cache filled by the cold one), so that the host's drift falls on both alike.

Each start is timed from the server's spawn to ``/health`` answering (``start_s``), and then to
its first completion answered (``first_answer_s``): a compiled engine can still compile on its
first request. The load average is kept beside every start, and the cache's size after the cold
start. The figure the lab's default is chosen on: the median over the turns of a warm start less
the eager start beside it. :func:`run` writes ``<run_dir>/vllm-start.json``; :func:`table`
prints it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.errors import ConfigError
from labkit.hardware import host_facts
from labkit.repository import Repository, apply_edits, prepare_run_repository
from labkit.runs import write_result

from .rounds import plain_settings
from .schedulers import VLLM_DTYPES, check_vllm_environment
from .standalone import start_standalone

#: The file a run writes into its run folder.
RESULT_NAME = "vllm-start"
#: vLLM's variable for the root of its caches (the compiled graphs go in its torch_compile_cache/).
CACHE_ROOT = "VLLM_CACHE_ROOT"
#: Where torch's inductor keeps what it compiled (by default a folder under /tmp shared by every
#: start): each dtype gets its own under its cache root, so a cold start is cold.
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
#: vLLM's switch for its ahead-of-time compile cache (on by default with torch 2.10 and later;
#: the lab's model turns it off, ``vllm_settings.engine_environment``): ``aot`` sets it as a
#: parameter of the compiled folders.
AOT = "VLLM_USE_AOT_COMPILE"
#: How much longer than eager a warm compiled start may take for compiled to be the CPU default.
ACCEPTABLE_EXTRA_S = 30.0


@dataclass
class StartSettings:
    """Which dtypes, and how many eager/warm turns after each cold start."""

    vllm_model: str = "smollm2_vllm"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    turns: int = 2
    aot: bool | None = None  # VLLM_USE_AOT_COMPILE for the compiled starts; None: the model's
    startup_timeout_s: float = 1200.0

    def check(self) -> StartSettings:
        known = tuple(VLLM_DTYPES.values())
        if not self.dtypes or set(self.dtypes) - set(known):
            raise ConfigError(f"dtypes must come from {', '.join(known)}; got {self.dtypes}")
        if self.turns < 1:
            raise ConfigError(f"turns must be >= 1, got {self.turns}")
        return self


@dataclass
class StartResult:
    settings: dict
    host: dict
    run_dir: str
    starts: list[dict] = field(default_factory=list)  # dtype, kind, turn, start_s, first_answer_s
    cache: dict = field(default_factory=dict)  # dtype -> {"path", "bytes"} after the cold start
    summary: dict = field(default_factory=dict)  # dtype -> summarize()'s figures
    wall_s: float | None = None


def plan(s: StartSettings) -> list[tuple[str, str, int]]:
    """The starts in order: per dtype, (dtype, kind, turn): cold, then eager and warm in turns."""
    order = []
    for dtype in s.dtypes:
        order.append((dtype, "cold", 0))
        for turn in range(1, s.turns + 1):
            order += [(dtype, "eager", turn), (dtype, "warm", turn)]
    return order


def write_folders(repo: Repository, s: StartSettings) -> dict[tuple[str, bool], str]:
    """A model folder per dtype and mode: (dtype, eager) -> folder name."""
    check_vllm_environment(repo, s.vllm_model)
    base = repo.config(s.vllm_model)
    folders = {}
    for dtype in s.dtypes:
        for eager in (True, False):
            name = f"{s.vllm_model}_{dtype}_{'eager' if eager else 'compiled'}"
            params = {"dtype": dtype, "enforce_eager": "true" if eager else "false"}
            if not eager and s.aot is not None:  # a parameter: the model's own default is 0
                params[AOT] = str(int(s.aot))
            repo.add_twin(s.vllm_model, name, apply_edits(base, parameters=params))
            folders[(dtype, eager)] = name
    return folders


@contextlib.contextmanager
def environment(**variables: str | None) -> Iterator[None]:
    """``variables`` set (None: left as they are) for the servers started inside, restored after."""
    given = {name: value for name, value in variables.items() if value is not None}
    before = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def time_start(run_dir: Path, repo: Repository, folder: str, s: StartSettings) -> dict:
    """Start vLLM's own server on ``folder``, time it to /health and to its first answer, stop it."""
    load = round(os.getloadavg()[0], 2)
    began = time.monotonic()
    server = start_standalone(run_dir, repo, folder, timeout_s=s.startup_timeout_s)
    try:
        up = time.monotonic() - began
        server.warm_up(count=1, timeout_s=s.startup_timeout_s)
        answered = time.monotonic() - began
    finally:
        server.stop()
    return {"start_s": round(up, 1), "first_answer_s": round(answered, 1), "load_average": load}


def summarize(starts: list[dict], dtype: str) -> dict:
    """One dtype's figures: the cold start, eager and warm medians, and the median over the turns
    of (warm - eager) to the first answer, with the verdict on compiled as the default."""
    rows = [r for r in starts if r["dtype"] == dtype]
    by_kind = {kind: [r for r in rows if r["kind"] == kind] for kind in ("cold", "eager", "warm")}
    if not by_kind["cold"] or not by_kind["eager"] or not by_kind["warm"]:
        return {}
    eager = {r["turn"]: r["first_answer_s"] for r in by_kind["eager"]}
    extra = [r["first_answer_s"] - eager[r["turn"]] for r in by_kind["warm"] if r["turn"] in eager]
    median_extra = round(statistics.median(extra), 1)
    return {
        "cold_s": by_kind["cold"][0]["first_answer_s"],
        "eager_s": round(statistics.median(eager.values()), 1),
        "warm_s": round(statistics.median(r["first_answer_s"] for r in by_kind["warm"]), 1),
        "warm_minus_eager_s": [round(x, 1) for x in extra],
        "median_warm_minus_eager_s": median_extra,
        "compiled_acceptable": median_extra <= ACCEPTABLE_EXTRA_S,
    }


def run(
    run_dir: str | os.PathLike,
    settings: StartSettings | None = None,
    *,
    source: str | os.PathLike | None = None,
) -> StartResult:
    """Every start of :func:`plan`, one at a time; write and return the result."""
    s = (settings or StartSettings()).check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    repo = prepare_run_repository(run_dir, source=source)
    folders = write_folders(repo, s)
    result = StartResult(plain_settings(asdict(s)), host_facts(), str(run_dir))
    began = time.monotonic()
    for dtype, kind, turn in plan(s):
        cache = run_dir / f"vllm-cache-{dtype}"
        with environment(**{CACHE_ROOT: str(cache), INDUCTOR_CACHE: str(cache / "inductor")}):
            figures = time_start(run_dir, repo, folders[(dtype, kind == "eager")], s)
        result.starts.append({"dtype": dtype, "kind": kind, "turn": turn, **figures})
        if kind == "cold":
            result.cache[dtype] = {"path": str(cache), "bytes": folder_bytes(cache)}
        write_result(run_dir, RESULT_NAME, result)  # what is measured so far survives a failure
    result.summary = {dtype: summarize(result.starts, dtype) for dtype in s.dtypes}
    result.wall_s = round(time.monotonic() - began, 1)
    write_result(run_dir, RESULT_NAME, result)
    return result


def table(result: StartResult) -> str:
    """Every start, then each dtype's summary."""
    lines = [f"{'dtype':<10}{'start':<7}{'turn':>5}{'to /health s':>14}{'to 1st answer s':>17}"
             f"{'load avg':>10}"]  # fmt: skip
    for r in result.starts:
        lines.append(
            f"{r['dtype']:<10}{r['kind']:<7}{r['turn']:>5}{r['start_s']:>14.1f}"
            f"{r['first_answer_s']:>17.1f}{r['load_average']:>10.2f}"
        )
    for dtype, figures in result.summary.items():
        if not figures:
            continue
        size = result.cache.get(dtype, {}).get("bytes", 0) / 2**20
        lines.append(
            f"{dtype}: cold {figures['cold_s']:.1f} s, eager {figures['eager_s']:.1f} s, warm "
            f"{figures['warm_s']:.1f} s; warm - eager median {figures['median_warm_minus_eager_s']:+.1f}"
            f" s over {len(figures['warm_minus_eager_s'])} turns; compile cache {size:.1f} MiB; "
            f"compiled as the default: {'yes' if figures['compiled_acceptable'] else 'no'} "
            f"(at most {ACCEPTABLE_EXTRA_S:g} s more than eager)"
        )
    return "\n".join(lines)
