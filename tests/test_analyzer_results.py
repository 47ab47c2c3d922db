"""What labkit reads from a finished Model Analyzer run, without running one: its own ranking (the
winner its report names), each measurement's exact figures from perf_analyzer's output, and the
configurations to measure again."""

from __future__ import annotations

import textwrap

import pytest

from labkit.errors import ConfigError
from labkit.profiling import analyzer

#: Model Analyzer's CSV, best first, its throughput cut to one decimal: config_1 and config_0 tie
#: there (8.2), and Model Analyzer ranked config_1 first from the exact figures.
CSV = """\
Model,Batch,Concurrency,Model Config Path,Instance Group,Max Batch Size,Satisfies Constraints,\
Throughput (infer/sec),p99 Latency (ms),Server Queue time (ms),Server Compute Infer time (ms),\
RAM Usage (MB)
smollm2,1,4,smollm2_config_1,1:CPU,8,Yes,8.2,600.0,150.0,330.0,5.0
smollm2,1,4,smollm2_config_0,1:CPU,4,Yes,8.2,610.0,160.0,331.0,5.0
smollm2,1,4,smollm2_config_default,1:CPU,8,Yes,7.6,650.0,170.0,340.0,5.0
smollm2,1,4,smollm2_config_3,2:CPU,8,Yes,5.9,900.0,100.0,700.0,6.0
smollm2,1,4,smollm2_config_2,2:CPU,4,Yes,5.3,950.0,110.0,720.0,6.0
"""
#: The order Model Analyzer measured them in, and what perf_analyzer printed for each.
MEASURED = [
    ("smollm2_config_default", 7.6123, 36, 15),
    ("smollm2_config_0", 8.15904, 36, 16),
    ("smollm2_config_1", 8.15974, 40, 16),
    ("smollm2_config_2", 5.3341, 32, 22),
    ("smollm2_config_3", 5.9012, 36, 22),
]
SETTINGS = {  # variant -> (max_batch_size, instances)
    "smollm2_config_default": (8, 1),
    "smollm2_config_0": (4, 1),
    "smollm2_config_1": (8, 1),
    "smollm2_config_2": (4, 2),
    "smollm2_config_3": (8, 2),
}


def write_run(run, measured=MEASURED, logged=None):
    """A finished run's files: Model Analyzer's CSV, its variants' configs, its log of what it
    measured (``measured``) and perf_analyzer's output (``logged``, by default the same)."""
    results = run / "analysis" / "results"
    results.mkdir(parents=True)
    (results / "metrics-model-inference.csv").write_text(CSV)
    for name, (batch, instances) in SETTINGS.items():
        folder = run / "output_model_repository" / name
        folder.mkdir(parents=True)
        (folder / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: {batch}\ndynamic_batching {{}}\n'
            f"instance_group {{ count: {instances} kind: KIND_CPU }}\n"
        )
    (run / "model-analyzer.log").write_text(
        "[Model Analyzer] Profiling server only metrics...\n"
        + "".join(f"[Model Analyzer] Profiling {n}: concurrency=4\n" for n, *_ in measured)
    )
    (run / "perf_analyzer.log").write_text(
        "".join(
            textwrap.dedent(f"""\
            ============== Perf Analyzer Launched ==============
            Request concurrency: 4
              Client:
                Request count: {inferences}
                Throughput: {throughput} infer/sec
              Server:
                Inference count: {inferences}
                Execution count: {executions}
            """)
            for _, throughput, inferences, executions in (logged or measured)
        )
    )
    return analyzer.load_results(run)


def test_the_winner_is_the_one_model_analyzer_ranks_first_where_its_csv_ties(tmp_path):
    result = write_run(tmp_path)
    # sorted by name, config_0 would win the CSV's tie at 8.2; Model Analyzer named config_1
    assert analyzer.best_config(result) == "smollm2_config_1"
    assert list(analyzer.ranked(result)["config"])[:3] == [
        "smollm2_config_1",
        "smollm2_config_0",
        "smollm2_config_default",
    ]


def test_each_measurement_gets_its_exact_throughput_and_requests_per_execution(tmp_path):
    table = analyzer.ranked(write_run(tmp_path)).set_index("config")
    assert table.loc["smollm2_config_1", "throughput"] == pytest.approx(8.15974)
    assert table.loc["smollm2_config_1", "avg_batch_size"] == pytest.approx(2.5)
    assert table.loc["smollm2_config_default", "avg_batch_size"] == pytest.approx(36 / 15)


