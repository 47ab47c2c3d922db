"""Token streaming from a real Triton: SSE and gRPC pieces join to the non-streaming answer.

One module-scoped server holds, from the same ``model.py``: ``smollm2`` and ``smollm2_stream``
(the committed folders, the real LLM), ``tf`` / ``tf_stream`` (tiny Falcon, plain and
decoupled), ``tfb_stream`` (decoupled with dynamic batching) and ``idle_stream`` (never loaded).
"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import JOIN_DELAY_MICROSECONDS, imported_as_triton_does, sent_together, wait_for
from labkit import client, repository, streaming
from labkit.errors import InferenceError
from labkit.server import TritonServer, serve_streaming_twin
from labkit.widgets import prompt_ui

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "labkit" / "templates" / "textgen"
PROMPTS = ["I am going", "Where is the nearest", "Once upon a time there was", "Hi"]


# -- the committed streaming model (no server) -------------------------------------------------
def test_streaming_model_is_the_same_code_and_weights_as_smollm2_but_decoupled():
    folder = ROOT / "model_repository" / "smollm2_stream"
    assert (folder / "1" / "model.py").resolve() == (TEMPLATE / "model.py").resolve()
    plain = repository.read_config(ROOT / "model_repository" / "smollm2" / "config.pbtxt")
    stream = repository.read_config(folder / "config.pbtxt")
    assert (
        stream.model_transaction_policy.decoupled and not plain.model_transaction_policy.decoupled
    )
    assert dict(stream.parameters) == dict(plain.parameters)
    assert stream.parameters["labkit_weights"].string_value == "smollm2"


# -- what an HTTP stream gets that is not Triton's events, and a full pool (no Triton) ----------
class WrongAnswers(BaseHTTPRequestHandler):
    """A local HTTP server that answers ``/generate_stream`` as Triton never does, by model name:
    ``json`` with a JSON body, ``garbled`` with an event whose data is not JSON, ``held`` with
    one event and then nothing until the test releases it (what a long generation looks like)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        model = self.path.split("/")[3]
        kind = "application/json" if model == "json" else "text/event-stream"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.end_headers()
        if model == "json":
            self.wfile.write(b'{"text_output": "Hi"}')
        elif model == "garbled":
            self.wfile.write(b'data: {"text_output": "Hi"}\n\ndata: {text_output: Hi\n\n')
        else:
            self.wfile.write(b'data: {"text_output": "Hi"}\n\n')
            self.wfile.flush()
            self.server.release.wait(5)
            self.wfile.write(b'data: {"text_output": "!"}\n\n')

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def wrong_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), WrongAnswers)
    httpd.daemon_threads = True
    httpd.release = threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def address(httpd) -> str:
    return f"127.0.0.1:{httpd.server_address[1]}"


def test_an_answer_that_is_not_server_sent_events_is_named_not_called_unreachable(wrong_server):
    """Before, httpx-sse's SSEError (a TransportError) read "cannot reach Triton"."""
    url = address(wrong_server)
    with pytest.raises(InferenceError, match="is not Triton's server-sent events") as err:
        list(streaming.stream(url, "json", "Hi", timeout_s=5))
    assert "got 'application/json'" in str(err.value) and "cannot reach" not in str(err.value)
    assert f"is {url!r} a Triton server's HTTP address?" in str(err.value)


def test_an_event_whose_data_is_not_json_is_an_inference_error_that_quotes_it(wrong_server):
    """Before, json.loads' own JSONDecodeError came out of the stream."""
    pieces = streaming.stream(address(wrong_server), "garbled", "Hi", timeout_s=5)
    assert next(pieces) == "Hi"
    with pytest.raises(InferenceError, match=r"an event's data is not JSON: '\{text_output: Hi'"):
        next(pieces)


def test_a_stream_that_waits_for_a_pooled_connection_is_not_called_silent(
    wrong_server, monkeypatch
):
    """Before, httpx's PoolTimeout (a TimeoutException) read "sent nothing for 0.3 s", blaming
    the server, which was never asked. Here the pool holds one connection; the lab's holds
    STREAM_CONNECTIONS (100, httpx's default)."""
    monkeypatch.setattr(streaming, "STREAM_CONNECTIONS", 1)
    monkeypatch.setattr(streaming, "_SESSION", None)  # the next stream makes a 1-connection one
    url = address(wrong_server)
    held = streaming.stream(url, "held", "Hi", timeout_s=5)
    try:
        assert next(held) == "Hi"
        with pytest.raises(InferenceError, match="no stream to model 'json'") as err:
            list(streaming.stream(url, "json", "Hi", timeout_s=0.3))
        said = str(err.value)
        assert "all 1 connections of this process's HTTP streaming client" in said
        assert "not asked yet" in said and "sent nothing" not in said
        wrong_server.release.set()
        assert list(held) == ["!"]  # the held stream ends as it should
    finally:
        held.close()
        streaming._session().close()


