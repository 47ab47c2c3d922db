"""Notebook 04's exercise, ``04-latency-budget``: a p99 budget written as Model Analyzer's own
constraint, applied to the search's measurements, and the pick deployed. A finished search's
files are written here (Model Analyzer's CSV and its variants' configs), so no search runs; the
constraint is parsed by Model Analyzer's real config parser, and the deployment runs on a real
Triton serving a small numpy model in the variants' place."""

from __future__ import annotations

import pytest

from conftest import write_python_model
from labkit import exercises
from labkit.exercises import analyzer as exercise
from labkit.profiling import analyzer
from labkit.server import served_config

KEY = "04-latency-budget"
MODEL = "echo"
#: A search's measurements, Model Analyzer's winner first: config_1 serves the most requests a
#: second but with a long tail (p99 700 ms); config_0 is nearly as fast and within 650 ms.
ROWS = {  # variant -> (instances, max batch size, infer/s, p99 ms)
    "echo_config_1": (2, 8, 8.4, 700.0),
    "echo_config_0": (2, 4, 8.1, 610.0),
    "echo_config_default": (1, 8, 7.6, 600.0),
    "echo_config_2": (1, 4, 7.2, 640.0),
}
ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(
            r, "x").as_numpy())]) for r in requests]
"""


def echo_config(name: str, instances: int, batch: int) -> str:
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {batch}\ndynamic_batching {{}}\n'
        'input { name: "x" data_type: TYPE_FP32 dims: [1] }\n'
        'output { name: "y" data_type: TYPE_FP32 dims: [1] }\n'
        f"instance_group {{ count: {instances} kind: KIND_CPU }}\n"
    )


def search(run, rows=ROWS):
    """A finished Model Analyzer run's files, read as notebook 04 reads them."""
    results = run / "analysis" / "results"
    results.mkdir(parents=True)
    lines = [
        "Model,Batch,Concurrency,Model Config Path,Instance Group,Max Batch Size,"
        "Satisfies Constraints,Throughput (infer/sec),p99 Latency (ms)"
    ]
    for name, (instances, batch, throughput, p99) in rows.items():
        lines.append(f"{MODEL},1,4,{name},{instances}:CPU,{batch},Yes,{throughput},{p99}")
        folder = run / "output_model_repository" / name
        folder.mkdir(parents=True)
        (folder / "config.pbtxt").write_text(echo_config(name, instances, batch))
    (results / "metrics-model-inference.csv").write_text("\n".join(lines) + "\n")
    return analyzer.load_results(run)


def judged(answer, result, **context):
    return exercises.run(KEY, answer, result=result, model=MODEL, **context)


def constraint(ms, key="perf_latency_p99") -> str:
    return f"constraints:\n  {key}:\n    max: {ms}\n"


def test_the_budget_leaves_out_the_winner_and_keeps_a_faster_one_than_the_default(tmp_path):
    budget = exercise.latency_budget(search(tmp_path))
    assert budget.excludes_winner and budget.winner == "echo_config_1"
    assert 641 <= budget.ms <= 699 and "leaves out the search's winner" in str(budget)


def test_where_the_winner_is_also_the_quickest_the_budget_says_so(tmp_path):
    rows = {**ROWS, "echo_config_1": (2, 8, 8.4, 590.0)}
    budget = exercise.latency_budget(search(tmp_path, rows))
    assert not budget.excludes_winner and "no budget can leave it out" in str(budget)
    assert exercises.run(KEY, solutions=True, result=search(tmp_path / "2", rows), model=MODEL)


def test_the_reference_answer_passes_without_a_server_and_says_so(tmp_path):
    result = search(tmp_path)
    outcome = judged(exercise.solve_budget(result=result), result)
    assert outcome.passed, outcome
    assert "echo_config_0" in outcome.seen and "not the unconstrained winner" in outcome.seen
    assert "no live server" in outcome.seen


def test_untouched_cells_are_not_done_yet(tmp_path):
    result = search(tmp_path)
    assert judged(..., result).status == exercises.NOT_DONE
    half = judged((constraint(650), ...), result)
    assert half.status == exercises.NOT_DONE and "MY_PICK" in half.expected


def test_a_key_model_analyzer_does_not_know_fails_with_its_parser_words(tmp_path):
    result = search(tmp_path)
    ms = exercise.latency_budget(result).ms
    outcome = judged((constraint(ms, key="latency_p99"), "echo_config_0"), result)
    assert outcome.status == exercises.FAILED
    assert "parser refuses" in outcome.seen and '"latency_p99"' in outcome.seen


def test_the_unconstrained_winner_fails_as_over_the_budget(tmp_path):
    result = search(tmp_path)
    ms = exercise.latency_budget(result).ms
    outcome = judged((constraint(ms), "echo_config_1"), result)
    assert outcome.status == exercises.FAILED
    assert "(the unconstrained winner)" in outcome.seen and "p99 700 ms" in outcome.seen
    assert "echo_config_0" in outcome.expected


def test_a_pick_within_the_budget_but_not_the_fastest_fails(tmp_path):
    result = search(tmp_path)
    ms = exercise.latency_budget(result).ms
    outcome = judged((constraint(ms), "echo_config_default"), result)
    assert outcome.status == exercises.FAILED and "not the fastest within it" in outcome.seen


def test_a_budget_other_than_the_printed_one_fails(tmp_path):
    result = search(tmp_path)
    outcome = judged((constraint(800), "echo_config_1"), result)
    assert outcome.status == exercises.FAILED and "max 800 ms" in outcome.seen


def test_a_per_model_constraint_counts_only_under_the_model_it_names(tmp_path):
    result = search(tmp_path)
    ms = exercise.latency_budget(result).ms
    bound = {"constraints": {"perf_latency_p99": {"max": ms}}}
    assert judged(({"profile_models": {MODEL: bound}}, "echo_config_0"), result).passed
    other = judged(({"profile_models": {"echo2": bound}}, "echo_config_0"), result)
    assert other.status == exercises.FAILED and "no constraint that applies to echo" in other.seen


@pytest.mark.integration
def test_the_pick_is_deployed_and_the_server_reports_its_settings(tmp_path, start_server):
    result = search(tmp_path / "run")
    repo = tmp_path / "repo"
    write_python_model(repo, MODEL, ECHO, echo_config(MODEL, 1, 8))
    server = start_server(repo, load_models=[MODEL])
    outcome = exercises.run(KEY, solutions=True, result=result, server=server, model=MODEL)
    assert outcome.passed, outcome
    served = served_config(server, MODEL)
    assert (served["max_batch_size"], served["instance_group"][0]["count"]) == (4, 2)
    assert "2 instance(s) and max batch size 4" in outcome.seen
