"""Notebook 06's lesson says what the study measured: a gain, a tie and a loss of in-flight batching
read differently; the ITL explanation appears only when in-flight's ITL is longer; bfloat16 is
called faster only when it was; a way the lesson does not know is compared under its own name."""

from __future__ import annotations

import pytest

from labkit import lessons
from labkit.errors import ConfigError
from labkit.llm_serving import StudyResult, results_frame, targets_frame
from labkit.llm_serving.charts import target_label


def row(scheduler: str, tokens: float, ttft: float, itl: float, **extra) -> dict:
    return {
        "scheduler": scheduler,
        "workload": "mixed",
        "streaming": True,
        "concurrency": 4,
        "output_tokens_per_s": tokens,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 1.5,
        "itl_p50_ms": itl,
        "requests": 8,
        "failed": 0,
        "aiperf_cpu_share": 0.5,
        **extra,
    }


def precision(f32: float, bf16: float, agree: int = 4) -> dict:
    return {
        "compared": 4,
        "float32": {"output_tokens_per_s": f32, "equal_float32": 4},
        "bfloat16": {"output_tokens_per_s": bf16, "equal_float32": agree},
    }


def study(rows: list[dict], prec: dict | None = None, bf16_cpu: bool | None = True, limit=None):
    return StudyResult(
        settings={},
        engine_limits={},
        host={"avx512_bf16": bf16_cpu},
        run_dir="",
        rows=rows,
        precision=prec,
        limit=limit or {},
    )


def test_a_gain_sooner_tokens_and_a_longer_itl_with_its_reason():
    rows = [row("none", 17.0, 2485, 56.2), row("dynamic", 19.8, 980, 106.7),
            row("inflight", 39.4, 178, 81.5)]  # fmt: skip
    conclusion = lessons.inflight_conclusion(study(rows, precision(39.6, 75.4, agree=3)))
    text = conclusion.text
    assert (
        "served 39.4 output tokens/s: against no batching's 17.0, x2.32 output tokens/s, a gain"
        in text
    )
    assert "against dynamic batching's 19.8, x1.99 output tokens/s, a gain" in text
    assert "against dynamic batching's 980 ms, x0.18 TTFT p50, shorter" in text
    assert "against no batching's 56.2 ms, x1.45 ITL p50, longer" in text
    assert "Why the gap between tokens is longer in flight than with no batching:" in text
    assert "x2.32 output tokens/s against no batching." in text
    assert "a single measurement of 8 requests" in text
    assert "bfloat16 ran faster than float32: 75.4 output tokens/s against 39.6 (x1.90" in text
    assert "3 of bfloat16's 4 greedy answers equal float32's" in text
    assert (
        str(conclusion.figures["inflight_vs_dynamic_output_tokens_per_s"])
        == "x1.99 output tokens/s"
    )
    assert str(conclusion.figures["inflight_vs_none_itl_p50"]) == "x1.45 ITL p50"
    assert conclusion.figures["failed_requests"] == 0
    assert list(conclusion.table.columns) == [
        "figure", "no batching", "dynamic batching", "in-flight batching",
    ]  # fmt: skip


def test_a_tie_is_not_called_a_gain_and_no_itl_reason_without_a_longer_itl():
    rows = [row("dynamic", 20.0, 900, 100), row("inflight", 21.0, 880, 95)]
    text = lessons.inflight_conclusion(study(rows)).text
    assert "x1.05 output tokens/s, a tie" in text and "a gain" not in text
    assert "x0.98 TTFT p50, about the same" in text
    assert "Why the gap" not in text and "no batching" not in text
    assert "bfloat16" not in text


def test_a_loss_is_called_a_loss_and_a_longer_itl_that_did_not_pay_says_so():
    rows = [row("dynamic", 30.0, 500, 60), row("inflight", 20.0, 700, 90)]
    text = lessons.inflight_conclusion(study(rows)).text
    assert "x0.67 output tokens/s, a loss" in text
    assert "x1.40 TTFT p50, longer" in text
    assert "Here the batch did not make up for it in output tokens/s." in text


def test_bfloat16_within_the_noise_is_no_faster_and_slower_is_slower():
    rows = [row("dynamic", 20.0, 900, 100), row("inflight", 40.0, 300, 95)]
    tie = lessons.inflight_conclusion(study(rows, precision(45.7, 41.2))).text
    assert "bfloat16 ran no faster than float32: 41.2 output tokens/s against 45.7 (x0.90" in tie
    assert "one measurement cannot tell from the noise" in tie
    assert "did not show them pay" in tie and "ran faster" not in tie
    assert "All 4 of bfloat16's greedy answers equal float32's here" in tie
    slower = lessons.inflight_conclusion(study(rows, precision(45.7, 30.0), bf16_cpu=False)).text
    assert "bfloat16 ran slower than float32: 30.0 output tokens/s against 45.7 (x0.66" in slower
    assert "This CPU has no bfloat16 instructions" in slower