BYTES = {i: bytes([i]) for i in range(256)} | {256: b" caf", 257: b"\xc3\xa9", 258: b"\xf0\x9f"}


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer's decode: each token is some bytes; an unfinished character
    decodes to U+FFFD, as Hugging Face's byte-level BPE decodes."""
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def pieces_of(module, prompt: list[int], new: list[int], decode) -> list[str]:
    text = module.IncrementalText(prompt, decode)
    return [text.piece(new[:n]) for n in range(1, len(new) + 1)]


def test_a_piece_waits_for_an_incomplete_character_and_never_takes_text_back():
    with imported_as_triton_does(TEMPLATE, "detokenize") as module:
        # " café" as " caf" + the two bytes of "é" in two tokens, then "!"
        new = [256, 0xC3, 0xA9, ord("!")]
        assert pieces_of(module, [ord("A")], new, byte_decode) == [" caf", "", "é", "!"]
        # "🙂" in a token of 2 bytes and two of 1: nothing until its last byte
        new = [258, 0x99, 0x82, ord(" ")]
        assert pieces_of(module, [ord("A")], new, byte_decode) == ["", "", "🙂", " "]

        def rewriting(ids: list[int]) -> str:  # a decode that changes earlier text: "ab" -> "X"
            return byte_decode(ids).replace("ab", "X")

        prompt, new = [ord("z")], [ord("a"), ord("b"), ord("c")]
        got = pieces_of(module, prompt, new, rewriting)
        # "b" would take back the "a" sent: nothing more is sent as a piece; the final response
        # sends what the whole decode adds to the pieces, if it still starts with them
        assert got == ["a", "", ""]


def test_pieces_join_to_the_whole_decode_and_each_decodes_a_few_tokens_only():
    """Every piece decodes the last few sent tokens and the new ones: a 600-token answer costs
    each token the same as the first did (the whole decode made it O(n) a token)."""
    import random

    with imported_as_triton_does(TEMPLATE, "detokenize") as module:
        rng = random.Random(0)
        lengths: list[int] = []

        def counting(ids: list[int]) -> str:
            lengths.append(len(ids))
            return byte_decode(ids)

        for _ in range(20):
            prompt = [rng.choice(range(97, 123)) for _ in range(rng.randint(1, 30))]
            new = [
                rng.choice([*range(32, 127), 256, 257, 258, 0xC3, 0xA9, 0x99, 0x82])
                for _ in range(600)
            ]
            joined = "".join(pieces_of(module, prompt, new, counting))
            whole = byte_decode(new)  # prompts of ASCII: the answer's text is its own decode
            assert whole.startswith(joined) and len(whole) - len(joined) <= 4  # a last char
        assert max(lengths) <= module.CONTEXT_TOKENS + 8  # the longest wait for a character


