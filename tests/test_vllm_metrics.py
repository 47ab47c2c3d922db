"""vLLM's engine metrics under vLLM's names.

Fast: :func:`labkit.profiling.vllm_metrics` reads a ``/metrics`` text captured from the real
server serving ``smollm2_vllm`` (Triton 2.51): the counters, the histograms' sums and counts, the
gauges, and their change ``since=`` an earlier reading. Integration (it runs in ``.venv-vllm``,
which imports vLLM): the model's stat logger, fed vLLM 0.32's own stats objects, queues what it
gets on the engine's loop and writes it from its own thread. The real server's counters rising by
the tokens sent and generated is tested in ``test_vllm_model.py``, beside its shared server.
"""

from __future__ import annotations

import pytest
from vllm_venv import run_in_vllm_venv

from labkit import profiling

#: Lines of /metrics from the real server (Triton 2.51 serving smollm2_vllm, after its warm-up
#: prompt and 3 requests of 5, 9 and 16 tokens), each histogram cut to a few of its buckets,
#: beside one of Triton's own counters.
CAPTURED = """\
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="smollm2_vllm",version="1"} 3
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model="smollm2_vllm"} 10
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model="smollm2_vllm"} 31
# HELP vllm_requests_aborted_total Requests aborted in the vLLM engine because their client went away
# TYPE vllm_requests_aborted_total counter
vllm_requests_aborted_total{model="smollm2_vllm"} 0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model="smollm2_vllm"} 0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model="smollm2_vllm"} 0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model="smollm2_vllm"} 0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{model="smollm2_vllm"} 4
vllm:time_to_first_token_seconds_sum{model="smollm2_vllm"} 0.3653140068054199
vllm:time_to_first_token_seconds_bucket{model="smollm2_vllm",le="0.1"} 2
vllm:time_to_first_token_seconds_bucket{model="smollm2_vllm",le="0.25"} 4
vllm:time_to_first_token_seconds_bucket{model="smollm2_vllm",le="+Inf"} 4
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_count{model="smollm2_vllm"} 27
vllm:time_per_output_token_seconds_sum{model="smollm2_vllm"} 1.931901937990915
vllm:time_per_output_token_seconds_bucket{model="smollm2_vllm",le="0.075"} 20
vllm:time_per_output_token_seconds_bucket{model="smollm2_vllm",le="0.1"} 25
vllm:time_per_output_token_seconds_bucket{model="smollm2_vllm",le="+Inf"} 27
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model="smollm2_vllm"} 4
vllm:e2e_request_latency_seconds_sum{model="smollm2_vllm"} 2.296923875808716
vllm:e2e_request_latency_seconds_bucket{model="smollm2_vllm",le="0.8"} 3
vllm:e2e_request_latency_seconds_bucket{model="smollm2_vllm",le="1.5"} 4
vllm:e2e_request_latency_seconds_bucket{model="smollm2_vllm",le="2"} 4
vllm:e2e_request_latency_seconds_bucket{model="smollm2_vllm",le="+Inf"} 4
"""


def later(text: str, changes: dict[str, float]) -> str:
    """``text`` with each named sample's value replaced."""
    lines = []
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if not line.startswith("#") and name in changes:
            line = f"{line.rsplit(' ', 1)[0]} {changes[name]!r}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_the_vllm_counters_histogram_totals_and_gauges_are_read_per_model():
    row = profiling.vllm_metrics(CAPTURED).set_index("model").loc["smollm2_vllm"]
    assert (row["prompt_tokens"], row["generation_tokens"], row["aborted"]) == (10, 31, 0)
    assert (row["ttft_count"], row["tpot_count"], row["e2e_count"]) == (4, 27, 4)
    assert row["avg_ttft_ms"] == pytest.approx(365.3140068054199 / 4)
    assert row["avg_tpot_ms"] == pytest.approx(1931.901937990915 / 27)
    assert row["avg_e2e_ms"] == pytest.approx(2296.923875808716 / 4)
    assert (row["running"], row["waiting"], row["kv_cache_usage"]) == (0, 0, 0)


def test_since_an_earlier_reading_gives_the_counters_change_and_the_gauges_now():
    before = profiling.vllm_metrics(CAPTURED)
    text = later(
        CAPTURED,
        {
            "vllm:prompt_tokens_total": 18,
            "vllm:generation_tokens_total": 47,
            "vllm:time_to_first_token_seconds_count": 5,
            "vllm:time_to_first_token_seconds_sum": 0.5653140068054199,
            "vllm:time_per_output_token_seconds_count": 42,
            "vllm:time_per_output_token_seconds_sum": 2.231901937990915,
            "vllm:num_requests_running": 1,
            "vllm:kv_cache_usage_perc": 0.25,
        },
    )
    change = profiling.vllm_metrics(text, since=before).set_index("model").loc["smollm2_vllm"]
    assert (change["prompt_tokens"], change["generation_tokens"]) == (8, 16)
    assert (change["ttft_count"], change["tpot_count"]) == (1, 15)
    assert change["avg_ttft_ms"] == pytest.approx(200.0)  # the new request's, not the mean of 5
    assert change["avg_tpot_ms"] == pytest.approx(20.0)
    assert change["e2e_count"] == 0 and change["avg_e2e_ms"] != change["avg_e2e_ms"]  # NaN
    assert (change["running"], change["kv_cache_usage"]) == (1, 0.25)  # gauges are not subtracted


