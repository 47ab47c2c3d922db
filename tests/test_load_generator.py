"""labkit.load against a tiny HTTP server of this test (no tritonserver): what reaches the server,
what the load records, and that nothing is left running.

The fake stands in for Triton's HTTP endpoints so that the counts are exact: it answers
``/generate``, ``/infer`` (and a model's ``/config``) and ``/generate_stream`` (one event per
token, then a closing one), and keeps every request it got. Every assertion counts requests;
none times anything.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import wait_for
from labkit.errors import ConfigError, InferenceError, ServerTimeoutError
from labkit.load import Load, stream_workload
from labkit.profiling import Workload

REFUSAL = "model 'tired' is not ready: the fake says so"


class FakeTriton(ThreadingHTTPServer):
    """Triton's HTTP endpoints, as far as a load needs them; every request kept."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, dict]] = []  # (model, endpoint, body)
        self.connections = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.release = threading.Event()  # paused models wait for it
        self.release.set()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def seen(self, endpoint: str | None = None, model: str | None = None) -> list[dict]:
        with self.lock:
            return [
                body
                for m, e, body in self.requests
                if (endpoint is None or e == endpoint) and (model is None or m == model)
            ]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections, as Triton's

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Fake-Replica", "r7")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        _, _, _, model, what = self.path.split("/")  # /v2/models/<model>/config
        batch = 8 if model == "batched" else 0
        self._answer(200, json.dumps({"name": model, "max_batch_size": batch}).encode())
        assert what == "config"

    def do_POST(self) -> None:
        _, _, _, model, endpoint = self.path.split("/")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append((model, endpoint, body))
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
        try:
            if model == "paused":
                server.release.wait(30)
            if model == "tired":
                self._answer(400, json.dumps({"error": REFUSAL}).encode())
            elif endpoint == "generate":
                self._answer(200, json.dumps({"text_output": body["text_input"]}).encode())
            elif endpoint == "infer":
                output = {"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["x"]}
                self._answer(200, json.dumps({"outputs": [output]}).encode())
            elif endpoint == "generate_stream":
                events = [{"text_output": "t"}] * int(body.get("max_tokens", 1))
                events.append({"error": "cut off"} if model == "breaks" else {"text_output": ""})
                text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
                self._answer(200, text.encode(), "text/event-stream")
            else:
                self._answer(404, json.dumps({"error": f"no endpoint {endpoint}"}).encode())
        finally:
            with server.lock:
                server.in_flight -= 1


@pytest.fixture
def fake():
    server = FakeTriton()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def load_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("labkit-load-")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a closed loop -------------------------------------------------------------------------------
def test_a_closed_loop_records_every_request_the_server_got(fake):
    with Load(fake.url, "echo", prompt="hello", max_tokens=3, concurrency=3) as load:
        load.wait_for(20)
    bodies = fake.seen("generate", "echo")
    assert len(bodies) == len(load.outcomes) >= 20
    assert {json.dumps(b, sort_keys=True) for b in bodies} == {
        json.dumps({"text_input": "hello", "max_tokens": 3}, sort_keys=True)
    }
    assert load.failures() == [] and load.successes() == len(bodies)
    summary = load.summary()
    assert summary["requests"] == summary["answered"] == len(bodies) and summary["failed"] == 0


def test_a_closed_loop_stops_after_max_requests_on_kept_alive_connections(fake):
    with Load(fake.url, "echo", concurrency=2, max_requests=9) as load:
        load.join(60)
    assert len(fake.seen("generate")) == 9 and load.successes() == 9
    assert fake.connections <= 2  # one connection per thread, kept alive
    assert "max_tokens" not in fake.seen("generate")[0]  # none asked: none sent


def test_never_more_requests_in_flight_than_threads(fake):
    fake.release.clear()  # the fake holds every request until released
    with Load(fake.url, "paused", concurrency=3, max_requests=12) as load:
        wait_for(lambda: fake.in_flight == 3, 30, "three requests held by the server")
        fake.release.set()
        load.join(60)
    assert fake.peak_in_flight == 3 and len(fake.seen("generate")) == 12 == load.successes()


# -- paced ---------------------------------------------------------------------------------------
def test_a_paced_load_sends_exactly_max_requests_and_never_more_than_its_threads_at_once(fake):
    with Load(
        fake.url, "plain", endpoint="infer", rate_per_s=500, concurrency=2, max_requests=15
    ) as load:
        load.join(60)
    assert len(fake.seen("infer", "plain")) == 15 == len(load.answered())
    assert fake.peak_in_flight <= 2


def test_a_paced_load_ends_at_max_duration_s_in_request_slots(fake):
    # the slot of request i is i / rate_per_s after the start: 0 s admits only the first
    with Load(fake.url, "echo", rate_per_s=1, max_duration_s=0, concurrency=4) as load:
        load.join(60)
    assert len(fake.seen("generate")) == 1 == len(load.outcomes)


def test_infer_sends_the_batch_dimension_the_model_config_asks_for_and_its_parameters(fake):
    for model, shape in (("batched", [1, 1]), ("plain", [1])):
        with Load(
            fake.url,
            model,
            endpoint="infer",
            prompt="p",
            max_tokens=5,
            parameters={"temperature": 0},
            max_requests=2,
        ) as load:
            load.join(60)
        (tensor,) = fake.seen("infer", model)[0]["inputs"]
        assert tensor == {"name": "text_input", "datatype": "BYTES", "shape": shape, "data": ["p"]}
        assert fake.seen("infer", model)[0]["parameters"] == {"temperature": 0, "max_tokens": 5}
        assert load.successes() == 2


def test_the_answering_replica_is_read_from_the_named_header(fake):
    with Load(fake.url, "echo", max_requests=3, replica_header="X-Fake-Replica") as load:
        load.join(60)
    assert {o.replica for o in load.outcomes} == {"r7"}
    assert len(load.answered(replica="r7")) == 3 and load.answered(replica="r0") == []


# -- a workload ----------------------------------------------------------------------------------
WORKLOAD = Workload("three", ("one", "two", "three"), (2, 5, 1))


@pytest.mark.parametrize("endpoint", ["generate", "stream"])
def test_each_request_of_a_workload_reaches_the_server_with_its_own_max_tokens(fake, endpoint):
    with Load(
        fake.url, "echo", endpoint=endpoint, workload=WORKLOAD, max_requests=6, concurrency=2
    ) as load:
        load.join(60)
    path = "generate_stream" if endpoint == "stream" else "generate"
    sent = sorted((b["text_input"], b["max_tokens"]) for b in fake.seen(path))
    assert sent == sorted(2 * list(zip(WORKLOAD.prompts, WORKLOAD.max_tokens, strict=True)))
    tokens = sum(o.tokens for o in load.outcomes)
    assert tokens == (2 * WORKLOAD.total_tokens if endpoint == "stream" else 0)
    assert load.summary()["tokens"] == tokens


def test_stream_workload_streams_each_request_once(fake):
    figures = stream_workload(fake.url, "echo", WORKLOAD, concurrency=2)
    assert set(figures) == {"concurrency", "output_tokens_per_s", "seconds", "client_cpu_s"}
    assert figures["concurrency"] == 2 and figures["output_tokens_per_s"] > 0
    sent = sorted((b["text_input"], b["max_tokens"], b["stream"]) for b in fake.seen())
    pairs = zip(WORKLOAD.prompts, WORKLOAD.max_tokens, strict=True)
    assert sent == sorted((p, n, True) for p, n in pairs)


def test_stream_workload_with_a_failed_request_says_how_many_failed(fake):
    with pytest.raises(InferenceError, match=r"3 of 3 streamed requests to 'tired' failed.*400"):
        stream_workload(fake.url, "tired", WORKLOAD, concurrency=2)


# -- failures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["generate", "infer", "stream"])
def test_a_refusal_is_recorded_with_its_status_and_the_server_message(fake, endpoint):
    with Load(fake.url, "tired", endpoint=endpoint, max_requests=4, batched=False) as load:
        load.join(60)
    failures = load.failures()
    assert len(failures) == 4 and load.successes() == 0
    assert {(o.status, o.error) for o in failures} == {(400, REFUSAL)}
    assert load.summary()["failures_by_cause"] == {f"400: {REFUSAL}": 4}


def test_an_error_inside_a_stream_fails_the_request_after_its_200(fake):
    with Load(fake.url, "breaks", endpoint="stream", max_tokens=2, max_requests=2) as load:
        load.join(60)
    assert {(o.status, o.ok) for o in load.outcomes} == {(200, False)}
    assert {o.error for o in load.outcomes} == {"cut off"}


def test_a_server_that_is_not_there_is_a_failure_without_status():
    with Load(f"127.0.0.1:{free_port()}", "echo", max_requests=3, concurrency=1) as load:
        load.join(60)
    assert [o.status for o in load.failures()] == [0, 0, 0]
    assert all("ConnectionRefused" in o.error for o in load.failures())
    assert load.summary()["failures_by_cause"].keys() == {
        f"no answer: {load.failures()[0].error[:90]}"
    }


def test_waiting_for_answers_a_bounded_load_cannot_give_names_its_failures(fake):
    load = Load(fake.url, "tired", max_requests=2)
    with load, pytest.raises(ServerTimeoutError, match=r"answered 0 of 5 requests before the load"):
        load.wait_for(5, timeout_s=600)
    assert [o.cause for o in load.failures()] == [f"400: {REFUSAL}"] * 2


# -- start and stop --------------------------------------------------------------------------------
def test_stop_ends_every_thread_and_every_request_sent_is_recorded(fake):
    load = Load(fake.url, "echo", concurrency=4)
    with load:
        load.wait_for(10)
        assert len(load_threads()) == 4 and load.running
    assert load_threads() == [] and not load.running
    assert len(fake.seen("generate")) == len(load.outcomes)  # none sent after, none lost
    load.stop()  # twice is harmless
    assert len(fake.seen("generate")) == len(load.outcomes)


def test_stop_before_start_is_harmless_and_join_needs_a_bound(fake):
    load = Load(fake.url, "echo")
    load.stop()
    assert load.outcomes == [] and not load.running
    with pytest.raises(ConfigError, match="runs until stopped"):
        Load(fake.url, "echo").join()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"endpoint": "classify"}, "endpoint='classify'; use one of generate, infer, stream"),
        ({"concurrency": 0}, "concurrency=0 must be >= 1"),
        ({"rate_per_s": 0}, r"rate_per_s=0 > 0"),
        ({"max_requests": -1}, "max_requests=-1"),
    ],
)
def test_impossible_settings_are_refused_before_any_request(fake, options, says):
    with pytest.raises(ConfigError, match=says):
        Load(fake.url, "echo", **options)
    assert fake.seen() == []
