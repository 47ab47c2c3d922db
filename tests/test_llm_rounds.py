"""Notebook 06's comparison, without starting anything: its settings are the benchmark's shape and
write the same model folders; rounds alternate their order so that a drift falls on every way
alike; the ways are shown in one order whatever order they were measured in; the in-flight
engine's code is read from the served model's own file."""

from __future__ import annotations

import pytest

from labkit.errors import ConfigError
from labkit.llm_serving import CompareSettings, Comparison, engine_code, rounds
from labkit.settings import project_root


def test_rounds_alternate_their_order_and_keep_the_compared_pairs_side_by_side():
    first = rounds.round_order(list(rounds.FIRST_ROUND), 0)
    assert first == ["inflight", "vllm", "vllm_bf16", "vllm-standalone"]
    assert rounds.round_order(first, 1) == list(reversed(first))
    assert rounds.round_order(first, 2) == first
    for a, b in (("inflight", "vllm"), ("vllm", "vllm_bf16")):  # each ratio the lesson reads
        assert abs(first.index(a) - first.index(b)) == 1


def test_the_settings_are_the_benchmarks_shape_and_refuse_what_cannot_be_compared():
    s = CompareSettings()
    study = s.study()
    assert (study.concurrency, study.workloads, study.streaming) == ((8,), ("mixed",), (True,))
    assert (study.mixed_low, study.mixed_high, study.requests) == (4, 64, 32)
    assert study.schedulers == ("inflight", "vllm", "vllm_bf16") and study.standalone
    with pytest.raises(ConfigError, match="must include 'inflight'"):
        CompareSettings(ways=("vllm",)).check()
    with pytest.raises(ConfigError, match="must include 'inflight'"):
        CompareSettings(ways=("inflight", "sglang")).check()
    with pytest.raises(ConfigError, match="at least the concurrency"):
        CompareSettings(requests=4).check()


def test_the_ways_are_shown_in_one_order_whatever_order_measured_them():
    rows = [
        {"scheduler": w, "round": 1} for w in ("vllm-standalone", "vllm_bf16", "vllm", "inflight")
    ]
    c = Comparison(settings={}, host={}, run_dir="", rows=rows)
    assert c.ways == ["inflight", "vllm", "vllm-standalone", "vllm_bf16"]
    assert c.way_rows("vllm") == [rows[2]]


def test_the_engine_code_is_the_served_models_own():
    code = engine_code(
        project_root() / "model_repository", "smollm2_inflight", "InflightEngine._admit"
    )
    assert code.startswith("def _admit(self) -> None:")
    assert "self.manager.add_request(" in code and "\n    " in code  # dedented, body indented
    with pytest.raises(ConfigError, match="defines no 'InflightEngine.nope'"):
        engine_code(project_root() / "model_repository", "smollm2_inflight", "InflightEngine.nope")
