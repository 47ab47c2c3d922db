"""Triton's Prometheus metrics endpoint as DataFrames: per-model counters, batch sizes, CPU/GPU,
and a vLLM model's engine metrics.

Parsed with prometheus_client's own text parser. :func:`metrics` with ``since=`` gives the change
over an interval, which is what an average batch size under a given load needs;
:func:`vllm_metrics` does the same for the token counters and latency histograms a vLLM model
exports under vLLM's names (``smollm2_vllm``, and Triton's own vllm_backend).
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from labkit.errors import ConfigError, ToolError

_MODEL_COUNTERS = {
    "nv_inference_request_success": "request_success",
    "nv_inference_request_failure": "request_failure",
    "nv_inference_count": "inference_count",
    "nv_inference_exec_count": "execution_count",
    "nv_inference_request_duration_us": "request_us",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_input_duration_us": "compute_input_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    "nv_inference_compute_output_duration_us": "compute_output_us",
}
_SYSTEM_GAUGES = {
    "nv_cpu_utilization": "cpu_utilization",
    "nv_cpu_memory_used_bytes": "cpu_memory_used_bytes",
    "nv_cpu_memory_total_bytes": "cpu_memory_total_bytes",
    "nv_gpu_utilization": "gpu_utilization",
    "nv_gpu_memory_used_bytes": "gpu_memory_used_bytes",
    "nv_gpu_memory_total_bytes": "gpu_memory_total_bytes",
    "nv_gpu_power_usage": "gpu_power_w",
}


def scrape(source, timeout_s: float = 10.0) -> pd.DataFrame:
    """Every sample of the metrics endpoint: one row per sample (name, labels..., value).

    ``source`` is a :class:`~labkit.server.TritonServer`, a metrics URL, or exposition text.
    """
    text = _metrics_text(source, timeout_s)
    # The parser names every counter's samples ``<family>_total``: Triton's own counters lack the
    # suffix, vLLM's have it (``vllm:prompt_tokens_total``). Keep each name as the text gives it.
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    rows = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            added = sample.name == f"{family.name}_total" and sample.name not in declared
            name = family.name if added else sample.name
            rows.append({"name": name, **sample.labels, "value": float(sample.value)})
    return pd.DataFrame(rows)


def _metrics_text(source, timeout_s: float) -> str:
    url = getattr(source, "metrics_url", source)
    if not isinstance(url, str):
        raise ConfigError(f"metrics source must be a server, a URL or text, got {source!r}")
    if "\n" in url or url.startswith("#"):
        return url
    if "://" not in url:
        url = f"http://{url}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as exc:
        raise ToolError(
            f"cannot read Triton metrics at {url}: {exc}; check the server runs with "
            "--allow-metrics=true and that the metrics port is right"
        ) from exc


def metrics(source, *, since: pd.DataFrame | None = None, timeout_s: float = 10.0) -> pd.DataFrame:
    """Per-model metrics from Triton's endpoint, one row per (model, version).

    Columns: the counters (``inference_count``, ``execution_count``, ``queue_us``, ...),
    ``avg_batch_size`` (inference count / execution count), average queue and compute
    milliseconds per request, and the server-wide CPU/GPU utilisation and memory where reported.
    Pass ``since=`` an earlier result to get the counters' change over that interval.
    """
    samples = scrape(source, timeout_s)
    if samples.empty or "model" not in samples:
        return pd.DataFrame(columns=["model", "version", *_MODEL_COUNTERS.values()])
    per_model = samples[samples["name"].isin(_MODEL_COUNTERS) & samples["model"].notna()]
    frame = (
        per_model.assign(metric=per_model["name"].map(_MODEL_COUNTERS))
        .groupby(["model", "version", "metric"])["value"]
        .sum()  # failure reasons add up
        .unstack("metric")
        .reindex(columns=list(_MODEL_COUNTERS.values()))
        .fillna(0.0)
        .reset_index()
    )
    if since is not None and not since.empty:
        before = since.set_index(["model", "version"])[list(_MODEL_COUNTERS.values())]
        now = frame.set_index(["model", "version"])
        frame = now.sub(before.reindex(now.index).fillna(0.0)).reset_index()
    executions = frame["execution_count"].where(frame["execution_count"] > 0)
    requests = frame["request_success"].where(frame["request_success"] > 0)
    frame["avg_batch_size"] = frame["inference_count"] / executions
    for part in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        frame[f"avg_{part}_ms"] = frame[f"{part}_us"] / requests / 1000.0
    for name, column in _SYSTEM_GAUGES.items():
        values = samples.loc[samples["name"] == name, "value"]
        if not values.empty:  # per GPU: mean utilisation, summed memory
            frame[column] = values.mean() if "utilization" in name else values.sum()
    return frame.sort_values(["model", "version"], ignore_index=True)


#: A vLLM model's counters, and its histograms' counts and sums (``_count``, ``_sum``), as
#: ``smollm2_vllm`` and Triton's vllm_backend name them on /metrics (vLLM's names).
_VLLM_COUNTERS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:time_to_first_token_seconds_sum": "ttft_s",
    "vllm:time_per_output_token_seconds_count": "tpot_count",
    "vllm:time_per_output_token_seconds_sum": "tpot_s",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
    "vllm:e2e_request_latency_seconds_sum": "e2e_s",
    "vllm_requests_aborted_total": "aborted",  # smollm2_vllm's own: clients that went away
}
#: Its gauges: the engine's state at its last step.
_VLLM_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}


def vllm_metrics(
    source, *, since: pd.DataFrame | None = None, timeout_s: float = 10.0
) -> pd.DataFrame:
    """A vLLM model's engine metrics, one row per model that exports them.

    Columns: the counters ``prompt_tokens`` and ``generation_tokens`` (tokens the engine
    prefilled and generated) and ``aborted``; for each histogram, time to first token
    (``ttft``, one per prompt), time per output token (``tpot``, one per token after the
    first: the time since the one before) and end-to-end latency (``e2e``, one per finished sequence), its count
    and its sum in seconds (``ttft_count``, ``ttft_s``, ...) and their mean in milliseconds
    (``avg_ttft_ms``, ``avg_tpot_ms``, ``avg_e2e_ms``); and the gauges ``running``, ``waiting``
    and ``kv_cache_usage`` (0..1) as of the engine's last step. Pass ``since=`` an earlier result
    to get the counters' change over that interval (the gauges stay current). The buckets are in
    :func:`scrape`'s rows (``..._bucket``, label ``le``).
    """
    columns = ["model", *_VLLM_COUNTERS.values(), *_VLLM_GAUGES.values()]
    frame = _per_model(
        scrape(source, timeout_s), {**_VLLM_COUNTERS, **_VLLM_GAUGES}, ["model"], columns[1:]
    )
    if frame is None:
        return pd.DataFrame(columns=columns)
    counters = list(_VLLM_COUNTERS.values())
    if since is not None and not since.empty:
        before = since.set_index("model")[counters]
        now = frame.set_index("model")
        now[counters] = now[counters].sub(before.reindex(now.index).fillna(0.0))
        frame = now.reset_index()
    for histogram in ("ttft", "tpot", "e2e"):
        count = frame[f"{histogram}_count"]
        frame[f"avg_{histogram}_ms"] = frame[f"{histogram}_s"] / count.where(count > 0) * 1000.0
    return frame.sort_values("model", ignore_index=True)


def request_counts(metrics_url: str, model: str) -> dict[str, float]:
    """Triton's success and failure request counters for ``model`` (all versions)."""
    text = _metrics_text(metrics_url, 10.0)
    counts = {"success": 0.0, "failure": 0.0}
    for family in text_string_to_metric_families(text):
        kind = family.name.removeprefix("nv_inference_request_")
        if family.name.startswith("nv_inference_request_") and kind in counts:
            counts[kind] += sum(s.value for s in family.samples if s.labels.get("model") == model)
    return counts


