"""Notebook 06's lesson says what the comparison measured: vLLM's lead over the lab's in-flight
model is a gain only when every round agrees, and is explained by the step (ITL); Triton's cost
and bfloat16 read as a gain, a tie or a loss; the benchmark's measured lead stands beside this
run's, with its date, shape and load average; the takeaway holds at most three sentences and no
internal key."""

from __future__ import annotations

import re

import pytest

from labkit import lessons
from labkit.errors import ConfigError
from labkit.lessons.inflight import verdict
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
        settings={"concurrency": 8},
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


def test_a_lead_in_every_round_is_called_and_explained_by_the_step():
    conclusion = lessons.inflight_conclusion(full(), BENCH)
    text = conclusion.text
    assert "vLLM in Triton served 102.0 output tokens/s and the lab's in-flight model 59.0" in text
    assert "1.73x, ahead in every round (1.72x to 1.73x over 2 rounds)" in text
    assert "vLLM's step took 74 ms where the in-flight model's took 131 ms" in text
    first = conclusion.takeaway[0]
    assert first.startswith("vLLM served the same model at 1.73x the output tokens/s")
    assert "74 ms a step against 131 ms" in first


def test_the_benchmarks_lead_stands_beside_this_runs_with_its_provenance():
    text = lessons.inflight_conclusion(full(), BENCH).text
    assert (
        f"The lab's full benchmark (labkit bench inflight) on {BENCH.date} (8 clients, 32 requests of 4 to 64 tokens"
        in text
    )
    assert (
        "load average 0.4 at its start) measured the in-flight model at 61.2 output tokens/s"
        in text
    )
    assert (
        "at 105.8: 1.73x; this run measured 1.73x at the same shape, the same lead within" in text
    )


def test_at_the_notebooks_defaults_the_conclusion_states_vllms_lead_or_the_benchmarks():
    """Whatever this host does to a run, 06 leaves the learner with vLLM's lead: this run's,
    beyond the noise, or the benchmark's measured figure beside its own."""
    from labkit.llm_serving import CompareSettings

    d = CompareSettings()
    assert (d.concurrency, d.requests, d.low, d.high) == (8, 32, 4, 64)  # the benchmark's shape
    assert "inflight" in d.ways and "vllm" in d.ways and d.rounds >= 2
    shipped = benchmark.measured()
    assert (shipped.clients, shipped.requests, shipped.tokens) == (8, 32, (4, 64))
    assert shipped.vllm_lead > lessons.GAIN
    for inflight, vllm in (((60.0, 58.0), (104.0, 100.0)), ((60.0, 58.0), (63.0, 70.0)),
                           ((60.0, 58.0), (50.0, 52.0))):  # fmt: skip
        c = lessons.inflight_conclusion(full(inflight=inflight, vllm=vllm), shipped)
        lead = "ahead in every round" in c.text
        beside = f"measured the in-flight model at {shipped.output_tokens_per_s['inflight']:.1f}"
        assert lead or beside in c.text, c.text
        assert beside in c.text  # the benchmark's figure is always there, with its date
        assert shipped.date in c.text and f"load average {shipped.load_average[0]:.1f}" in c.text


def test_a_lead_in_tokens_that_moves_with_the_host_is_read_from_the_engines_step():
    # Round 2 lost vLLM's tokens/s (the client stalled) below the in-flight model's, not its
    # step: the step decides.
    conclusion = lessons.inflight_conclusion(full(vllm=(104.0, 56.0)), BENCH)
    assert "moved with the host between rounds (0.97x to 1.73x over 2 rounds)" in conclusion.text
    assert "was shorter in every round" in conclusion.text
    first = conclusion.takeaway[0]
    assert first.startswith("vLLM's engine took 74 ms a step against 131 ms for the lab's")
    assert "in every round, for 1.36x its output tokens/s here" in first
    assert "measured vLLM 1.73x ahead" in first


def test_a_lead_that_one_round_does_not_show_is_within_the_noise_and_points_to_the_benchmark():
    measured = full(vllm=(104.0, 56.0))
    for r in measured.rows:  # nor does its step: the two engines' steps equal in round 2
        if r["scheduler"] == "vllm" and r["round"] == 2:
            r["itl_p50_ms"] = 131.0
    conclusion = lessons.inflight_conclusion(measured, BENCH)
    assert "a difference this run cannot tell from its noise (0.97x to 1.73x" in conclusion.text
    assert "This run could not show that lead beyond its noise" in conclusion.text
    first = conclusion.takeaway[0]
    assert "within this run's noise" in first and "measured vLLM 1.73x ahead" in first