@pytest.mark.integration
@pytest.mark.slow  # SmolLM2's tokenizer comes from its weights, built on a cold cache
def test_smollm2s_tokenizer_streams_pieces_that_join_to_its_whole_decode():
    """Accents, CJK and emoji split across byte tokens, after prompts of every kind: the
    pieces and the final rest join to ``protocol.completion``, as the non-streaming answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(repository.build_weights("smollm2"))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    texts = [
        "Once upon a time",
        " café au lait",
        "東京は日本の首都です。",
        "ok 🙂👍🏽 done",
        "a\n\n  b",
    ]
    with (
        imported_as_triton_does(TEMPLATE, "detokenize") as module,
        imported_as_triton_does(TEMPLATE, "protocol") as protocol,
    ):
        for prompt_text in texts:
            for answer_text in texts:
                prompt = tokenizer(prompt_text)["input_ids"]
                new = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
                new = [*new, tokenizer.eos_token_id, *new]  # a special token is skipped
                joined = "".join(pieces_of(module, prompt, new, decode))
                whole = protocol.completion(tokenizer, prompt, new)
                assert whole.startswith(joined) and len(whole) - len(joined) <= 2, (
                    prompt_text,
                    answer_text,
                )


# -- against a real Triton ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repo = tmp_path_factory.mktemp("stream") / "repository"
    repo.mkdir()
    repository.add_model(repo, "tiny-falcon", name="tf", max_tokens=12)
    repository.add_model(repo, "tiny-falcon", name="tf_stream", max_tokens=12, decoupled=True)
    repository.add_model(repo, "tiny-falcon", name="idle_stream", decoupled=True)
    repository.add_model(
        repo,
        "tiny-falcon",
        name="tfb_stream",
        max_tokens=12,
        decoupled=True,
        max_batch_size=len(PROMPTS),  # a full batch is dispatched at once
        dynamic_batching=True,
        max_queue_delay_microseconds=JOIN_DELAY_MICROSECONDS,
    )
    for name in ("smollm2", "smollm2_stream"):
        shutil.copytree(
            ROOT / "model_repository" / name,
            repo / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("weights", "__pycache__"),
        )
    repository.prepare_repository(repo)
    return start_module_server(repo, load_models=["tf", "tfb_stream", "smollm2", "smollm2_stream"])


def url(server, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


@pytest.fixture(scope="module")
def tf_stream(server):
    """``tf``'s streaming twin, loaded the way notebook 01 loads ``smollm2_stream``."""
    assert serve_streaming_twin(server, "tf") == "tf_stream"
    states = {m["name"]: m.get("state") for m in server.model_index()}
    assert states["tf_stream"] == "READY"
    return "tf_stream"


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_smollm2_streams_token_by_token_to_the_generate_answer(server, protocol, capsys):
    expected = client.generate(server.http_url, "smollm2", "I am going").text
    stats = streaming.measure(url(server, protocol), "smollm2_stream", "I am going", protocol)
    assert stats.text == expected and expected.startswith("I am going to")
    assert len(stats.pieces) > 1 and stats.tokens == 16  # the config's max_tokens, no EOS here
    assert 0 < stats.ttft_s < stats.total_s and stats.tokens_per_s > 0
    with capsys.disabled():
        print(f"\nsmollm2 over {protocol}: {stats} {stats.as_dict()}")


@pytest.mark.integration
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tiny_falcon_stream_joins_to_the_generate_answer_for_every_prompt(
    server, tf_stream, protocol, full
):
    for prompt in PROMPTS:
        expected = client.generate(server.http_url, "tf", prompt, return_full_text=full).text
        pieces = list(
            streaming.stream(
                url(server, protocol), tf_stream, prompt, protocol, return_full_text=full
            )
        )
        assert "".join(pieces) == expected, prompt
        assert len(pieces) > 1
        if full:
            assert pieces[0].startswith(prompt)


@pytest.mark.integration
def test_concurrent_streams_are_batched_and_each_gets_its_own_answer(server):
    expected = {p: client.generate(server.http_url, "tf", p, max_tokens=8).text for p in PROMPTS}

    def one(prompt):
        return prompt, "".join(
            streaming.stream(server.grpc_url, "tfb_stream", prompt, "grpc", max_tokens=8)
        )

    got, counts = sent_together(server, "tfb_stream", one, PROMPTS)
    assert dict(got) == expected
    # the four streams, released together, were generated by one call of the model
    assert counts["request_success"] == len(PROMPTS)
    assert counts["execution_count"] == 1, f"not one batch: {counts}"


@pytest.mark.integration
def test_streams_asking_different_max_tokens_share_a_batch_and_each_stops_at_its_own(server):
    jobs = [(p, 3 + 3 * i) for i, p in enumerate(PROMPTS)]  # 3, 6, 9, 12 new tokens
    expected = {p: client.generate(server.http_url, "tf", p, max_tokens=n).text for p, n in jobs}

    def one(job):
        prompt, max_tokens = job
        pieces = streaming.stream(
            server.grpc_url, "tfb_stream", prompt, "grpc", max_tokens=max_tokens
        )
        return prompt, "".join(pieces)

    got, counts = sent_together(server, "tfb_stream", one, jobs)
    assert dict(got) == expected  # each answer is the answer alone at its own length
    assert counts["execution_count"] == 1, f"not one batch: {counts}"


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bad_request_on_a_stream_is_a_clear_error_and_the_next_stream_works(
    server, tf_stream, protocol
):
    address = url(server, protocol)
    with pytest.raises(InferenceError, match="prompt 0 of 'text_input' is empty") as empty:
        list(streaming.stream(address, tf_stream, "   ", protocol))
    assert empty.value.status == (400 if protocol == "http" else "in stream")
    with pytest.raises(InferenceError, match=r"parameter 'max_tokens' must be >= 1, got 0"):
        list(streaming.stream(address, tf_stream, "Hi", protocol, max_tokens=0))
    with pytest.raises(InferenceError, match=r"unknown parameter\(s\) 'colour'"):
        list(streaming.stream(address, tf_stream, "Hi", protocol, colour="red"))
    expected = client.generate(server.http_url, "tf", "Hi").text
    assert "".join(streaming.stream(address, tf_stream, "Hi", protocol)) == expected


