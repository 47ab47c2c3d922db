"""Notebook 04's exercise: a latency budget as Model Analyzer's own constraint, and its pick.

Rerunning Model Analyzer's search takes minutes; its constraint is applied to measurements it has
already made. So the learner writes the constraint (the YAML Model Analyzer reads,
``constraints: {perf_latency_p99: {max: N}}``, global or under ``profile_models``) for the budget
the notebook prints, and names the configuration Model Analyzer would then pick. The check parses
the constraint with Model Analyzer's own config parser, applies it to the search's measurements as
Model Analyzer does (the highest throughput among the measurements that meet it), then deploys the
pick on the live server and reads back what the server reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from labkit.exercises.check import Check, Exercise, failed, not_done, passed, register, untouched
from labkit.profiling.analyzer import apply_config, best_config
from labkit.server import served_config

KEY = "04-latency-budget"
TITLE = "A latency budget for Model Analyzer"
TODO = (
    "MY_CONSTRAINT: the Model Analyzer constraint for the budget printed above (YAML text or a "
    "dict); MY_PICK: the configuration Model Analyzer would then pick, by its name in the table."
)
#: The constraint key of the task and the measurement it bounds (Model Analyzer's names).
LATENCY_KEY = "perf_latency_p99"
#: The top-level keys of Model Analyzer's config that carry constraints.
CONSTRAINT_PLACES = ("constraints", "profile_models")


@dataclass(frozen=True)
class Budget:
    """The p99 budget the notebook states for its own search: ``ms`` (whole milliseconds, as
    Model Analyzer's constraint takes), the unconstrained ``winner``, whether the budget leaves
    the winner out, and the configurations it leaves out."""

    ms: int
    winner: str
    excludes_winner: bool
    excluded: tuple[str, ...]

    def __str__(self) -> str:
        said = f"The budget for this run: p99 latency at most {self.ms} ms."
        if self.excludes_winner:
            return f"{said} It leaves out the search's winner, {self.winner}."
        out = ", ".join(self.excluded) or "no configuration"
        return (
            f"{said} It leaves out {out}, but not the search's winner, {self.winner}: the winner "
            "also measured the lowest p99, so no budget can leave it out in this run (with a fixed "
            "number of clients, the configuration that serves the most requests a second usually "
            "answers each one soonest)."
        )


def latency_budget(result) -> Budget:
    """A whole-millisecond p99 budget, taken from the search's own measurements, that leaves out
    the unconstrained winner and keeps another configuration; where the winner measured the
    lowest p99 (often: at one client count, more requests a second means shorter waits), a budget
    that leaves out the slowest instead. The budget keeps half a millisecond or more from every
    measurement, so the table's p99, rounded to the millisecond, decides it too."""
    frame = result.inference
    winner = best_config(result)
    # per configuration, its lowest p99: a configuration meets a budget if one measurement does
    lowest = frame.groupby("config")["p99_ms"].min().sort_values()
    others = lowest.drop(winner)
    if len(others) and lowest[winner] > others.min():
        # the winner's lowest p99 and every p99 below it: split the widest gap among those
        below = lowest[lowest <= lowest[winner]]
        ms = _split(below.tolist(), upto=len(below) - 1)
        if ms is not None:
            return Budget(ms, winner, True, tuple(lowest[lowest > ms].index))
    ms = _split(lowest.tolist(), upto=len(lowest) - 1) if len(lowest) > 1 else None
    if ms is None:  # every configuration within a millisecond or two: nothing to leave out
        ms = math.ceil(lowest.max()) + 1
    return Budget(ms, winner, False, tuple(lowest[lowest > ms].index))


def _split(values: list[float], *, upto: int) -> int | None:
    """A whole number of ms in the widest gap of 3 ms or more between ``values`` (sorted) up to
    ``values[upto]``, half a ms or more from both sides, or None."""
    gaps = [(values[i + 1] - values[i], i) for i in range(upto) if values[i + 1] - values[i] >= 3]
    if not gaps:
        return None
    _, i = max(gaps)
    return math.floor((values[i] + values[i + 1]) / 2)


def check_budget(answer: Any, *, result, server=None, model: str) -> Check:
    """Judge ``(constraint, pick)`` against the search's measurements, then deploy the pick."""
    parts = answer if isinstance(answer, tuple) else (answer, ...)
    if len(parts) != 2:
        return failed(
            TITLE,
            f"an answer of {len(parts)} parts",
            "two: (MY_CONSTRAINT, MY_PICK)",
            "pass the two variables of the cell above, as shipped in the check cell.",
        )
    constraint, pick = parts
    if untouched(constraint) or untouched(pick):
        missing = [n for n, v in (("MY_CONSTRAINT", constraint), ("MY_PICK", pick)) if untouched(v)]
        return not_done(TITLE, f"fill in {' and '.join(missing)} too. " + TODO)
    budget = latency_budget(result)
    parsed = parse_constraint(constraint, model)
    if isinstance(parsed, Check):
        return parsed
    if set(parsed) != {LATENCY_KEY}:
        return failed(
            TITLE,
            f"Model Analyzer accepts your constraint, and it bounds {', '.join(sorted(parsed))}",
            f"one bound: {LATENCY_KEY} (the p99 latency the table shows), max {budget.ms}",
            f"the budget is on p99 latency; write constraints: {{{LATENCY_KEY}: {{max: {budget.ms}}}}}.",
        )
    limit = parsed[LATENCY_KEY]["max"]
    if limit != budget.ms:
        return failed(
            TITLE,
            f"{LATENCY_KEY} max {limit} ms (as Model Analyzer reads it: whole milliseconds)",
            f"the budget the notebook printed: max {budget.ms}",
            "copy the budget from the line printed above the cell you edited.",
        )
    return _judge_pick(result, budget, pick, server, model)


def parse_constraint(constraint: Any, model: str) -> dict | Check:
    """The constraints that apply to ``model``, as Model Analyzer's own parser reads ``constraint``
    (YAML text or a dict), or a failed Check saying what it refused."""
    import yaml  # noqa: PLC0415 (only the check needs a YAML parser)

    if isinstance(constraint, str):
        try:
            constraint = yaml.safe_load(constraint)
        except yaml.YAMLError as exc:
            return failed(
                TITLE,
                f"text that is not YAML: {exc}",
                "YAML such as constraints:, then perf_latency_p99: and max: <ms>, each indented",
                "indent each level by two spaces, and put a space after each colon.",
            )
    shape = "constraints: {perf_latency_p99: {max: <ms>}}"
    if not isinstance(constraint, dict):
        return failed(
            TITLE,
            f"a {type(constraint).__name__}: {constraint!r}",
            f"a Model Analyzer config with constraints: {shape}",
            "write the constraint as Model Analyzer's YAML, starting with its key constraints:.",
        )
    refused = _refused_by_model_analyzer(constraint)
    if refused:
        return failed(
            TITLE,
            f"Model Analyzer's config parser refuses it: {refused}",
            f"a constraint Model Analyzer knows: {shape}",
            "its latency keys all start with perf_ (perf_latency_p99, perf_latency_avg, ...), "
            "and a latency bound is a max.",
        )
    others = sorted(set(constraint) - set(CONSTRAINT_PLACES))
    if others:
        return failed(
            TITLE,
            f"Model Analyzer options beside the constraint: {', '.join(others)}",
            f"only a constraint: {shape}, or the same under profile_models: {{{model}: ...}}",
            "leave the search's other options as the notebook set them; write only the constraint.",
        )
    models = constraint.get("profile_models")
    models = models if isinstance(models, dict) else {}
    mine = models.get(model) or {}
    found = mine.get("constraints") or constraint.get("constraints")
    if not found:
        named = ", ".join(models) or "none"
        return failed(
            TITLE,
            f"no constraint that applies to {model} (models under profile_models: {named})",
            f"{shape}, for every model, or under profile_models: {{{model}: ...}}",
            f"a constraint under profile_models applies to the model it is written under: {model}.",
        )
    return _as_model_analyzer_reads(found)


def _refused_by_model_analyzer(constraint: dict) -> str:
    """Model Analyzer's own complaint about ``constraint``'s keys and values, or ''."""
    from model_analyzer.config.input.config_command_profile import (  # noqa: PLC0415 (0.4 s)
        ConfigCommandProfile,
    )
    from model_analyzer.model_analyzer_exceptions import (  # noqa: PLC0415
        TritonModelAnalyzerException,
    )

    fields = ConfigCommandProfile()._fields
    unknown = [str(k) for k in constraint if k not in fields]
    if unknown:
        return f"{', '.join(unknown)} is not one of its options"
    for key, value in constraint.items():
        try:
            fields[key].set_value(value)
        except TritonModelAnalyzerException as exc:
            return str(exc).replace('field "None.', 'field "').replace(' in field "None"', "")
    return ""


def _as_model_analyzer_reads(constraints: dict) -> dict:
    """``constraints`` with each bound as Model Analyzer keeps it (an int: it truncates 300.5)."""
    return {key: {k: int(v) for k, v in bounds.items()} for key, bounds in constraints.items()}


def _judge_pick(result, budget: Budget, pick: Any, server, model: str) -> Check:
    expected = best_config(result, p99_budget_ms=budget.ms)
    frame = result.inference
    lowest = frame.groupby("config")["p99_ms"].min()
    fastest = frame.groupby("config")["throughput"].max()

    def figures(name: str) -> str:
        return f"{fastest[name]:.2f} infer/s, p99 {lowest[name]:.0f} ms"

    if pick not in result.configs:
        return failed(
            TITLE,
            f"MY_PICK = {pick!r}, which the search did not measure",
            f"one of {', '.join(sorted(result.configs))}",
            "copy the name from the configuration column of the search's table.",
        )
    if pick != expected:
        if lowest[pick] > budget.ms:
            whose = " (the unconstrained winner)" if pick == budget.winner else ""
            seen = f"{pick}{whose}: {figures(pick)}, over the {budget.ms} ms budget"
            hint = (
                "Model Analyzer first drops every configuration whose p99 is over the budget, "
                "then ranks the rest by throughput."
            )
        else:
            seen = f"{pick}: {figures(pick)}, within the budget, but not the fastest within it"
            hint = "among the configurations within the budget, take the highest infer/s."
        return failed(
            TITLE,
            seen,
            f"the highest throughput within p99 {budget.ms} ms: {expected} ({figures(expected)})",
            hint,
        )
    said = (
        f"constraints: {{{LATENCY_KEY}: {{max: {budget.ms}}}}} passes Model Analyzer's config "
        f"parser; within it the highest throughput is {pick} ({figures(pick)})"
    )
    if budget.excludes_winner:
        said += f", not the unconstrained winner {budget.winner} ({figures(budget.winner)})"
    if server is None or not getattr(server, "running", True):
        return passed(TITLE, said + "; no live server to deploy it on (it was stopped).")
    return _deployed(result, pick, server, model, said)


def _deployed(result, pick: str, server, model: str, said: str) -> Check:
    """Write ``pick``'s config as ``model``'s, reload it live and read back what Triton serves."""
    apply_config(result, pick, server, model)
    served = served_config(server, model)
    instances = sum(int(g.get("count", 1)) for g in served.get("instance_group", [])) or 1
    batch = int(served.get("max_batch_size", 0))
    want = result.configs[pick]
    if (instances, batch) != (want["instances"], want["max_batch_size"]):
        return failed(
            TITLE,
            f"after the reload the server reports {model} with {instances} instance(s), max batch "
            f"size {batch}",
            f"{pick}'s {want['instances']} instance(s), max batch size {want['max_batch_size']}",
            "the reload did not take the new config.pbtxt; read the server log's last lines.",
        )
    return passed(
        TITLE,
        f"{said}. Deployed: the server now reports {model} with {instances} instance(s) and max "
        f"batch size {batch}, {pick}'s settings.",
    )


def solve_budget(*, result, **_: Any) -> tuple[str, str]:
    """The reference answer: the printed budget as Model Analyzer's YAML, and its pick."""
    budget = latency_budget(result)
    constraint = f"constraints:\n  {LATENCY_KEY}:\n    max: {budget.ms}\n"
    return constraint, best_config(result, p99_budget_ms=budget.ms)


register(Exercise(KEY, TITLE, TODO, check_budget, solve_budget))
