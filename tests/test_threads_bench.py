"""``labkit bench threads``: the summary of its rounds (medians, spread, best thread count, the
default's share of the best), its settings and perf_analyzer options, and one real run on
tiny-falcon behind two replicas."""

from __future__ import annotations

import json

import psutil
import pytest

from labkit.cluster import locate_haproxy, threads
from labkit.errors import ConfigError, MissingDependencyError
from labkit.repository.textgen import thread_budget

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