def test_a_log_that_does_not_pair_with_the_csv_leaves_the_csvs_figures(tmp_path):
    # a measurement whose log figure does not round to the CSV's: a repeated or skipped one
    # broke the pairing, so the CSV's one decimal is all there is
    odd = [MEASURED[0], ("smollm2_config_0", 9.9, 40, 16), *MEASURED[2:]]
    table = analyzer.ranked(write_run(tmp_path / "odd", odd)).set_index("config")
    assert table.loc["smollm2_config_0", "throughput"] == pytest.approx(8.2)
    assert table["avg_batch_size"].isna().sum() == 1
    # a log with one measurement fewer than Model Analyzer's lines pairs nothing
    table = analyzer.ranked(write_run(tmp_path / "short", logged=MEASURED[:4])).set_index("config")
    assert table["avg_batch_size"].isna().all()
    assert table.loc["smollm2_config_1", "throughput"] == pytest.approx(8.2)


def test_the_summary_says_what_each_configuration_changes_in_a_learners_words(tmp_path):
    table = analyzer.summary(write_run(tmp_path))
    assert "_" not in " ".join(table.columns)
    changes = dict(zip(table["configuration"], table["change from the default"], strict=True))
    assert changes == {
        "smollm2_config_1": "none",
        "smollm2_config_0": "max batch size 8 -> 4",
        "smollm2_config_default": "none",
        "smollm2_config_3": "2 instances",
        "smollm2_config_2": "max batch size 8 -> 4, 2 instances",
    }
    assert list(table["rank"]) == [1, 2, 3, 4, 5]
    # figures as a learner reads them, not pandas' six decimals
    assert list(table["infer/s"])[:2] == ["8.16", "8.16"]
    assert list(table["requests per execution"])[:2] == ["2.5", "2.2"]


def test_a_p99_budget_picks_the_fastest_within_it(tmp_path):
    result = write_run(tmp_path)
    assert analyzer.best_config(result, p99_budget_ms=605) == "smollm2_config_1"
    assert analyzer.best_config(result, p99_budget_ms=920) == "smollm2_config_1"
    with pytest.raises(ConfigError, match="lowest: 600.0 ms"):
        analyzer.best_config(result, p99_budget_ms=100)


def test_the_contenders_are_the_default_and_the_best_change_of_each_instance_count(tmp_path):
    result = write_run(tmp_path)
    each = ["smollm2_config_default", "smollm2_config_0", "smollm2_config_3"]
    # config_1, the winner, has the default's own settings: the default stands for it
    assert analyzer.contenders(result, "smollm2_config_1") == each
    assert analyzer.contenders(result, "smollm2_config_default") == each
    # a winner picked by a latency budget, not by rank, is measured too
    assert analyzer.contenders(result, "smollm2_config_2") == [*each, "smollm2_config_2"]


def test_the_contenders_are_served_side_by_side_as_twins_of_the_model(tmp_path):
    from labkit.repository import Repository, read_config

    result = write_run(tmp_path / "run")
    repo = Repository(tmp_path / "repo", create=True)
    model = repo.path / "smollm2"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text("# the model\n")
    (model / "config.pbtxt").write_text('name: "smollm2"\nbackend: "python"\nmax_batch_size: 8\n')
    served = analyzer.serve_contenders(
        result, repo, "smollm2", ["smollm2_config_default", "smollm2_config_3"]
    )
    assert served == {"smollm2_config_default": "smollm2", "smollm2_config_3": "smollm2_config_3"}
    twin = read_config(repo.path / "smollm2_config_3" / "config.pbtxt")
    assert (twin.name, twin.instance_group[0].count) == ("smollm2_config_3", 2)
    assert (repo.path / "smollm2_config_3" / "1" / "model.py").is_file()


def _starved_once(calls: list, message: str):
    """perf_analyzer's stand-in: its first call fails with ``message``, the next measure."""
    import pandas as pd

    from labkit.errors import ToolError

    def fake(server, model, *, label, **options):
        calls.append(label)
        if len(calls) == 1:
            raise ToolError(f"perf_analyzer failed for {label!r}: {message}")
        return pd.DataFrame([{"concurrency": 4, "throughput": 5.0, "avg_batch_size": 2.0,
                              "compute_infer_ms": 300.0, "p99_ms": 900.0}])  # fmt: skip

    return fake