def test_repeats_give_a_noise_band_instead_of_the_single_measurement_rule():
    rows = [row("dynamic", 20.0, 900, 100), row("dynamic", 22.0, 900, 100),
            row("inflight", 23.0, 800, 100), row("inflight", 24.0, 820, 100)]  # fmt: skip
    text = lessons.inflight_conclusion(study(rows)).text
    # +12% is below the 20% rule's gain, but beyond the repeats' spread (10%): a gain
    assert "x1.12 output tokens/s, a gain" in text
    assert "mean of 2 or more repeated measurements" in text and "single" not in text


def test_an_unknown_way_is_compared_under_its_own_name():
    rows = [row("dynamic", 20.0, 900, 100), row("inflight", 40.0, 300, 95),
            row("sglang", 50.0, 200, 60)]  # fmt: skip
    conclusion = lessons.inflight_conclusion(study(rows))
    assert "against sglang's 50.0, x0.80 output tokens/s, a loss" in conclusion.text
    assert "sglang" in conclusion.table.columns
    assert "inflight_vs_sglang_output_tokens_per_s" in conclusion.figures


@pytest.mark.parametrize(
    ("served", "words"),
    [
        (130.0, "130 (x1.22 output tokens/s), more than its own server: both run the same"),
        (100.0, "100 (x0.94 output tokens/s), about as much as its own server"),
        (80.0, "80.0 (x0.75 output tokens/s), less than its own server: Triton's Python backend"
               " cost 25%"),
    ],
)  # fmt: skip
def test_vllm_in_triton_is_put_beside_vllms_own_server_as_a_gain_a_tie_or_a_loss(served, words):
    rows = [row("inflight", 40.0, 300, 95), row("vllm", served, 150, 50),
            row("vllm-standalone", 106.2, 170, 60)]  # fmt: skip
    conclusion = lessons.inflight_conclusion(study(rows))
    assert "against vLLM in Triton's" in conclusion.text
    own = "vLLM's own OpenAI server, on the same cores with the same engine settings, made 106"
    assert own in conclusion.text
    assert f"vLLM in Triton made {words}" in conclusion.text
    assert "vllm_in_triton_vs_standalone_output_tokens_per_s" in conclusion.figures
    assert "vLLM's own server" in conclusion.table.columns


def test_the_served_figure_is_put_beside_the_in_process_limit():
    rows = [row("dynamic", 20.0, 900, 100), row("inflight", 30.0, 300, 95)]
    limit = {"mixed": {"output_tokens_per_s": 40.0, "concurrency": 4}}
    conclusion = lessons.inflight_conclusion(study(rows, limit=limit))
    assert "made 30.0 (x0.75 output tokens/s), less than the engine alone" in conclusion.text
    assert str(conclusion.figures["inflight_served_vs_limit"]) == "x0.75 output tokens/s"


def test_failures_are_named_per_way():
    rows = [row("dynamic", 20.0, 900, 100, failed=2), row("inflight", 30.0, 300, 95)]
    conclusion = lessons.inflight_conclusion(study(rows))
    assert conclusion.figures["failed_requests"] == 2
    assert "Failed requests: 2 with dynamic batching, 0 with in-flight batching." in conclusion.text


def test_a_study_without_in_flight_at_the_level_is_refused():
    with pytest.raises(ConfigError, match="measured no in-flight batching"):
        lessons.inflight_conclusion(study([row("dynamic", 20.0, 900, 100)]))
    with pytest.raises(ConfigError, match="at concurrency \\[4\\], not at 8"):
        lessons.inflight_conclusion(study([row("inflight", 20.0, 900, 100)]), 8)


def test_the_tables_show_plain_words():
    rows = [row("dynamic", 20.0, 900, 100), row("inflight", 40.0, 300, 95)]
    frame = results_frame(rows)
    assert list(frame["way"]) == ["dynamic batching", "in-flight batching"]
    assert list(frame["clients"]) == ["4 streaming", "4 streaming"]
    assert "output_tokens_per_s" not in frame.columns and "ITL p50 (ms)" in frame.columns
    assert target_label("inflight_ttft_p99_vs_dynamic_c4_mixed_nonstreaming") == (
        "TTFT p99, in-flight over dynamic batching (4 clients, mixed lengths, whole answers)"
    )
    targets = {"failed_requests": {"target": "== 0", "measured": 0, "met": True}}
    assert targets_frame(targets).loc["failed requests", "met"] == "yes"
