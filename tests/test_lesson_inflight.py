"""Notebook 06's verdicts and figures: vLLM's lead over the lab's in-flight model in tokens/s and
in the time of one step, Triton's cost and bfloat16, each a gain, a tie or a loss by the rounds;
the benchmark's figures beside this run's; a takeaway of the verdicts in at most three
sentences, with no internal key."""

from __future__ import annotations

import re

import pytest

from labkit import lessons
from labkit.errors import ConfigError
from labkit.lessons.inflight import verdicts
from labkit.lessons.takeaway import Takeaway, sentence_count
from labkit.llm_serving import Comparison, benchmark
from labkit.llm_serving.charts import COLOURS, precision_figure, rounds_figure

INTERNAL = re.compile(r"_vs_|\bRatio\(|\bConclusion\(|\bmet:|\bnot measured\b")


def row(way: str, round_: int, tokens: float, itl: float, ttft: float = 300.0, **extra) -> dict:
    return {"scheduler": way, "round": round_, "workload": "mixed", "streaming": True,
            "concurrency": 8, "output_tokens_per_s": tokens, "ttft_p50_ms": ttft,
            "itl_p50_ms": itl, "requests": 32, "failed": 0, **extra}  # fmt: skip


def comparison(rows: list[dict], answers: dict | None = None, load=(1.0, 1.0, 1.0)) -> Comparison:
    return Comparison(
        settings={"concurrency": 8, "requests": 32, "low": 4, "high": 64},
        host={"avx512_bf16": True},
        run_dir="",
        rows=rows,
        answers=answers or {},
        load_average=[list(load)],
    )


#: The benchmark's record as the lab ships it, with figures this module chooses.
BENCH = benchmark.of(
    {
        **benchmark.MEASURED,
        "load_average": [0.4, 0.5, 0.6],
        "output_tokens_per_s": {"inflight": 61.2, "vllm": 105.8},
        "itl_p50_ms": {},
    }  # fmt: skip
)


def full(inflight=(60.0, 58.0), vllm=(104.0, 100.0), own=(108.0, 101.0), bf16=(180.0, 175.0)):
    rows = []
    for r in (1, 2):
        rows += [row("inflight", r, inflight[r - 1], 131.0), row("vllm", r, vllm[r - 1], 74.0),
                 row("vllm-standalone", r, own[r - 1], 72.0),
                 row("vllm_bf16", r, bf16[r - 1], 42.0)]  # fmt: skip
    answers = {way: {"compared": 8, "equal_streaming": 8, "equal_nonstreaming": 8}
               for way in ("inflight", "vllm")}  # fmt: skip
    answers["vllm_bf16"] = {"compared": 8, "equal_streaming": 6, "equal_nonstreaming": 6}
    return comparison(rows, answers)


def words(conclusion) -> list[str]:
    return list(conclusion.verdict_table()["verdict"])


def test_a_lead_in_every_round_is_a_gain_and_the_step_is_where_it_comes_from():
    conclusion = lessons.inflight_conclusion(full(), BENCH)
    table = conclusion.verdict_table()
    assert list(table["comparison"]) == [
        "vLLM in Triton against the lab's in-flight model",
        "vLLM's step against the in-flight model's",
        "vLLM in Triton against vLLM's own server",
        "vLLM in bfloat16 against float32",
    ]
    assert list(table["median"]) == [1.73, 1.77, 0.98, 1.74]
    assert words(conclusion) == ["gain", "gain", "tie", "gain"]
    assert table["spread"][0] == "x1.72 to x1.73" and table["each round"][0] == "x1.73, x1.72"
    assert conclusion.figures[
        "vLLM in Triton over the lab's in-flight model"
    ].value == pytest.approx(1.7287, abs=1e-4)  # median of the rounds
    assert conclusion.figures["the lab's in-flight model, output tokens/s"] == 59.0
    assert conclusion.figures["vLLM in Triton, output tokens/s"] == 102.0
    first = conclusion.takeaway[0]
    assert first.startswith("vLLM in Triton against the lab's in-flight model: gain, x1.73")
    assert "74 ms" in first and "131 ms" in first and "(gain, x1.77)" in first
    # one computed sentence per verdict, and nothing else
    assert (
        str(conclusion)
        .splitlines()[1]
        .startswith("vLLM's step against the in-flight model's: gain")
    )
    assert len(str(conclusion).splitlines()) == 4