@pytest.mark.integration
def test_a_stream_left_early_stops_its_generation_and_the_next_one_works(server):
    stopped = "smollm2_stream: 1 request(s) cancelled by their clients; generation stopped"

    def times_stopped() -> int:
        return Path(server.log_path).read_text().count(stopped)

    for protocol in ("http", "grpc"):
        before = times_stopped()
        pieces = streaming.stream(
            url(server, protocol), "smollm2_stream", "Tell me a story", protocol, max_tokens=400
        )
        assert next(pieces).startswith("Tell me a story")
        pieces.close()  # HTTP: the connection closes; gRPC: the stream is cancelled
        # the model logs this line only when it stops a generation its client left
        wait_for(lambda n=before: times_stopped() > n, 30, f"{protocol}: the generation stopping")
    expected = client.generate(server.http_url, "smollm2", "Hi", max_tokens=4).text
    assert "".join(
        streaming.stream(server.grpc_url, "smollm2_stream", "Hi", "grpc", max_tokens=4)
    ) == (expected)


@pytest.mark.integration
def test_the_printed_curl_line_streams_server_sent_events(server, tf_stream):
    line = client.curl_command(server.http_url, tf_stream, "I am going", endpoint="generate_stream")
    assert line.startswith("curl -N -X POST ")
    run = subprocess.run([*shlex.split(line), "-s"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    events = [json.loads(x[5:]) for x in run.stdout.splitlines() if x.startswith("data:")]
    assert len(events) > 2
    assert (
        "".join(e["text_output"] for e in events)
        == client.generate(server.http_url, "tf", "I am going").text
    )


@pytest.mark.integration
def test_an_unloaded_model_and_an_unreachable_server_are_named(server):
    with pytest.raises(InferenceError, match="idle_stream"):
        list(streaming.stream(server.http_url, "idle_stream", "Hi"))
    with pytest.raises(InferenceError, match="idle_stream"):
        list(streaming.stream(server.grpc_url, "idle_stream", "Hi", "grpc", batched=False))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: connections refused
        for protocol in ("http", "grpc"):
            with pytest.raises(InferenceError, match=f"cannot reach Triton at '{dead}'"):
                list(streaming.stream(dead, "tf_stream", "Hi", protocol, batched=False))


@pytest.mark.integration
def test_a_remote_server_without_a_twin_gets_none_and_decoupled_is_read_from_the_server(server):
    assert serve_streaming_twin(server, "smollm2") == "smollm2_stream"
    # a local server gets a missing twin written (labkit.streaming); a remote one cannot
    remote = TritonServer(url=f"http://{server.http_url}")
    assert serve_streaming_twin(remote, "tfb_stream") is None
    assert "tfb_stream_stream" not in {m["name"] for m in server.model_index()}
    assert streaming.is_streaming(server.http_url, "smollm2_stream") is True
    assert streaming.is_streaming(server.http_url, "smollm2") is False
    assert streaming.is_streaming(server.http_url, "no_such_model") is None


# -- the prompt widget, headless, against the same server ---------------------------------------
@pytest.mark.integration
def test_the_widget_streams_a_decoupled_model_into_its_output_piece_by_piece(server, tf_stream):
    ui = prompt_ui(server, model=tf_stream, max_tokens=12)
    seen: list[str] = []
    ui.output.observe(lambda change: seen.append(change["new"]), names="value")
    ui.prompt.value = "Once upon a time there was"
    ui.button.click()
    expected = client.generate(server.http_url, "tf", "Once upon a time there was").text
    assert ui.output.value == expected
    assert len([s for s in seen if s]) > 2 and all(expected.startswith(s) for s in seen)
    assert ui.error.startswith("done in") and "first text after" in ui.error
    ui.model.value = "tf"  # a plain model in the same widget: one piece, the whole answer
    ui.button.click()
    assert ui.output.value == expected and "first text" not in ui.error


@pytest.mark.integration
def test_the_widget_shows_a_refused_parameter_and_an_unloaded_model_as_messages(server, tf_stream):
    ui = prompt_ui(server, model=tf_stream)
    ui.prompt.value = "Hi"
    ui.max_tokens.value = 1000  # beyond tiny Falcon's 256-token context
    ui.button.click()
    assert "exceeds the model's context of 256 tokens" in ui.error
    assert "Traceback" not in ui.status.value and not ui.button.disabled
    ui.model.value = "idle_stream"
    ui.max_tokens.value = 8
    ui.button.click()
    assert "model 'idle_stream' is " in ui.error
    assert "load it with server.load_model('idle_stream')" in ui.error
