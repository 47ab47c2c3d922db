"""Paced arrivals and Triton's statistics: each execution counted once, the pace kept, and a
failed request refused."""

from __future__ import annotations

import json
import threading

import pytest

from conftest import write_sleepy_model
from labkit import client
from labkit.errors import ConfigError, InferenceError
from labkit.proc import wait_until
from labkit.profiling import arrivals
from labkit.profiling.arrivals import Served


def stats(requests: int, batches: dict[int, tuple[int, float]], queue_ms: float = 0.0) -> dict:
    """Triton's ``/v2/models/<model>/stats`` answer: each request charged its whole batch's run."""
    run_ns = sum(size * ms * 1e6 for size, (_, ms) in batches.items())
    return {"model_stats": [{
        "inference_stats": {"success": {"count": requests}, "queue": {"ns": queue_ms * 1e6},
                            "compute_infer": {"ns": run_ns}},
        "batch_stats": [{"batch_size": size, "compute_infer": {"count": runs, "ns": ms * 1e6}}
                        for size, (runs, ms) in batches.items()],
    }]}  # fmt: skip


class FakeLoad:
    """Stands in for labkit.load.Load: no server here; what it was asked and what it says."""

    made: list[dict] = []

    def __init__(self, url, model, **options):
        FakeLoad.made.append({"url": url, "model": model, **options})
        self.failed = model == "broken"
        self.outcomes = [type("Outcome", (), {"ok": True, "latency_s": s})() for s in (2.0, 3.0)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def join(self, timeout_s):
        pass

    def summary(self):
        return {"answered": 6, "failed": 1 if self.failed else 0, "p50_ms": 2500.0,
                "seconds": 8.0, "failures_by_cause": {"HTTP 400": 1}}  # fmt: skip


class FakeServer:
    http_url = "127.0.0.1:1"


def _served(answer: dict) -> Served:
    return Served.parse(answer)


def test_measure_arrivals_paces_the_load_and_counts_each_execution_once(monkeypatch):
    # two executions of 3 requests, 900 ms each (2700 ms in the requests' own sums), counted
    # by Triton a moment after the answers
    reads = iter([stats(0, {}), stats(3, {3: (1, 900.0)}), stats(6, {3: (2, 1800.0)}, 9000)])
    monkeypatch.setattr(arrivals.Served, "read", lambda server, model: _served(next(reads)))
    monkeypatch.setattr(arrivals, "Load", FakeLoad)
    monkeypatch.setattr(arrivals.proc.time, "sleep", lambda s: None)
    FakeLoad.made.clear()
    row = arrivals.measure_arrivals(FakeServer(), "m", every_s=0.5, requests=6, prompt="Hi")
    assert FakeLoad.made[0]["rate_per_s"] == 2.0 and FakeLoad.made[0]["max_requests"] == 6
    assert row["batch"] == 3.0 and row["queue_ms"] == 1500.0
    assert row["compute_ms"] == 900.0  # one execution
    assert row["run_ms"] == 900.0  # the run each request was part of
    assert row["model_ms_per_request"] == 300.0  # 1800 ms of model time for 6 requests
    assert row["mean_ms"] == 2500.0 and row["seconds"] == 8.0


def test_a_paced_load_counts_over_its_whole_pacing_and_a_failure_is_refused(monkeypatch):
    reads = iter([stats(0, {}), stats(6, {1: (6, 600.0)})] * 2)
    monkeypatch.setattr(arrivals.Served, "read", lambda server, model: _served(next(reads)))
    monkeypatch.setattr(arrivals, "Load", FakeLoad)
    # 6 requests paced 2 s apart, all answered 8 s after the first send: 6 gaps, the pace
    row = arrivals.measure_arrivals(FakeServer(), "m", every_s=2.0, requests=6, prompt="Hi")
    assert row["seconds"] == 12.0
    with pytest.raises(InferenceError, match="1 of 6 requests to 'broken' failed"):
        arrivals.measure_arrivals(FakeServer(), "broken", every_s=None, requests=6, prompt="Hi")
    with pytest.raises(ConfigError, match="every_s=0"):
        arrivals.measure_arrivals(FakeServer(), "m", every_s=0, requests=6, prompt="Hi")


def test_paced_arrivals_leave_the_model_idle_and_the_delay_spans_two_and_a_half_gaps():
    assert arrivals.paced_interval_s(650.0) == 1.3
    assert arrivals.paced_interval_s(601.0) == 1.3  # rounded up: never closer than 2 computes
    assert arrivals.queue_delay_us(1.3) == 3_250_000
    with pytest.raises(ConfigError, match="> 0 ms"):
        arrivals.paced_interval_s(float("nan"))


@pytest.mark.integration
def test_triton_counts_each_batch_once_by_its_size(tmp_path, start_server):
    write_sleepy_model(tmp_path, sleep_ms=100)
    server = start_server(tmp_path)
    before = Served.read(server, "sleepy")
    threads = [threading.Thread(target=client.infer, args=(server.http_url, "sleepy", "hi"))
               for _ in range(4)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Triton counts a request in its metrics just after it sends the answer: on a loaded host a
    # read at once missed three of four (a fresh clone's suite). Read until all four are in.
    counted = wait_until(lambda: (Served.read(server, "sleepy") - before).requests >= 4, 10, 0.1)
    served = Served.read(server, "sleepy") - before
    assert counted and served.requests == 4, served
    assert sum(size * runs for size, (runs, _) in served.batches.items()) == 4
    assert served.executions < 4  # the requests that waited together ran together
    assert 100 * served.executions <= served.compute_ms < served.run_ms  # a batch counted once
    assert json.dumps(served.batches)  # plain numbers