def test_a_round_whose_stub_missed_its_health_window_is_measured_once_more(monkeypatch):
    calls: list[str] = []
    starved = "Thread [0] had error: Stub process 'smollm2_0' is not healthy."
    monkeypatch.setattr(analyzer, "perf_analyzer", _starved_once(calls, starved))
    monkeypatch.setattr(analyzer, "unhealthy", lambda server: {})  # every stub still runs
    rounds = analyzer.measure_rounds(object(), {"d": "smollm2"}, rounds=2, concurrency=4)
    assert calls == ["d round 1", "d round 1, again", "d round 2"]
    assert list(rounds["round"]) == [1, 2]


class _Server:
    """A started server's stand-in: records its stops and starts."""

    def __init__(self, running: bool = True) -> None:
        self.running, self.calls = running, []

    def stop(self) -> None:
        self.calls.append("stop")

    def start(self) -> None:
        self.calls.append("start")


def test_a_round_whose_stub_died_restarts_the_server_and_is_measured_once_more(monkeypatch):
    calls: list[str] = []
    died = "Failed to maintain requested inference load. terminate called"  # perf_analyzer -6
    monkeypatch.setattr(analyzer, "perf_analyzer", _starved_once(calls, died))
    dead = {"smollm2": "0 of 1 Python stub processes alive"}
    monkeypatch.setattr(analyzer, "unhealthy", lambda server: dead if not server.calls else {})
    server = _Server()
    rounds = analyzer.measure_rounds(server, {"d": "smollm2"}, rounds=2, concurrency=4)
    assert server.calls == ["stop", "start"]  # the whole server, not the model alone
    assert calls == ["d round 1", "d round 1, again", "d round 2"]
    assert list(rounds["round"]) == [1, 2]


def test_a_stub_that_dies_again_after_the_restart_is_raised(monkeypatch):
    from labkit.errors import ToolError

    def always_failing(server, model, *, label, **options):
        raise ToolError(f"perf_analyzer failed for {label!r}: terminate called")

    monkeypatch.setattr(analyzer, "perf_analyzer", always_failing)
    monkeypatch.setattr(analyzer, "unhealthy", lambda server: {"smollm2": "0 of 1 alive"})
    server = _Server()
    with pytest.raises(ToolError, match="'d round 1, again'"):
        analyzer.measure_rounds(server, {"d": "smollm2"}, rounds=2, concurrency=4)
    assert server.calls == ["stop", "start"]


def test_another_failure_is_raised_not_measured_again(monkeypatch):
    from labkit.errors import ToolError

    calls: list[str] = []
    monkeypatch.setattr(analyzer, "perf_analyzer", _starved_once(calls, "unexpected output"))
    monkeypatch.setattr(analyzer, "unhealthy", lambda server: {})
    server = _Server()
    with pytest.raises(ToolError, match="unexpected output"):
        analyzer.measure_rounds(server, {"d": "smollm2"}, rounds=2, concurrency=4)
    assert calls == ["d round 1"] and server.calls == []


@pytest.mark.parametrize("message", ["Stub process 'smollm2_0' is not healthy.", "timed out"])
def test_a_server_this_process_does_not_run_has_no_stubs_counted(monkeypatch, message):
    """A remote server, or one whose tritonserver ended: its stubs cannot be listed, so the
    failure is not taken for a dead stub (and not replaced by an error about listing them)."""
    from labkit.errors import ToolError

    calls: list[str] = []
    monkeypatch.setattr(analyzer, "perf_analyzer", _starved_once(calls, message))

    def no_stubs(server):
        raise AssertionError("a server this process does not run has no stubs to count")

    monkeypatch.setattr(analyzer, "unhealthy", no_stubs)
    server = _Server(running=False)
    if "not healthy" in message:  # a moment's missed heartbeat, as far as can be told
        analyzer.measure_rounds(server, {"d": "smollm2"}, rounds=2, concurrency=4)
        assert calls == ["d round 1", "d round 1, again", "d round 2"]
    else:
        with pytest.raises(ToolError, match="timed out"):
            analyzer.measure_rounds(server, {"d": "smollm2"}, rounds=2, concurrency=4)
    assert server.calls == []
