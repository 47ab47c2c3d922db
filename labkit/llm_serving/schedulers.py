"""The ways the lab serves its text model, and the settings of a study that compares them.

Each way (a *scheduler*) is a model folder in the run's repository copy: ``none`` (one request at
a time), ``dynamic`` (Triton's dynamic batcher, ``max_batch_size`` + ``dynamic_batching {}``),
``inflight`` (the model's own in-flight engine), ``vllm`` (the same checkpoint on vLLM's engine,
``smollm2_vllm``, in its own environment) and ``vllm_bf16`` (a twin of it computing in bfloat16).
Another way is one more name in :data:`SCHEDULERS` and one more branch in
:func:`write_scheduler_folders`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from labkit import hardware, profiling
from labkit.errors import ConfigError, MissingDependencyError
from labkit.repository import Repository, apply_edits, prepare_repository
from labkit.repository.folder import EXECUTION_ENV_PATH
from labkit.repository.textgen import serving_threads

#: The ways the lab serves its text model, in the order a study measures them.
SCHEDULERS = ("none", "dynamic", "inflight", "vllm", "vllm_bf16")
#: The vLLM ways and the dtype each one's engine computes in.
VLLM_DTYPES = {"vllm": "float32", "vllm_bf16": "bfloat16"}
#: The study's workloads: answers of a fixed 16 tokens, and lengths drawn from a range.
WORKLOADS = ("fixed16", "mixed")


@dataclass
class StudySettings:
    """One server, one run: every scheduler against the same workloads and clients."""

    model: str = "smollm2"  # the plain folder: no batching, and the base of dynamic batching
    inflight_model: str = "smollm2_inflight"  # the in-flight folder (its limits are measured)
    vllm_model: str = "smollm2_vllm"  # the vLLM folder (its environment: .venv-vllm)
    standalone: bool = True  # with vllm: vLLM's own OpenAI server on the same settings, measured
    # servers on every core but the last, AIPerf on the last; None: so when the host has two
    pin: bool | None = None
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

    def check(self) -> StudySettings:
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
        self.cores()  # pinning on one core: said before anything starts
        return self

    def cores(self) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """``(server, client)`` cores when pinned, else ``(None, None)``."""
        pin = len(hardware.usable_cores()) >= 2 if self.pin is None else self.pin
        return hardware.split_cores() if pin else (None, None)


def check_vllm_environment(repo: Repository, model: str) -> None:
    """Refuse, before anything is measured, a vLLM model whose environment is missing."""
    if model not in repo.models():
        raise ConfigError(f"the vllm scheduler serves {model!r}, which {repo.path} does not hold")
    env = repo.config(model).parameters.get(EXECUTION_ENV_PATH)
    folder = env.string_value if env is not None else ""
    if not folder or not (Path(folder) / "bin" / "python").exists():
        raise MissingDependencyError(
            f"the vllm scheduler needs {model}'s environment ({folder or 'none named'}): run "
            "`make install` to create .venv-vllm, or leave vllm out (--scheduler "
            "none,dynamic,inflight)"
        )


def workload(name: str, s: StudySettings) -> profiling.Workload:
    """The benchmark's workload ``name``: the same prompts and lengths for every scheduler."""
    count = max(s.requests, 2 * max(s.concurrency))
    if name == "fixed16":
        return profiling.fixed_workload(count, s.fixed_tokens, s.seed)
    return profiling.mixed_workload(count, s.mixed_low, s.mixed_high, s.seed)


def write_scheduler_folders(repo: Repository, s: StudySettings) -> dict[str, dict[bool, str]]:
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
    for scheduler in VLLM_DTYPES.keys() & set(s.schedulers):
        check_vllm_environment(repo, s.vllm_model)
        name = s.vllm_model + scheduler.removeprefix("vllm")  # smollm2_vllm, smollm2_vllm_bf16
        config = apply_edits(
            repo.config(s.vllm_model), parameters={"dtype": VLLM_DTYPES[scheduler]}
        )
        if name == s.vllm_model:
            repo.write_config(name, config)
        else:
            repo.add_twin(s.vllm_model, name, config)
        names[scheduler] = {False: name, True: name}
    prepare_repository(repo.path)
    return names