def test_a_lead_in_tokens_that_moves_with_the_host_is_a_tie_while_the_step_stays_a_gain():
    # Round 2 lost vLLM's tokens/s (the client stalled) below the in-flight model's, not its step.
    conclusion = lessons.inflight_conclusion(full(vllm=(104.0, 56.0)), BENCH)
    assert words(conclusion)[:2] == ["tie", "gain"]
    assert conclusion.verdict_table()["spread"][0] == "x0.97 to x1.73"
    assert "tie, x1.35" in conclusion.takeaway[0] and "(gain, x1.77)" in conclusion.takeaway[0]
    measured = full(vllm=(104.0, 56.0))
    for r in measured.rows:  # nor does its step: the two engines' steps equal in round 2
        if r["scheduler"] == "vllm" and r["round"] == 2:
            r["itl_p50_ms"] = 131.0
    assert words(lessons.inflight_conclusion(measured, BENCH))[:2] == ["tie", "tie"]
    assert words(lessons.inflight_conclusion(full(vllm=(45.0, 46.0)), BENCH))[0] == "loss"


def test_triton_cost_and_bfloat16_read_as_gain_tie_or_loss():
    tie = lessons.inflight_conclusion(full(), BENCH)
    assert tie.takeaway[1] == (
        "vLLM in Triton against vLLM's own server: tie, x0.98 output tokens/s."
    )
    assert words(lessons.inflight_conclusion(full(own=(95.0, 92.0)), BENCH))[2] == "tie"  # x1.09
    loss = lessons.inflight_conclusion(full(own=(130.0, 125.0)), BENCH)
    assert words(loss)[2] == "loss" and "loss, x0.80" in loss.takeaway[1]
    assert words(lessons.inflight_conclusion(full(own=(80.0, 82.0)), BENCH))[2] == "gain"
    assert tie.takeaway[2].startswith("vLLM in bfloat16 against float32: gain, x1.74")
    assert tie.takeaway[2].endswith("6 of 8 greedy answers as float32's.")
    slow = lessons.inflight_conclusion(full(bf16=(80.0, 84.0)), BENCH)
    assert words(slow)[3] == "loss"


def test_ways_left_out_leave_their_verdicts_and_lines_out():
    rows = [r for r in full().rows if r["scheduler"] in ("inflight", "vllm")]
    conclusion = lessons.inflight_conclusion(comparison(rows))
    assert len(conclusion.verdicts) == 2 and len(conclusion.takeaway) == 1
    assert list(conclusion.table.columns) == ["figure", "this run"]  # no benchmark given


def test_this_runs_figures_stand_beside_the_benchmarks_with_its_date_shape_and_load():
    table = lessons.inflight_conclusion(full(), BENCH).table.set_index("figure")
    assert list(table.columns) == ["this run", f"benchmark, {BENCH.date}"]
    there = table[f"benchmark, {BENCH.date}"]
    assert there["shape"] == BENCH.shape() and there["load average at the start"] == "0.4"
    assert there["the lab's in-flight model, output tokens/s"] == "61.2"
    assert table.loc["vLLM in Triton over the in-flight model"].tolist() == ["x1.73", "x1.73"]
    here = table["this run"]
    assert here["shape"] == "8 clients, 32 requests of 4 to 64 tokens"
    assert here["vLLM in Triton, one step (ITL p50, ms)"] == "74"
    assert (
        here["vLLM in bfloat16, greedy answers under load as the plain model's alone"] == "6 of 8"
    )
    assert here["this CPU has bfloat16 instructions"] == "yes"
    assert here["failed requests"] == "0" and there["failed requests"] == "-"