_CACHE_PER_MODEL = {
    "nv_cache_num_hits_per_model": "hits",
    "nv_cache_num_misses_per_model": "misses",
    "nv_cache_hit_duration_per_model": "hit_us",
    "nv_cache_miss_duration_per_model": "miss_us",
}
_CACHE_TOTALS = {
    "nv_cache_num_entries": "entries",
    "nv_cache_util": "util",
    "nv_cache_num_evictions": "evictions",
    "nv_cache_num_hits": "hits",
    "nv_cache_num_misses": "misses",
    "nv_cache_num_lookups": "lookups",
}


def cache_metrics(
    source, *, since: pd.DataFrame | None = None, timeout_s: float = 10.0
) -> pd.DataFrame:
    """The response cache's counters per model, one row per (model, version) that uses it.

    Columns: ``hits``, ``misses``, ``hit_us`` and ``miss_us`` (Triton's total time spent on
    lookups that hit, and on lookups and insertions that missed, in microseconds), and their
    averages ``avg_hit_us``, ``avg_miss_us`` (the cache's own time, not the request's). Empty
    when no model has the cache enabled, or the server runs without ``--cache-config``.
    ``since=`` an earlier result gives the change over that interval.
    """
    columns = ["model", "version", *_CACHE_PER_MODEL.values()]
    frame = _per_model(
        scrape(source, timeout_s), _CACHE_PER_MODEL, ["model", "version"], columns[2:]
    )
    if frame is None:
        return pd.DataFrame(columns=columns)
    if since is not None and not since.empty:
        before = since.set_index(["model", "version"])[list(_CACHE_PER_MODEL.values())]
        now = frame.set_index(["model", "version"])
        frame = now.sub(before.reindex(now.index).fillna(0.0)).reset_index()
    frame["avg_hit_us"] = frame["hit_us"] / frame["hits"].where(frame["hits"] > 0)
    frame["avg_miss_us"] = frame["miss_us"] / frame["misses"].where(frame["misses"] > 0)
    return frame.sort_values(["model", "version"], ignore_index=True)


def cache_totals(source, timeout_s: float = 10.0) -> dict[str, float]:
    """The whole cache's gauges: ``entries``, ``util`` (the fraction of its size in use),
    ``evictions``, ``hits``, ``misses`` and ``lookups``; empty without a cache."""
    samples = scrape(source, timeout_s)
    if samples.empty:
        return {}
    rows = samples[samples["name"].isin(_CACHE_TOTALS)]
    pairs = zip(rows["name"], rows["value"], strict=True)
    return {_CACHE_TOTALS[name]: float(value) for name, value in pairs}


def _per_model(
    samples: pd.DataFrame, names: dict[str, str], index: list[str], columns: list[str]
) -> pd.DataFrame | None:
    """The samples named in ``names`` (metric name -> column), summed per ``index`` (the model,
    and its version where asked), one column each in ``columns``' order; None when there are
    none."""
    if samples.empty or "model" not in samples:
        return None
    rows = samples[samples["name"].isin(names) & samples["model"].notna()]
    if rows.empty:
        return None
    frame = (
        rows.assign(metric=rows["name"].map(names))
        .pivot_table(index=index, columns="metric", values="value", aggfunc="sum")
        .reindex(columns=columns)
        .fillna(0.0)
        .reset_index()
    )
    frame.columns.name = None
    return frame
