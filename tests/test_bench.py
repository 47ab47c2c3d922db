"""``labkit bench batching`` runs end to end on a small model (figures are not asserted: a
benchmark is not a test of the machine's speed)."""

from __future__ import annotations

import json

import pytest

from conftest import write_sleepy_model
from labkit import bench, cli
from labkit.errors import ConfigError
from labkit.repository import Repository


@pytest.mark.integration
def test_bench_batching_writes_both_phases_and_leaves_the_source_untouched(tmp_path, capsys):
    source = tmp_path / "repo"
    write_sleepy_model(source, "sleepy", sleep_ms=20, batching=False)
    before = (source / "sleepy" / "config.pbtxt").read_text()
    out = tmp_path / "figures.json"
    code = cli.main(
        [
            "bench",
            "batching",
            "--model-repository",
            str(source),
            "--model",
            "sleepy",
            "--concurrency",
            "4",
            "--request-count",
            "40",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    for phase in ("off", "on"):
        assert result[phase]["throughput"] > 0
        assert result[phase]["p99_ms"] >= result[phase]["p50_ms"] > 0
    # What the server did, not how fast: batching off executes one request at a time.
    assert result["off"]["avg_batch_size"] == pytest.approx(1.0)
    assert result["on"]["avg_batch_size"] > 1.0
    assert result["throughput_ratio"] == pytest.approx(
        result["on"]["throughput"] / result["off"]["throughput"]
    )
    assert "throughput (infer/s)" in capsys.readouterr().out
    assert (source / "sleepy" / "config.pbtxt").read_text() == before
    served = Repository(tmp_path / "run" / "model_repository").config("sleepy")
    assert served.HasField("dynamic_batching")  # the run's copy ended with batching on
    # one rule for every benchmark: it writes its run folder's JSON; --json gets the same figures
    assert json.loads((tmp_path / "run" / "batching.json").read_text()) == result


def test_a_zero_concurrency_is_refused_before_anything_starts(tmp_path):
    settings = bench.BatchingSettings(model="sleepy", concurrency=0)
    with pytest.raises(ConfigError, match=r"concurrency \(0\)"):
        bench.batching_off_on(tmp_path, tmp_path / "run", settings)