def test_at_the_notebooks_defaults_the_benchmark_measured_vllms_lead_at_the_same_shape():
    from labkit.llm_serving import CompareSettings

    d = CompareSettings()
    assert (d.concurrency, d.requests, d.low, d.high) == (8, 32, 4, 64)  # the benchmark's shape
    assert "inflight" in d.ways and "vllm" in d.ways and d.rounds >= 2
    shipped = benchmark.measured()
    assert (shipped.clients, shipped.requests, shipped.tokens) == (8, 32, (4, 64))
    assert shipped.vllm_lead > lessons.GAIN


def test_the_takeaway_and_figures_read_as_words_within_the_lessons_limits():
    for case in (full(), full(vllm=(104.0, 62.0)), full(vllm=(40.0, 41.0))):
        conclusion = lessons.inflight_conclusion(case, BENCH)
        assert sentence_count(conclusion.takeaway) <= 3
        Takeaway.of(conclusion)  # the lab's own check
        shown = str(conclusion) + " ".join(conclusion.takeaway) + conclusion._repr_html_()
        assert not INTERNAL.search(shown), INTERNAL.search(shown)
        assert len(conclusion.figures) <= 6
        assert not [k for k in conclusion.figures if "_" in k]


def test_failures_are_counted_and_a_comparison_without_vllm_is_refused():
    rows = [row("inflight", 1, 60.0, 130.0), row("vllm", 1, 100.0, 75.0, failed=2)]
    conclusion = lessons.inflight_conclusion(comparison(rows))
    assert conclusion.figures["failed requests"] == 2
    assert conclusion.table.set_index("figure")["this run"]["failed requests"] == "2"
    with pytest.raises(ConfigError, match="'inflight' and 'vllm'"):
        verdicts(comparison([row("inflight", 1, 60.0, 130.0)]))


def test_every_way_keeps_one_colour_in_every_panel_and_legend():
    for figure in (rounds_figure(full()), precision_figure(full())):
        by_name: dict[str, set] = {}
        for trace in figure.data:
            if trace.type == "bar":
                by_name.setdefault(trace.name, set()).add(trace.marker.color)
        assert all(len(colours) == 1 for colours in by_name.values()), by_name
    bars = {t.name: t.marker.color for t in rounds_figure(full()).data if t.type == "bar"}
    assert bars["vLLM in Triton"] == COLOURS["vllm"]
    assert bars["the lab's in-flight model"] == COLOURS["inflight"]
    precision = {t.name: t.marker.color for t in precision_figure(full()).data if t.type == "bar"}
    assert precision["vLLM in Triton"] == COLOURS["vllm"]
    titles = [a.text for a in precision_figure(full()).layout.annotations]
    assert all(len(t) <= 30 for t in titles), titles  # subplot titles that fit their panel
    for figure in (rounds_figure(full()), precision_figure(full())):
        axes = [k for k in figure.layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]
        untitled = [k for k in axes if not figure.layout[k].title.text]
        assert axes and untitled == [], untitled


def test_the_benchmark_record_is_made_from_a_bench_run(tmp_path):
    import json

    study = {
        "settings": {"requests": 32, "mixed_low": 4, "mixed_high": 64, "schedulers":
                     ["inflight", "vllm"], "workloads": ["mixed"], "concurrency": [8],
                     "streaming": [True], "precision": False},
        "host": {"server_cores": "0", "client_cores": "1", "load_average_start": [1.0, 2.0, 3.0]},
        "rows": [row("inflight", 1, 60.0, 130.0), row("vllm", 1, 100.0, 75.0),
                 {**row("vllm", 1, 1.0, 1.0), "concurrency": 4}],
    }  # fmt: skip
    path = tmp_path / "inflight.json"
    path.write_text(json.dumps(study))
    record = benchmark.record_of(path, date="2026-01-02", commit="abc1234")
    b = benchmark.of(record)
    assert b.vllm_lead == pytest.approx(100 / 60)
    assert (
        b.shape() == "8 clients, 32 requests of 4 to 64 tokens, server on core 0, AIPerf on core 1"
    )
    assert record["command"].endswith("--concurrency 8 --clients stream --no-precision")
    with pytest.raises(ConfigError, match="needs every field"):
        benchmark.of({"date": "x"})
