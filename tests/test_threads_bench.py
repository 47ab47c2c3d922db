"""``labkit bench threads``: the summary of its rounds (medians, spread, best thread count, the
default's share of the best), its settings and perf_analyzer options, and one real run on
tiny-falcon behind two replicas."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import psutil
import pytest

from labkit.cluster import locate_haproxy, threads
from labkit.errors import ConfigError, MissingDependencyError, ToolError
from labkit.repository import Repository
from labkit.repository.textgen import thread_budget

ROOT = Path(__file__).resolve().parents[1]
ONE, TWO, REP = (label for _, label, _, _ in threads.CASES)


def measured(case: str, concurrency: int, per_threads: dict[int, list[float]]) -> list[dict]:
    return [
        {"case": case, "threads": t, "concurrency": concurrency, "round": r,
         "throughput": value, "p99_ms": 100.0, "avg_batch_size": 2.0, "load_1m": 1.0 + r / 10}
        for t, values in per_threads.items() for r, value in enumerate(values, 1)
    ]  # fmt: skip


def test_each_thread_count_gets_its_median_spread_and_the_best_is_named():
    rounds = measured(ONE, 8, {1: [3.0, 2.0, 4.0], 2: [5.0, 6.0, 4.0]})
    (case,) = threads.summarize(rounds, (1, 2))
    assert (case["t1_median"], case["t2_median"]) == (3.0, 5.0)
    assert case["t1_spread"] == pytest.approx(2.0 / 3.0, abs=1e-3)  # (4 - 2) / 3
    assert case["t2_spread"] == pytest.approx(0.4)  # (6 - 4) / 5
    assert case["best_threads"] == 2
    assert case["t2_over_t1"] == pytest.approx(5 / 3, abs=1e-3)  # rounds: 5/3, 6/2, 4/4
    assert case["t2_over_t1_range"] == [1.0, 3.0]
    assert case["load_1m"] == [1.1, 1.3]
    default = thread_budget(1, 1)
    assert case["default_threads"] == default
    assert case["default_over_best"] == pytest.approx({1: 0.6, 2: 1.0}.get(default, 1.0), abs=1e-3)


def test_every_case_and_concurrency_is_summarized_with_its_own_default():
    rounds = [
        *measured(ONE, 1, {1: [10.0], 2: [9.0]}),
        *measured(TWO, 8, {1: [20.0], 2: [5.0]}),
        *measured(REP, 8, {1: [18.0], 2: [2.0]}),
    ]
    cases = threads.summarize(rounds, (1, 2))
    assert [(c["case"], c["concurrency"]) for c in cases] == [(ONE, 1), (TWO, 8), (REP, 8)]
    assert [c["best_threads"] for c in cases] == [1, 1, 1]
    assert cases[1]["default_threads"] == thread_budget(2, 1)
    assert cases[2]["default_threads"] == thread_budget(1, 2)


def test_a_thread_count_not_measured_has_no_ratio_and_the_table_shows_a_dash():
    rounds = measured(ONE, 8, {3: [4.0]})
    (case,) = threads.summarize(rounds, (3,))
    assert case["best_threads"] == 3
    assert "default_over_best" not in case or thread_budget(1, 1) == 3
    result = threads.ThreadsResult(
        model="m", settings={"threads": (3,)}, host={"cores": 2}, run_dir="r", cases=[case]
    )
    text = threads.table(result)
    assert text.splitlines()[0] == "m on 2 cores"
    assert "4.00 (0%)" in text


@pytest.mark.parametrize(
    "change, named",
    [({"rounds": 0}, "rounds"), ({"threads": (0, 2)}, "thread counts"),
     ({"threads": ()}, "thread counts"), ({"concurrencies": (0,)}, "concurrencies")],
)  # fmt: skip
def test_settings_that_cannot_be_measured_are_refused_by_name(change, named):
    with pytest.raises(ConfigError, match=named):
        threads.ThreadsSettings(**change).check()


def test_a_window_holds_fewer_requests_at_a_lower_concurrency_but_at_least_eight():
    s = threads.ThreadsSettings(concurrencies=(1, 4, 16), request_count=32)
    assert [threads._window(s, c) for c in (1, 4, 16)] == [8, 8, 32]


def test_thread_counts_and_concurrencies_are_measured_in_ascending_order():
    s = threads.ThreadsSettings(threads=(2, 1, 2), concurrencies=(8, 1)).check()
    assert (s.threads, s.concurrencies) == ((1, 2), (1, 8))


class FakeServer:
    def __init__(self) -> None:
        self.unloaded: list[str] = []

    def unload_model(self, name: str) -> None:
        self.unloaded.append(name)


class FakeCluster:
    def __init__(self) -> None:
        self.replicas = [SimpleNamespace(server=FakeServer()) for _ in range(2)]

    def replica(self, which: int):
        return self.replicas[which]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_a_measurement_that_fails_keeps_the_rounds_before_it_and_removes_the_twins(
    monkeypatch, tmp_path
):
    """Three measurements answer, the fourth fails: threads.json holds the three, marked partial;
    every twin is unloaded from both replicas and removed; the failure reaches the caller."""
    source = tmp_path / "run" / "model_repository" / "smollm2"
    shutil.copytree(ROOT / "model_repository" / "smollm2" / "1", source / "1")
    shutil.copy(ROOT / "model_repository" / "smollm2" / "config.pbtxt", source)
    repository = Repository(source.parent)
    cluster = FakeCluster()
    monkeypatch.setattr(threads, "prepare_run_repository", lambda *a, **k: repository)
    monkeypatch.setattr(threads, "start_cluster", lambda *a, **k: cluster)
    monkeypatch.setattr(threads, "reload", lambda *a, **k: "")
    monkeypatch.setattr(threads, "host_facts", lambda: {"cores": 2})
    answered = []

    def perf_analyzer(where, name, **options):
        if len(answered) == 3:
            raise ToolError("perf_analyzer: the model stopped answering")
        answered.append(name)
        return pd.DataFrame([{"throughput": 10.0, "p99_ms": 50.0, "avg_batch_size": 1.0}])

    monkeypatch.setattr(threads.profiling, "perf_analyzer", perf_analyzer)
    settings = threads.ThreadsSettings(model="smollm2", rounds=2, concurrencies=(1,))
    with pytest.raises(ToolError, match="stopped answering"):
        threads.measure_threads(tmp_path / "run", settings, progress=False)
    written = json.loads((tmp_path / "run" / "threads.json").read_text())
    assert written["partial"] is True
    assert [r["round"] for r in written["rounds"]] == [1, 1, 1]
    assert {r["case"] for r in written["rounds"]} == {ONE, TWO}  # the first three in the order
    twins = {f"smollm2_{k}_t{t}" for k in ("one", "two", "rep") for t in (1, 2)}
    assert set(cluster.replicas[0].server.unloaded) == twins
    assert not twins & set(repository.models())


# -- one real run --------------------------------------------------------------------------------
def ours(run_dir) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.integration
def test_a_real_run_measures_every_case_in_rounds_and_leaves_nothing_behind(tmp_path):
    try:
        locate_haproxy()
    except MissingDependencyError:
        pytest.skip("haproxy is not installed (make install installs Debian's haproxy)")
    settings = threads.ThreadsSettings(
        model="tiny-falcon", threads=(1,), concurrencies=(2,), rounds=2, max_tokens=4,
        request_count=4, timeout_s=120,
    )  # fmt: skip
    result = threads.measure_threads(tmp_path, settings, progress=False)
    assert len(result.rounds) == 3 * 2  # three cases, two rounds
    assert all(r["throughput"] > 0 for r in result.rounds)
    assert {r["case"] for r in result.rounds} == {ONE, TWO, REP}
    assert [c["best_threads"] for c in result.cases] == [1, 1, 1]
    written = json.loads((tmp_path / "threads.json").read_text())
    assert written["cases"] == result.cases
    repository = tmp_path / "model_repository"
    assert not [p.name for p in repository.iterdir() if p.name.startswith("tiny-falcon_")]
    assert ours(tmp_path) == []