def test_triton_cost_and_bfloat16_read_as_gain_tie_or_loss():
    tie = lessons.inflight_conclusion(full(), BENCH)
    assert "vLLM in Triton made 0.98x that: what Triton's front end" in tie.text
    assert "a little ahead" not in tie.text  # Triton behind: nothing to explain
    ahead = lessons.inflight_conclusion(full(own=(95.0, 92.0)), BENCH)
    assert (
        "made 1.09x that: what Triton's front end costs is within this run's noise. " in ahead.text
    )
    assert "Triton can come out a little ahead here: both front ends" in ahead.text
    assert "Serving vLLM through Triton cost nothing this run could tell" in tie.takeaway[1]
    loss = lessons.inflight_conclusion(full(own=(130.0, 125.0)), BENCH)
    assert "cost about 20% of the tokens/s in every round" in loss.text
    assert "cost about 20% of its own server's tokens/s" in loss.takeaway[1]
    assert "faster in every round); this CPU has bfloat16 instructions (AVX512-BF16)" in tie.text
    assert "Of its 8 greedy answers, 6 were the same as float32's: where a token's" in tie.text
    assert tie.takeaway[2] == (
        "In bfloat16, vLLM ran 1.74x faster on this CPU, and 6 of 8 greedy answers matched "
        "float32's."
    )


def test_the_takeaway_and_figures_read_as_words_within_the_lessons_limits():
    for case in (full(), full(vllm=(104.0, 62.0)), full(vllm=(40.0, 41.0))):
        conclusion = lessons.inflight_conclusion(case, BENCH)
        assert sentence_count(conclusion.takeaway) <= 3
        Takeaway.of(conclusion)  # the lab's own check
        shown = conclusion.text + " ".join(conclusion.takeaway) + conclusion.table.to_html()
        assert not INTERNAL.search(shown), INTERNAL.search(shown)
        assert len(conclusion.figures) <= 6
        assert not [k for k in conclusion.figures if "_vs_" in k]
    table = lessons.inflight_conclusion(full(), BENCH).table
    assert list(table["way"]) == ["the lab's in-flight model", "vLLM in Triton",
                                  "vLLM's own server", "vLLM in Triton (bfloat16)"]  # fmt: skip
    assert "between tokens, median (ms)" in table.columns


def test_verdicts_follow_the_labs_one_rule():
    assert verdict([1.5, 1.12]) == "gain" and verdict([1.5, 1.05]) == "gain"  # median x1.28
    assert verdict([1.15, 1.12]) == "tie" and verdict([1.5, 0.98]) == "tie"  # within; one against
    assert verdict([0.8, 0.85]) == "loss" and verdict([1.15]) == "tie"
    assert verdict([1.25]) == "gain" and verdict([float("nan")]) == "tie"


def test_failures_are_named_per_way_and_a_comparison_without_vllm_is_refused():
    rows = [row("inflight", 1, 60.0, 130.0), row("vllm", 1, 100.0, 75.0, failed=2)]
    conclusion = lessons.inflight_conclusion(comparison(rows))
    assert conclusion.figures["failed_requests"] == 2
    assert "Failed requests: 0 with the lab's in-flight model, 2 with vLLM in Triton." in (
        conclusion.text
    )
    with pytest.raises(ConfigError, match="needs the in-flight model and vLLM in Triton"):
        lessons.inflight_conclusion(comparison([row("inflight", 1, 60.0, 130.0)]))


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


def test_a_lead_of_another_size_than_the_benchmarks_names_the_way_that_moved():
    # the benchmark: 61.2 and 105.8 (x1.73); here the in-flight model fell to 40, vLLM held
    conclusion = lessons.inflight_conclusion(full(inflight=(40.0, 41.0)), BENCH)
    assert (
        "Between the two, the lab's in-flight model moved more (61.2 there, 40.5 here) than vLLM "
        "in Triton (105.8, 102.0)." in conclusion.text
    )


def test_the_greedy_answers_of_every_checked_float32_way_are_counted():
    text = lessons.inflight_conclusion(full(), BENCH).text
    assert (
        "against the plain model's answers alone: the lab's in-flight model 8 of 8, vLLM in "
        "Triton 8 of 8 the same (bfloat16's are counted below)." in text
    )
