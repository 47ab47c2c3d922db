"""labkit bench vllm-start's plan and arithmetic, without a server: the order of the starts, each
dtype's figures and the verdict on compiled as the CPU default, the cache root's setting."""

from __future__ import annotations

import os

import pytest

from labkit.errors import ConfigError
from labkit.llm_serving import startup


def test_each_dtype_starts_cold_then_eager_and_warm_in_turns():
    order = startup.plan(startup.StartSettings(dtypes=("float32", "bfloat16"), turns=2))
    assert order[:5] == [
        ("float32", "cold", 0),
        ("float32", "eager", 1),
        ("float32", "warm", 1),
        ("float32", "eager", 2),
        ("float32", "warm", 2),
    ]
    assert order[5] == ("bfloat16", "cold", 0) and len(order) == 10


def _starts(cold, pairs, dtype="float32"):
    rows = [{"dtype": dtype, "kind": "cold", "turn": 0, "first_answer_s": cold}]
    for turn, (eager, warm) in enumerate(pairs, 1):
        rows.append({"dtype": dtype, "kind": "eager", "turn": turn, "first_answer_s": eager})
        rows.append({"dtype": dtype, "kind": "warm", "turn": turn, "first_answer_s": warm})
    return rows


def test_the_verdict_reads_the_median_of_warm_less_eager_in_each_turn():
    ok = startup.summarize(_starts(300.0, [(60.0, 85.0), (70.0, 95.0), (50.0, 120.0)]), "float32")
    assert ok["warm_minus_eager_s"] == [25.0, 25.0, 70.0]
    assert ok["median_warm_minus_eager_s"] == 25.0 and ok["compiled_acceptable"]
    assert (ok["cold_s"], ok["eager_s"], ok["warm_s"]) == (300.0, 60.0, 95.0)
    slow = startup.summarize(_starts(300.0, [(60.0, 91.0), (60.0, 95.0)]), "float32")
    assert slow["median_warm_minus_eager_s"] == 33.0 and not slow["compiled_acceptable"]
    assert startup.summarize(_starts(300.0, []), "float32") == {}
    assert startup.summarize(_starts(300.0, [(1.0, 2.0)]), "bfloat16") == {}


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="dtypes"):
        startup.StartSettings(dtypes=("float16x",)).check()
    with pytest.raises(ConfigError, match="turns"):
        startup.StartSettings(turns=0).check()


def test_the_cache_root_is_set_inside_and_restored_after(tmp_path, monkeypatch):
    monkeypatch.setenv(startup.CACHE_ROOT, "/before")
    monkeypatch.delenv(startup.AOT, raising=False)
    with startup.environment(**{startup.CACHE_ROOT: str(tmp_path), startup.AOT: None}):
        assert os.environ[startup.CACHE_ROOT] == str(tmp_path)
        assert startup.AOT not in os.environ
    assert os.environ[startup.CACHE_ROOT] == "/before"
    monkeypatch.delenv(startup.CACHE_ROOT)
    with startup.environment(**{startup.CACHE_ROOT: str(tmp_path), startup.AOT: "0"}):
        assert os.environ[startup.AOT] == "0"
    assert startup.CACHE_ROOT not in os.environ and startup.AOT not in os.environ
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").write_bytes(b"x" * 10)
    assert startup.folder_bytes(tmp_path) == 10
