"""The in-process figures: the in-flight engine without Triton on the study's prompts (the limit a
served model could at most give), and float32 against bfloat16 on the same engine."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from labkit import profiling
from labkit.errors import ConfigError, ToolError
from labkit.repository import Repository
from labkit.repository.textgen import engine_config, engine_limits

from .schedulers import StudySettings


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


def inprocess_figures(repo: Repository, settings: StudySettings, workloads: dict) -> tuple:
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
    weights: Path, model32, tokenizer, w: profiling.Workload, limits: dict, s: StudySettings
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
