"""AIPerf through labkit.profiling, and ``labkit bench inflight`` end to end on a small model.

The summary parser is checked on AIPerf 0.13's own export format (a trimmed real export); the
benchmark runs for real (AIPerf from ``.venv-aiperf`` against a real Triton) on a random 2-layer
Llama, with a matrix small enough for a test. Figures are never asserted: a benchmark is not a
test of the machine's speed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from test_inflight import add_tiny, build_tiny_llama

from labkit import cli, hardware, llm_serving, profiling
from labkit.errors import ConfigError, MissingDependencyError
from labkit.profiling import aiperf as aiperf_module

#: A trimmed profile_export_aiperf.json of AIPerf 0.13.0 (16 requests, 2 of them refused).
SUMMARY = {
    "request_throughput": {"unit": "requests/sec", "avg": 6.79},
    "request_latency": {"unit": "ms", "avg": 555.7, "p50": 304.7, "p90": 1375.8, "p99": 1479.1},
    "request_count": {"unit": "requests", "avg": 14.0},
    "completed_request_count": {"unit": "requests", "avg": 16.0},
    "time_to_first_token": {"unit": "ms", "avg": 104.7, "p50": 42.1, "p90": 316.3, "p99": 577.1},
    "inter_token_latency": {"unit": "ms", "avg": 12.2, "p50": 8.7, "p90": 26.0, "p99": 31.5},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 286.97},
    "output_token_throughput_per_user": {"unit": "tokens/sec/user", "p50": 114.7, "p90": 206.0},
    "total_output_tokens": {"unit": "tokens", "avg": 676.0},
    "benchmark_duration": {"unit": "sec", "avg": 2.35},
    "error_summary": [{"error_details": {"code": 400, "message": "busy"}, "count": 2}],
}


def test_the_summary_gives_each_metric_at_p50_p90_p99_and_counts_refusals_as_failed():
    row = aiperf_module.summary_row(SUMMARY)
    assert row["requests"] == 16 and row["failed"] == 2
    assert row["ttft_p50_ms"] == 42.1 and row["ttft_p99_ms"] == 577.1
    assert row["itl_p90_ms"] == 26.0 and row["request_p99_ms"] == 1479.1
    assert row["output_tokens_per_s"] == 286.97 and row["requests_per_s"] == 6.79
    assert row["tokens_per_user_p99"] != row["tokens_per_user_p99"]  # absent: NaN, not 0


def test_a_workload_is_written_as_aiperfs_single_turn_jsonl_in_order(tmp_path):
    mixed = profiling.mixed_workload(8, low=4, high=64, seed=0)
    assert mixed == profiling.mixed_workload(8, low=4, high=64, seed=0)  # seeded
    assert all(4 <= n <= 64 for n in mixed.max_tokens) and len(set(mixed.max_tokens)) > 1
    lines = mixed.write(tmp_path / "w.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"text": p, "output_length": n}
        for p, n in zip(mixed.prompts, mixed.max_tokens, strict=True)
    ]
    assert set(profiling.fixed_workload(4, 16).max_tokens) == {16}
    with pytest.raises(ConfigError, match="as many max_tokens"):
        profiling.Workload("bad", ("a",), (1, 2))


def test_aiperf_runs_offline_with_a_hub_that_answers_nothing(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = aiperf_module.aiperf_environ()
    assert "HF_HUB_OFFLINE" not in env and env["HF_ENDPOINT"] == "http://127.0.0.1:9"
    with pytest.raises(MissingDependencyError, match="is not an executable"):
        profiling.locate_aiperf("/nonexistent/aiperf")


def test_the_ratios_and_targets_come_from_the_rows_and_say_what_was_not_measured():
    def row(scheduler, tokens, ttft_p99, streams=True):
        return {"scheduler": scheduler, "workload": "mixed", "streaming": streams,
                "concurrency": 8, "output_tokens_per_s": tokens, "ttft_p99_ms": ttft_p99,
                "ttft_p50_ms": 500.0, "failed": 0}  # fmt: skip

    rows = [row("dynamic", 20.0, 9000.0), row("inflight", 50.0, 2000.0)]
    ratios = llm_serving.ratios(rows, {"mixed": {"output_tokens_per_s": 60.0}})
    assert ratios["inflight_vs_dynamic_output_tokens_per_s_c8_mixed"] == 2.5
    assert ratios["inflight_ttft_p99_vs_dynamic_c8_mixed"] == 0.222
    assert ratios["inflight_served_vs_limit_c8_mixed"] == 0.833
    assert ratios["inflight_ttft_p50_s_c4_streaming"] is None  # no level 4 in these rows
    targets = llm_serving.targets(ratios)
    assert targets["inflight_vs_dynamic_output_tokens_per_s_c8_mixed"]["met"] is True
    assert targets["inflight_ttft_p50_s_c4_streaming"] == {
        "target": "<= 1", "measured": None, "met": None
    }  # fmt: skip


@pytest.fixture
def own_temp(monkeypatch):
    """A temp folder of this test's own, for labkit and for AIPerf, so that what is counted in
    it is this run's: an AIPerf run of another process in the shared /tmp at the same moment
    failed the test once, its live map folder taken for one left behind. It is a short path
    beside /tmp's, not under tmp_path: AIPerf's ZMQ sockets live under the temp folder, and a
    socket path has at most 107 bytes."""
    temp = Path(tempfile.mkdtemp(prefix="labkit-test-"))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    # torch writes the cache folder it derives from the temp folder into os.environ. Set here,
    # it is unset at teardown; else every later server of the suite was handed it, and made it.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(temp / "torchinductor"))
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.integration
def test_bench_inflight_writes_rows_limit_ratios_and_host(tmp_path, capsys, own_temp):
    try:
        profiling.locate_aiperf()
    except MissingDependencyError as exc:
        pytest.skip(f"AIPerf is not installed here: {exc}")
    weights = build_tiny_llama(tmp_path / "weights")
    source = tmp_path / "repo"
    source.mkdir()
    add_tiny(source, weights, "tl")
    add_tiny(source, weights, "tl_inflight", decoupled=True, inflight_batching=True)
    before = sorted(p.name for p in source.iterdir())
    out = tmp_path / "figures.json"
    code = cli.main(
        [
            "bench",
            "inflight",
            "--model-repository",
            str(source),
            "--model",
            "tl",
            "--inflight-model",
            "tl_inflight",
            "--scheduler",
            "dynamic,inflight",
            "--workload",
            "mixed",
            "--clients",
            "stream",
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            str(out),
        ]  # fmt: skip
    )
    assert code == 0
    result = json.loads(out.read_text())
    rows = {
        (r["scheduler"], r["workload"], r["streaming"], r["concurrency"]) for r in result["rows"]
    }
    assert rows == {("dynamic", "mixed", True, 2), ("inflight", "mixed", True, 2)}
    for r in result["rows"]:
        assert r["failed"] == 0 and r["requests"] == 4 and r["output_tokens_per_s"] > 0
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 and r["aiperf_cpu_s"] > 0
    assert result["limit"]["mixed"]["output_tokens_per_s"] > 0
    assert {"inflight_vs_dynamic_output_tokens_per_s_c8_mixed", "inflight_ttft_p99_vs_dynamic_c8_mixed",
            "inflight_served_vs_limit_c8_mixed"} <= set(result["ratios"])  # fmt: skip
    assert result["ratios"]["failed_requests"] == 0
    made = ("aiperf_mmap_*", "tmp*/aiperf", "labkit-aiperf-*")  # maps, sockets, labkit's folder
    left = sorted(path for pattern in made for path in own_temp.glob(pattern))
    assert not left, f"AIPerf left its dataset maps or socket folders: {left}"
    assert result["answers"]["equal_nonstreaming"] == result["answers"]["compared"] > 0
    assert result["answers"]["equal_streaming"] == result["answers"]["compared"]
    host = result["host"]
    assert host["cores"] >= 1 and len(host["load_average_start"]) == 3 and host["cpu_model"]
    if len(hardware.usable_cores()) >= 2:  # pinned by default: the server's cores, then AIPerf's
        server, client = (hardware.format_cores(c) for c in hardware.split_cores())
        assert (host["server_cores"], host["client_cores"]) == (server, client)
    assert "precision" in result and result["precision"]["float32"]["equal_alone"] > 0
    assert "inflight_vs_dynamic_output_tokens_per_s_c8_mixed" in capsys.readouterr().out
    assert sorted(p.name for p in source.iterdir()) == before  # the source is never changed
    # one rule for every benchmark: it writes its run folder's JSON; --json gets the same figures
    assert json.loads((tmp_path / "run" / "inflight.json").read_text()) == result
    assert (
        tmp_path / "run" / "aiperf" / "inflight-mixed-stream-c2" / "profile_export.jsonl"
    ).is_file()