def test_scrape_keeps_each_counters_name_as_the_text_gives_it():
    names = set(profiling.scrape(CAPTURED)["name"])
    # vLLM's counters end in _total on /metrics; Triton's own do not (the parser adds it)
    assert {"vllm:prompt_tokens_total", "vllm_requests_aborted_total"} <= names
    assert "nv_inference_count" in names and "nv_inference_count_total" not in names
    assert "vllm:prompt_tokens" not in names


def test_a_server_without_a_vllm_model_gives_an_empty_frame_with_the_columns():
    text = CAPTURED.split("# HELP vllm:prompt_tokens_total", 1)[0]
    frame = profiling.vllm_metrics(text)
    assert frame.empty and {"model", "prompt_tokens", "running"} <= set(frame.columns)


#: Runs in .venv-vllm: the model's metrics module with a stand-in for what only a running stub
#: has (pb_utils.MetricFamily, which sends each call to the server), fed vLLM's own stats objects.
STAT_LOGGER_SCRIPT = """
import importlib, sys, threading
from types import SimpleNamespace
sys.path[:0] = sys.argv[1:3]
import triton_python_backend_utils as pb_utils
calls = []
class Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind
    def Metric(self, labels, buckets=None):
        family = self
        def call(what):
            return lambda value: calls.append(
                (family.name, family.kind, what, value, threading.current_thread().name))
        return SimpleNamespace(increment=call("increment"), set=call("set"), observe=call("observe"),
                               labels=labels, buckets=buckets)
pb_utils.MetricFamily = Family
pb_utils.Logger = SimpleNamespace(log_error=print, log_info=print)
metrics = importlib.import_module("1.metrics")
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
# the writer thread is held up: what arrives meanwhile is folded into one write
released = threading.Event()
take = metrics.EngineMetrics._take
metrics.EngineMetrics._take = lambda self: (released.wait(), take(self))[1]
engine = metrics.EngineMetrics("smollm2_vllm")
logger = engine.logger_factory()(None, 0)
step = IterationStats()
step.prompt_token_stats.total, step.num_generation_tokens = 7, 3
step.time_to_first_tokens_iter, step.inter_token_latencies_iter = [0.2], [0.01, 0.03]
step.finished_requests = [FinishedRequestStats("length", e2e_latency=0.5,
                                               mean_time_per_output_token=0.02)]
scheduler = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, num_skipped_waiting_reqs=1,
                           kv_cache_usage=0.5)
for _ in range(3):
    logger.record(scheduler, step)
engine.aborted.increment(1)
on_the_loop = list(calls)
released.set()
engine.close()
print({"on_the_loop": on_the_loop, "calls": calls})
"""


@pytest.mark.integration
def test_the_stat_logger_queues_on_the_engines_loop_and_writes_folded_from_its_thread():
    """Each metric call waits for Triton's answer; vLLM calls the logger on the engine's loop."""
    seen = run_in_vllm_venv(STAT_LOGGER_SCRIPT)
    assert seen["on_the_loop"] == []  # record() and increment() only queued
    assert {thread for *_, thread in seen["calls"]} == {"vllm-metrics"}
    writes = {(name, what): [] for name, _, what, _, _ in seen["calls"]}
    for name, kind, what, value, _ in seen["calls"]:
        writes[name, what].append((kind, value))
    assert writes["vllm:prompt_tokens_total", "increment"] == [("counter", 21)]
    assert writes["vllm:generation_tokens_total", "increment"] == [("counter", 9)]
    assert writes["vllm_requests_aborted_total", "increment"] == [("counter", 1)]
    assert writes["vllm:num_requests_running", "set"] == [("gauge", 2)]  # once: it did not change
    assert writes["vllm:num_requests_waiting", "set"] == [("gauge", 2)]  # vLLM's: deferred too
    assert writes["vllm:kv_cache_usage_perc", "set"] == [("gauge", 0.5)]
    assert writes["vllm:time_to_first_token_seconds", "observe"] == [("histogram", 0.2)] * 3
    assert (
        writes["vllm:time_per_output_token_seconds", "observe"]
        == [
            ("histogram", 0.01),
            ("histogram", 0.03),
        ]
        * 3
    )
    assert writes["vllm:e2e_request_latency_seconds", "observe"] == [("histogram", 0.5)] * 3
    # one call per counter and per gauge for the three records, one per observation
    assert len(seen["calls"]) == 3 + 3 + 3 + 6 + 3
