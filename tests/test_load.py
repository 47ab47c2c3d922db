"""A short soak (``labkit bench soak``): real perf_analyzer load on tiny Falcon, then a forced
reload and a killed stub under load. It asserts what must hold on any machine (no request failed
under load or reload, the stub was recovered), never how fast the machine is. The full soak
(concurrency 64 for 60 s on smollm2) is ``labkit bench soak``, not a test."""

from __future__ import annotations

import json

import pytest

from labkit import soak
from labkit.cli import bench as bench_cli
from labkit.cli import build_parser, main
from labkit.errors import ConfigError


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("soak")
    settings = soak.SoakSettings(
        model="tiny-falcon",
        concurrency=16,
        duration_s=9,
        memory_window_s=3,
        fault_threads=4,
        fault_window_s=4,
        startup_timeout_s=240,
    )
    return soak.run_soak(settings, run_dir), run_dir


@pytest.mark.integration
@pytest.mark.slow
def test_sixteen_clients_for_nine_seconds_fail_no_request(result):
    figures, _ = result
    load = figures["load"]
    assert load["perf_analyzer_status"] == 0, load.get("perf_analyzer_error")
    assert load["requests_failed"] == 0
    assert load["requests_succeeded"] >= 16 and load["throughput_per_s"] > 0
    assert load["p50_ms"] <= load["p99_ms"]
    memory = load["memory"]
    assert memory["samples"] >= 5 and memory["first_window_mib"] > 50  # tritonserver + a stub
    assert figures["passed"]["zero_failed_requests"] is True


@pytest.mark.integration
@pytest.mark.slow
def test_a_forced_reload_under_load_fails_nothing_and_a_killed_stub_is_recovered(result):
    faults = result[0]["faults"]
    assert faults["reload"]["failed"] == 0 and faults["reload"]["requests"] > 0
    kill = faults["stub_kill"]
    assert kill["recovered_models"] == ["tiny-falcon"]
    # whether requests are refused while the stub is dead depends on timing; if so, by this error
    assert set(kill["errors"]) <= {"Stub process 'tiny-falcon_0' is not healthy."}
    assert kill["failed_after_recover"] == 0 and kill["answered_after_recover"] >= 4


@pytest.mark.integration
@pytest.mark.slow
def test_the_figures_are_json_and_the_table_names_them(result):
    figures, run_dir = result
    assert json.loads(json.dumps(figures)) == figures
    text = soak.table(figures)
    assert "requests answered / failed" in text and "load average" in text
    assert (run_dir / "tritonserver.log").is_file() and (run_dir / "perf" / "soak.csv").is_file()


def test_bench_soak_is_a_subcommand_of_bench():
    args = build_parser().parse_args(["bench", "soak", "--duration", "30", "--no-faults"])
    assert args.duration == 30 and args.no_faults and args.handler is bench_cli._cli_soak
    assert build_parser().parse_args(["bench", "batching"]).bench == "batching"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--duration", "2"], "must be >= 3 s"),
        (["--duration", "30", "--memory-window", "20"], "two memory windows"),
        (["--concurrency", "0"], "must be >= 1"),
    ],
)
def test_impossible_settings_are_refused_before_any_server_starts(argv, says, capsys, tmp_path):
    assert main(["bench", "soak", "--run-dir", str(tmp_path / "run"), *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="must be >= 3 s"):
        soak.SoakSettings(duration_s=1).check()
