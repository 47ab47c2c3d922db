"""Model Analyzer runs for real (local launch mode, labkit's server) on a small model."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import wait_for, write_sleepy_model
from labkit import plots
from labkit.errors import ConfigError, ToolTimeoutError
from labkit.profiling import analyzer
from labkit.server import served_config, stubs, unhealthy
from labkit.server.locate import _is_labkit_wrapper, locate_tritonserver

pytestmark = pytest.mark.skipif(
    analyzer.find_model_analyzer() is None,
    reason="triton-model-analyzer is not installed (pip install triton-model-analyzer==1.58.0)",
)

SMALL = dict(max_model_batch_size=2, concurrency=[2], measurement_request_count=10)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyzer")
    write_sleepy_model(root / "repo", "sleepy", sleep_ms=10, batching=False)
    settings = analyzer.AnalyzerSettings(models=["sleepy"], **SMALL)
    result = analyzer.model_analyzer(
        root / "repo", root / "run", settings, timeout_s=500, progress=False
    )
    return root, result


@pytest.mark.integration
@pytest.mark.slow
def test_a_small_profile_run_measures_several_configurations(profiled):
    root, result = profiled
    frame = result.inference
    assert frame["config"].nunique() >= 2
    assert (frame["throughput"] > 0).all()
    assert (frame["p99_ms"] > 0).all()
    # Each variant's own config.pbtxt was read back: batching off in the default, on elsewhere.
    assert not result.configs["sleepy_config_default"]["dynamic_batching"]
    assert any(c["dynamic_batching"] for c in result.configs.values())
    table = analyzer.summary(result)
    assert list(table["rank"]) == sorted(table["rank"])  # Model Analyzer's order, winner first
    assert {"change from the default", "instances", "max batch size", "p99 latency (ms)"} <= set(
        table
    )
    # perf_analyzer's own output gave each measurement its requests per execution
    assert (analyzer.ranked(result)["avg_batch_size"] >= 1).all()
    assert any(p.name == "result_summary.html" for p in result.reports)
    assert len(plots.throughput_vs_latency(frame).data) == frame["config"].nunique()
    assert analyzer.leftover_servers(root / "run") == []
    # The wrapper Model Analyzer launched is not mistaken for a real server.
    wrapper = root / "run" / "bin" / "tritonserver"
    assert _is_labkit_wrapper(wrapper)
    assert locate_tritonserver().path != wrapper


@pytest.mark.integration
@pytest.mark.slow
def test_the_winner_is_applied_live(profiled, start_server, tmp_path):
    _, result = profiled
    winner = analyzer.best_config(result)
    assert winner == analyzer.ranked(result)["config"].iloc[0]  # the one its report names
    write_sleepy_model(tmp_path / "served", "sleepy", sleep_ms=10, batching=False)
    server = start_server(tmp_path / "served")
    analyzer.apply_config(result, winner, server, "sleepy")
    served = served_config(server, "sleepy")
    assert served["max_batch_size"] == result.configs[winner]["max_batch_size"]
    assert ("dynamic_batching" in served) == result.configs[winner]["dynamic_batching"]


@pytest.mark.integration
def test_an_impossible_latency_budget_names_the_lowest_latency(profiled):
    _, result = profiled
    with pytest.raises(ConfigError, match="lowest"):
        analyzer.best_config(result, p99_budget_ms=0.001)


#: The bound of the cut-short run: Model Analyzer starts its server well within it even on two
#: loaded cores (2 s after labkit started it, in notebook 04 on an idle host), and the model below
#: cannot finish a measurement in it. The test waits out the whole bound, idle.
BOUND_S = 30


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_past_its_bound_leaves_no_process_behind(tmp_path):
    # every execute sleeps ten minutes: no profile can end within the bound, whatever the machine
    write_sleepy_model(tmp_path / "repo", "sleepy", sleep_ms=600_000, batching=False)
    settings = analyzer.AnalyzerSettings(models=["sleepy"], **SMALL)
    run = tmp_path / "run"
    with pytest.raises(ToolTimeoutError, match=f"past its bound of {BOUND_S} s"):
        analyzer.model_analyzer(tmp_path / "repo", run, settings, timeout_s=BOUND_S, progress=False)
    assert (run / "tritonserver.pids").is_file(), "the bound passed before a server started"
    assert analyzer.leftover_servers(run) == []
    # it was told to stop at once, not left to finish a measurement that never ends
    assert "Saving state and exiting immediately" in (run / "model-analyzer.log").read_text()


KILLED_KERNEL = """
from labkit.profiling import analyzer
settings = analyzer.AnalyzerSettings(models=["sleepy"], **{search!r})
analyzer.model_analyzer({repo!r}, {run!r}, settings, timeout_s=600, progress=False)
"""


def _in_run(run) -> list[psutil.Process]:
    """Processes that name the run folder or work in it (Model Analyzer, perf_analyzer, servers
    and their stubs), zombies excluded. Each one's ``info`` holds what was read of it here (its
    name too), so a process that ends a moment later can still be asked what it was."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd", "status", "name"]):
        with contextlib.suppress(psutil.Error):
            named = str(run) in " ".join(p.info["cmdline"] or []) or (
                p.info["cwd"] or ""
            ).startswith(str(run))
            if named and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent has not reaped yet (a
    process may vanish between the two questions, so that counts as ended too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.integration
def test_a_kernel_killed_mid_search_leaves_no_process_behind(tmp_path):
    """The kernel that runs the search is killed (SIGKILL: no cleanup of its own can run).
    Model Analyzer is told by the parent-death signal, and its server and perf_analyzer by the
    same signal through their wrappers, so nothing that worked for the search outlives it."""
    # 200 ms a request, 1000 requests a window: no measurement can end before the wait below
    # does (the search left alone would outlast it), and an in-flight request holds the server's
    # shutdown for 200 ms, not for Triton's 30 s exit timeout.
    write_sleepy_model(tmp_path / "repo", "sleepy", sleep_ms=200, batching=False)
    run = tmp_path / "run"
    search = dict(SMALL, measurement_request_count=1000)
    code = KILLED_KERNEL.format(search=search, repo=str(tmp_path / "repo"), run=str(run))
    kernel = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        wait_for(lambda: (run / "tritonserver.pids").is_file(), 120, "Model Analyzer's server")
        server = int((run / "tritonserver.pids").read_text().split()[0])
        wait_for(
            lambda: any(p.info["name"] == "perf_analyzer" for p in _in_run(run)),
            120,
            "a measurement",
        )
        kernel.kill()
        kernel.wait()
        wait_for(lambda: _in_run(run) == [], 60, "the end of everything the search started")
        assert _ended(server)
    finally:
        kernel.kill()
        kernel.wait()
        for p in _in_run(run):  # clean up before failing, so a failure leaves nothing running
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_the_interrupts_that_stop_model_analyzer_at_once_are_its_own_count():
    from model_analyzer.constants import MAX_NUMBER_OF_INTERRUPTS

    assert analyzer.INTERRUPTS_TO_EXIT_NOW == MAX_NUMBER_OF_INTERRUPTS


@pytest.mark.integration  # writing the config locates perf_analyzer (it runs --version)
@pytest.mark.parametrize(
    ("stability", "given"),
    [(50, (50, 6)), (None, (100_000_000, 3))],
    ids=["a rule: its percentage and trials", "no rule: exactly three windows"],
)
def test_the_search_gives_perf_analyzer_its_stability_rule(tmp_path, stability, given):
    import yaml

    settings = analyzer.AnalyzerSettings(
        models=["m"], stability_percentage=stability, max_trials=6, cpu_only=True
    )
    written = yaml.safe_load(
        analyzer.write_config(tmp_path / "repo", tmp_path, settings).read_text()
    )
    flags = written["perf_analyzer_flags"]
    assert (flags["stability-percentage"], flags["max-trials"]) == given
    assert flags["measurement-mode"] == "count_windows"


@pytest.mark.integration  # writing the config locates perf_analyzer (it runs --version)
def test_the_search_sends_the_whole_prompt_as_input_data(tmp_path):
    """Model Analyzer cuts its perf_analyzer flags at spaces: ``string-data: Where is the
    nearest`` reached perf_analyzer as ``--string-data Where``. A JSON file carries it whole."""
    import json

    import yaml

    write_sleepy_model(tmp_path / "repo", "sleepy", sleep_ms=10, batching=False)
    settings = analyzer.AnalyzerSettings(
        models=["sleepy"], string_data="Where is the nearest", cpu_only=True
    )
    written = yaml.safe_load(
        analyzer.write_config(tmp_path / "repo", tmp_path / "run", settings).read_text()
    )
    flags = written["perf_analyzer_flags"]
    assert "string-data" not in flags
    data = json.loads((tmp_path / "run" / "input-data.json").read_text())
    assert data == {"data": [{"text_input": ["Where is the nearest"]}]}
    assert flags["input-data"] == str(tmp_path / "run" / "input-data.json")
    with pytest.raises(ConfigError, match="without them"):
        analyzer.write_config(tmp_path / "repo", tmp_path / "a run", settings)


@pytest.mark.integration
def test_a_stub_dead_before_a_round_restarts_the_server_and_the_round_is_measured(
    start_server, tmp_path
):
    """Notebook 04's rounds against a stub that died (a segfault inside Triton's stub binary,
    once in about ten runs of 04): the server is stopped and started again, and the measurement
    taken once more, on a real Triton and perf_analyzer."""
    write_sleepy_model(tmp_path / "repo", "sleepy", sleep_ms=10)
    server = start_server(tmp_path / "repo", load_models=["sleepy"])
    (stub,) = stubs(server)["sleepy"]
    first = server.pid
    os.kill(stub, signal.SIGSEGV)
    wait_for(lambda: unhealthy(server), 30, "the killed stub to be seen dead")
    rounds = analyzer.measure_rounds(
        server, {"d": "sleepy"}, rounds=2, concurrency=2, string_data="x",
        measurement_mode="count_windows", measurement_request_count=10, progress=False,
        run_dir=tmp_path / "rounds",
    )  # fmt: skip
    assert server.pid != first and unhealthy(server) == {}
    assert list(rounds["round"]) == [1, 2] and (rounds["throughput"] > 0).all()
    assert sorted(p.name for p in (tmp_path / "rounds").glob("*.log"))[:2] == [
        "d-round-1-again-c2.log", "d-round-1-c2.log"
    ]  # fmt: skip
