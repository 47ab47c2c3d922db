"""In-flight batching (``inflight.py``) against a real Triton: answers, streams, cancellation,
the queue bound, bad input, a killed stub, and a crashed engine.

One module-scoped server holds the committed ``smollm2`` and ``smollm2_inflight`` folders (the
real LLM: greedy answers under concurrency must equal the answer alone) and small in-flight
models on a random 2-layer Llama with SmolLM2's tokenizer (transformers' engine runs Llama-style
models; the lab's tiny Falcon is not one of them): ``tl`` (plain, the reference), ``tli``
(4 slots, a queue of 2), ``tlq`` (1 slot, a queue of 1), ``tlk`` (a KV cache of 64 tokens) and
``tlr`` (its stub gets killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import imported_as_triton_does, wait_for
from labkit import client, repository, streaming
from labkit.errors import ConfigError, InferenceError, ServerError
from labkit.repository import textgen
from labkit.server import TritonServer, recover, stubs, unhealthy

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "labkit" / "templates" / "textgen"
REPOSITORY = ROOT / "model_repository"
PROMPTS = ["I am going", "Where is the nearest", "Once upon a time there was", "Hi"]


def build_tiny_llama(target: Path) -> Path:
    """A seeded random 2-layer, 64-wide LlamaForCausalLM with SmolLM2's tokenizer (16 MB)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(repository.build_weights("smollm2"))
    tokenizer.model_max_length = 256
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.5,  # confident random logits: greedy answers are stable
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "weights")


def add_tiny(repo: Path, weights: Path, name: str, **options) -> None:
    entry = repository.CatalogEntry("tiny-llama", str(weights), "random 2-layer Llama", 0.003)
    config = repository.textgen_config(entry, name, max_tokens=12, **options)
    repository.Repository(repo).add_from_template(name, "textgen", config)


INFLIGHT = {"decoupled": True, "inflight_batching": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    repo = tmp_path_factory.mktemp("inflight") / "repository"
    repo.mkdir()
    add_tiny(repo, tiny_llama, "tl")
    add_tiny(repo, tiny_llama, "tli", max_running_requests=4, max_queue_size=2, **INFLIGHT)
    add_tiny(repo, tiny_llama, "tlq", max_running_requests=1, max_queue_size=1, **INFLIGHT)
    add_tiny(repo, tiny_llama, "tlk", kv_page_size=16, kv_blocks=4, **INFLIGHT)
    add_tiny(repo, tiny_llama, "tlr", **INFLIGHT)
    add_tiny(repo, tiny_llama, "tlx", inflight_batching=True)  # not decoupled: refused
    for name in ("smollm2", "smollm2_inflight"):
        shutil.copytree(
            REPOSITORY / name,
            repo / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("weights", "__pycache__"),
        )
    repository.prepare_repository(repo)
    triton = TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        load_models=["tl", "tli", "tlq", "tlk", "tlr", "smollm2", "smollm2_inflight"],
        startup_timeout_s=300,
        log_path=repo.parent / "tritonserver.log",
    )
    try:
        yield triton.start()
    finally:
        triton.stop()


def post(server, model: str, body: dict, endpoint: str = "generate") -> tuple[int, str]:
    """``(HTTP status, error text or output text)`` of one request."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    parsed = events or [json.loads(text)]
    if any("error" in e for e in parsed):
        return status, next(e["error"] for e in parsed if "error" in e)
    return status, json.dumps([e.get("text_output") for e in parsed])


def grpc_stream(server, model: str, prompt: str, cancel_after: int | None = None, **params):
    """The text pieces of a gRPC stream; with ``cancel_after``, cancel it after that many."""
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    arrived: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: arrived.put((result, error)))
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    grpc.async_stream_infer(model, [tensor], parameters=params, enable_empty_final_response=True)
    pieces: list[str] = []
    final = False
    try:
        while cancel_after is None or len(pieces) < cancel_after:
            result, error = arrived.get(timeout=120)
            if error is not None:
                raise InferenceError(error.message())
            output = result.as_numpy("text_output")
            if output is not None:
                pieces.append(output.reshape(-1)[0].decode())
            final = result.get_response().parameters["triton_final_response"].bool_param
            if final:
                break
    finally:
        grpc.stop_stream(cancel_requests=not final)  # as labkit.streaming: see its comment
        grpc.close()
    return pieces


def server_log(server, since: int = 0) -> str:
    """The server's log from character ``since`` on (``len(server_log(server))``: from now)."""
    return Path(server.log_path).read_text()[since:]


def log_count(server, text: str) -> int:
    return server_log(server).count(text)


# -- the committed model folder and the engine's settings (no server) ---------------------------
def test_the_inflight_model_is_smollm2s_code_and_weights_with_an_engine():
    folder, code = REPOSITORY / "smollm2_inflight" / "1", REPOSITORY / "smollm2" / "1"
    for path in code.glob("*.py"):
        assert os.readlink(folder / path.name) == f"../../smollm2/1/{path.name}"
    plain = repository.read_config(REPOSITORY / "smollm2" / "config.pbtxt")
    served = repository.read_config(REPOSITORY / "smollm2_inflight" / "config.pbtxt")
    assert served.model_transaction_policy.decoupled and served.max_batch_size == 0
    extra = {k: v.string_value for k, v in served.parameters.items() if k not in plain.parameters}
    assert extra == {"inflight_batching": "true"} | {
        name: str(value) for name, value in textgen.ENGINE_LIMITS.items()
    }
    assert all(served.parameters[k] == v for k, v in plain.parameters.items())


def test_labkit_reads_the_engine_settings_from_the_model_folder_into_transformers_own_config():
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    served = REPOSITORY / "smollm2" / "1" / "engine_settings.py"
    assert textgen.SETTINGS_FILE.resolve() == served.resolve()
    entry = repository.CatalogEntry("tiny-llama", "weights", "random 2-layer Llama", 0.003)
    config = repository.textgen_config(entry, "tlb", inflight_batching=True, kv_blocks=12)
    limits = textgen.engine_limits(config)
    assert limits == textgen.ENGINE_LIMITS | {"kv_blocks": 12}
    engine = ContinuousBatchingConfig(**textgen.engine_config(limits))
    assert (engine.num_blocks, engine.page_size, engine.max_requests_per_batch) == (12, 16, 16)
    config.parameters["kv_blocks"].string_value = "0"
    with pytest.raises(ConfigError, match="model 'tlb': parameter 'kv_blocks' must be >= 1, got 0"):
        textgen.engine_limits(config)


def read_options(protocol, decoupled: bool = True, **params: str):
    """What the model reads from a config with ``params`` (Triton's JSON form of the config)."""
    config = {
        "name": "m",
        "parameters": {"huggingface_model": {"string_value": "weights"}}
        | {key: {"string_value": value} for key, value in params.items()},
        "model_transaction_policy": {"decoupled": decoupled},
    }
    return protocol.read_options(config)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"kv_blocks": "0"}, "parameter 'kv_blocks' must be >= 1, got 0"),
        ({"max_running_requests": "many"}, "'max_running_requests' must be an integer"),
        ({"kv_page_size": "2"}, "'kv_page_size' must be >= 4"),
        ({"max_queue_size": "-1"}, "'max_queue_size' must be >= 0"),
        ({"inflight_batching": "yes"}, "'inflight_batching' must be true or false"),
    ],
)
def test_a_bad_engine_limit_is_a_config_error_that_names_it(params, message):
    with (
        imported_as_triton_does(TEMPLATE, "protocol") as protocol,
        pytest.raises(protocol.ConfigError, match=message),
    ):
        read_options(protocol, **({"inflight_batching": "true"} | params))


def test_inflight_batching_without_a_decoupled_model_is_a_config_error_with_the_fix():
    with imported_as_triton_does(TEMPLATE, "protocol") as protocol:
        with pytest.raises(protocol.ConfigError, match="add model_transaction_policy"):
            read_options(protocol, decoupled=False, inflight_batching="true")
        limits = read_options(protocol, inflight_batching="true", kv_blocks="12").inflight
        assert limits.kv_tokens == 12 * limits.kv_page_size
        assert read_options(protocol, inflight_batching="false", kv_blocks="0").inflight is None


@pytest.mark.integration
def test_labkit_reads_the_limits_that_the_served_engines_run_with(server):
    folder = repository.Repository(server.model_repository)
    for name in ("tli", "tlq", "tlk", "smollm2_inflight"):
        limits = textgen.engine_limits(folder.config(name))
        said = ", ".join(f"{key}={value}" for key, value in limits.items())
        (loaded,) = [line for line in server_log(server).splitlines() if f"{name}: loaded " in line]
        assert f"in-flight batching, Limits({said})" in loaded  # what the model logged


# -- answers ---------------------------------------------------------------------------------------
@pytest.mark.integration
def test_smollm2_greedy_answers_under_concurrency_equal_the_answer_alone(server):
    lengths = [4, 8, 5, 7, 4, 6, 8, 5]
    cases = [(PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(lengths)]
    alone = [client.generate(server.http_url, "smollm2", p, max_tokens=n).text for p, n in cases]

    def served(index: int) -> str:
        prompt, n = cases[index]
        if index % 2:  # half of the clients stream, half wait for the whole answer
            return "".join(
                streaming.stream(
                    server.http_url, "smollm2_inflight", prompt, max_tokens=n, stream=True
                )
            )
        return client.generate(server.http_url, "smollm2_inflight", prompt, max_tokens=n).text

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(served, range(len(cases))))
    assert got == alone
    assert alone[1].startswith("Where is the nearest")


@pytest.mark.integration
@pytest.mark.parametrize("full", [True, False])
def test_streamed_pieces_over_http_and_grpc_join_to_the_whole_answer(server, full):
    for prompt in PROMPTS:
        expected = client.generate(server.http_url, "tl", prompt, return_full_text=full).text
        params = {"return_full_text": full}
        whole = client.generate(server.http_url, "tli", prompt, **params)
        assert whole.text == expected
        sse = list(streaming.stream(server.http_url, "tli", prompt, **params))  # asks to stream
        assert "".join(sse) == expected and len(sse) > 1
        rpc = list(streaming.stream(server.grpc_url, "tli", prompt, "grpc", **params))
        assert "".join(rpc) == expected and len(rpc) > 1
        pieces = grpc_stream(server, "tli", prompt, stream=True, **params)
        assert "".join(pieces) == expected and len(pieces) > 2
        assert grpc_stream(server, "tli", prompt, **params) == [expected]  # not asked to stream


@pytest.mark.integration
def test_a_request_of_several_prompts_and_sampling_settings_get_the_plain_models_answers(server):
    body = {"text_input": ["I am going", "Hi"], "max_tokens": 6}
    assert post(server, "tli", body) == post(server, "tl", body)
    sampled = {"text_input": "Hi", "temperature": 0.9, "top_k": 20, "seed": 7}
    assert post(server, "tli", sampled) == post(server, "tl", sampled)
    penalised = {"text_input": "Hi", "repetition_penalty": 1.3, "stream": True}
    assert post(server, "tli", penalised, "generate_stream")[1].startswith('["Hi')


@pytest.mark.integration
def test_a_sampling_request_leaves_the_other_streams_going_and_gets_the_plain_models_answer(
    server,
):
    """On the real LLM: a greedy count streams on while a request that samples is answered in
    the side lane (events in arrival order: greedy pieces arrive between the sampled stream's
    first and last), and the sampled answer is the plain model's for the same seed."""
    sampled = {"max_tokens": 24, "temperature": 0.9, "top_k": 20, "seed": 7}
    expected = client.generate(server.http_url, "smollm2", "Hi", **sampled).text
    events: queue.Queue = queue.Queue()
    counting = streaming.stream(
        server.http_url, "smollm2_inflight", "1, 2, 3, 4, 5,", max_tokens=250, stream=True
    )
    next(counting)  # the greedy count is running
    done = threading.Event()

    def count() -> None:
        for _ in counting:
            events.put("greedy")
            if done.is_set():
                break
        counting.close()  # the count is cancelled mid-answer

    reader = threading.Thread(target=count, daemon=True)
    reader.start()
    try:
        pieces = []
        for piece in streaming.stream(
            server.http_url, "smollm2_inflight", "Hi", stream=True, **sampled
        ):
            pieces.append(piece)
            events.put("sampled")
    finally:
        done.set()
        reader.join(60)
    assert not reader.is_alive()
    assert "".join(pieces) == expected
    order = list(events.queue)
    first, last = order.index("sampled"), len(order) - 1 - order[::-1].index("sampled")
    assert "greedy" in order[first:last], order


# -- cancellation and the queue bound ----------------------------------------------------------------
@pytest.mark.integration
def test_cancelling_half_the_streams_frees_their_slots_and_leaves_the_others_unchanged(server):
    long = {"max_tokens": 200, "stream": True}
    survivors, latecomers = ["Tell me a story", "Once upon"], ["Hi", "I am going"]
    expected = {
        p: client.generate(server.http_url, "tl", p, max_tokens=200).text for p in survivors
    }
    short = {p: client.generate(server.http_url, "tl", p, max_tokens=4).text for p in latecomers}
    start = len(server_log(server))

    def full(prompt: str, **params) -> str:
        return "".join(streaming.stream(server.http_url, "tli", prompt, **params))

    def leave_http(prompt: str) -> None:
        pieces = streaming.stream(server.http_url, "tli", prompt, **long)
        next(pieces), next(pieces)
        pieces.close()  # the connection closes mid-answer

    def cancellations() -> list[tuple[int, int]]:
        """``(requests cancelled, slots still taken)`` of each line the engine logged."""
        found = re.findall(
            r"tli: (\d+) request\(s\) cancelled by their clients; their slots are free \((\d+)/4 ",
            server_log(server, start),
        )
        return [(int(gone), int(taken)) for gone, taken in found]

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(full, p, **long) for p in survivors]  # with the two below: 4 slots
        pool.submit(leave_http, "Where is").result()
        pool.submit(grpc_stream, server, "tli", "The weather", 2, **long).result()
        wait_for(lambda: sum(n for n, _ in cancellations()) == 2, 30, "the two cancellations")
        late = [pool.submit(full, p, max_tokens=4, stream=True) for p in latecomers]
        answers = [f.result() for f in running]
        answered = [f.result() for f in late]
    assert dict(zip(survivors, answers, strict=True)) == expected
    assert dict(zip(latecomers, answered, strict=True)) == short
    # The engine's own record: the cancelled requests gave back their slots (at most the two
    # survivors held one afterwards), and no latecomer had to wait for a slot.
    assert cancellations()[-1][1] <= 2
    assert "tli: a request waits" not in server_log(server, start)


@pytest.mark.integration
def test_a_request_past_the_queue_bound_is_refused_at_once_as_busy(server):
    def ask(prompt: str) -> object:
        try:
            return client.generate(server.http_url, "tlq", prompt, max_tokens=8)
        except InferenceError as exc:
            return exc

    start, queued = len(server_log(server)), "tlq: a request waits for room"
    running = streaming.stream(server.http_url, "tlq", "Once upon", max_tokens=240, stream=True)
    next(running)  # the one slot is taken
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ask, "Hi")
        wait_for(lambda: queued in server_log(server, start), 30, "the first request to queue")
        busy = ask("Hello")  # the queue (max_queue_size=1) is full
        rest = "".join(running)
        answered = first.result()
    assert rest and answered.text.startswith("Hi")  # the first waited, then had its turn
    assert isinstance(busy, InferenceError) and busy.status == 400  # Triton 2.51's /generate
    said = str(busy)
    assert "busy: 1 prompts" in said and "1 requests are waiting" in said
    assert "(max_queue_size=1)" in said and "retry later" in said
    # Refused at once: the engine never queued it (one request waited, not two).
    assert server_log(server, start).count(queued) == 1
    assert client.generate(server.http_url, "tlq", "Hi").text.startswith("Hi")


# -- bad input ----------------------------------------------------------------------------------------
BAD_INPUTS = {
    "empty": {"text_input": "   "},
    "nul-byte": {"text_input": "a\x00b"},
    "max-tokens-zero": {"text_input": "Hi", "max_tokens": 0},
    "max-tokens-text": {"text_input": "Hi", "max_tokens": "8"},
    "max-tokens-past-context": {"text_input": "Hi", "max_tokens": 10_000},
    "unknown-parameter": {"text_input": "Hi", "colour": "red"},
    "negative-temperature": {"text_input": "Hi", "temperature": -1},
    "top-p-zero": {"text_input": "Hi", "top_p": 0},
    "stream-not-bool": {"text_input": "Hi", "stream": "yes"},
    "no-input": {"max_tokens": 4},
}


@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_the_plain_models_400_error(server, case, endpoint):
    status, message = post(server, "tl", BAD_INPUTS[case])
    assert status == 400
    assert post(server, "tli", BAD_INPUTS[case], endpoint) == (
        400,
        message.replace("'tl'", "'tli'"),
    )


@pytest.mark.integration
def test_a_request_the_engine_can_never_hold_is_refused_naming_the_limit(server):
    status, text = post(server, "tlk", {"text_input": "Hi", "max_tokens": 100})
    assert status == 400 and "kv_blocks=4 (64 tokens)" in text and "lower max_tokens" in text
    status, text = post(server, "tli", {"text_input": ["a", "b", "c", "d", "e"]})
    assert status == 400 and "holds 5 prompts" in text and "max_running_requests=4" in text
    assert post(server, "tlk", {"text_input": "Hi", "max_tokens": 40})[0] == 200


@pytest.mark.integration
def test_an_inflight_model_that_is_not_decoupled_is_refused_with_the_fix(server):
    with pytest.raises(ServerError, match=r"inflight_batching needs a decoupled model"):
        server.load_model("tlx")


# -- faults -----------------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_killed_stub_is_unhealthy_and_recover_reloads_it_then_unload_stops_the_engine(server):
    assert client.generate(server.http_url, "tlr", "Hi").text
    (victim,) = stubs(server)["tlr"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: "tlr" in unhealthy(server), 30, "the dead stub to show")
    assert unhealthy(server) == {"tlr": "0 of 1 Python stub processes alive"}
    with pytest.raises(InferenceError, match="Stub process 'tlr_0' is not healthy"):
        client.generate(server.http_url, "tlr", "Hi")
    assert recover(server) == ["tlr"]
    wait_for(lambda: stubs(server).get("tlr", [victim]) != [victim], 60, "a new stub")
    assert client.generate(server.http_url, "tlr", "Hi").text.startswith("Hi")
    assert unhealthy(server) == {}
    # Answers streamed whole over gRPC leave nothing behind: cancelling a stream after its final
    # response once kept Triton from ever unloading the model (labkit.streaming).
    for prompt in PROMPTS * 6:
        assert "".join(streaming.stream(server.grpc_url, "tlr", prompt, "grpc"))
    server.unload_model("tlr")  # finalize stops the engine thread, which says so
    wait_for(lambda: log_count(server, "tlr: in-flight engine stopped"), 30, "the engine's stop")


class FakeSender:
    """A response sender: what the engine sent, and whether the client has gone."""

    def __init__(self) -> None:
        self.responses: list[tuple[object, int]] = []
        self.final = threading.Event()

    def send(self, response, flags: int = 0) -> None:
        self.responses.append((response, flags))
        if flags:
            self.final.set()

    def is_cancelled(self) -> bool:
        return False


class FakeError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = (
        "INTERNAL",
        "INVALID_ARG",
        "UNAVAILABLE",
        "CANCELLED",
    )

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class FakeResponse:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.output_tensors, self.error = output_tensors, error


class FakeLogger:
    lines: list[str] = []
    log_info = log_warn = log_error = staticmethod(lambda text: FakeLogger.lines.append(text))


@contextlib.contextmanager
def inflight_in_process(monkeypatch):
    """``inflight.py`` imported as Triton does, with stand-ins for the stub's response classes
    (C++ in a real stub)."""
    with imported_as_triton_does(TEMPLATE, "inflight") as inflight:
        for name, fake in (
            ("TritonError", FakeError),
            ("InferenceResponse", FakeResponse),
            ("Tensor", lambda name, array: (name, array)),
            ("Logger", FakeLogger),
        ):
            monkeypatch.setattr(inflight.pb_utils, name, fake, raising=False)
        yield inflight


def test_a_crashed_engine_fails_its_requests_refuses_new_ones_and_ends_the_stub_in_process(
    tiny_llama, monkeypatch
):
    """In-process, because the crash is provoked inside the engine's forward pass: the stub's
    response classes (C++ in a real stub) are stand-ins; the engine is transformers' own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with inflight_in_process(monkeypatch) as inflight:
        ended = threading.Event()
        engine = inflight.InflightEngine(
            model,
            tokenizer,
            limits=inflight.Limits(max_running_requests=4),
            eos_ids={tokenizer.eos_token_id},
            max_tokens=16,
            decode=lambda prompt, new: tokenizer.decode(new),
            decode_ids=tokenizer.decode,
            run_alone=lambda sender, prompts, model: None,
            name="crashy",
            on_crash=ended.set,
        )
        engine.start(tokenizer("Hello")["input_ids"])

        def prompts(text: str):
            settings = inflight.Settings(max_tokens=100)
            ids = [tokenizer(text)["input_ids"]]
            return inflight.Prompts((1,), [text], ids, settings, False, True)

        senders = [FakeSender(), FakeSender()]
        engine.submit(senders[0], prompts("Once upon a time"))
        calls = {"n": 0}
        forward = model.forward

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] >= 3:
                raise RuntimeError("injected fault in the forward pass")
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", failing)
        engine.submit(senders[1], prompts("Hi"))
        assert ended.wait(60), "the engine's crash was not handled"
        for sender in senders:
            response, flags = sender.responses[-1]
            assert flags == inflight.FINAL and response.error.code == "INTERNAL"
            assert "injected fault" in response.error.message
        late = FakeSender()
        engine.submit(late, prompts("Hi"))
        ((refusal, _),) = late.responses
        assert refusal.error.code == "UNAVAILABLE" and "must be reloaded" in refusal.error.message
        assert any("ending this stub" in line for line in FakeLogger.lines)
        engine.stop(timeout_s=10)  # stopping a dead engine is harmless


def test_a_request_that_samples_runs_beside_the_engine_whose_streams_go_on_in_process(
    tiny_llama, monkeypatch
):
    """The side lane: while ``generate`` answers a request that samples, the engine keeps making
    the other requests' tokens (it used to pause). Here the side lane's ``run_alone`` waits until
    a greedy stream has had 3 more pieces: with a paused engine it would wait in vain. The model
    is eager: the engine runs it as "paged|eager", so ``generate`` gets a twin on the same
    weight tensors, whose answer is the model's own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = tokenizer("Once upon a time", return_tensors="pt")
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        before = model.generate(**ids, generation_config=config).tolist()
    with inflight_in_process(monkeypatch) as inflight:
        greedy, sampled = FakeSender(), FakeSender()
        beside: dict[str, object] = {}

        def run_alone(sender, prompts, twin) -> None:
            start = len(greedy.responses)
            deadline = time.monotonic() + 60
            while len(greedy.responses) < start + 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            beside["pieces"] = len(greedy.responses) - start
            beside["attention"] = twin.config._attn_implementation
            with torch.inference_mode():
                beside["answer"] = twin.generate(**ids, generation_config=config).tolist()
            sender.send(FakeResponse(), flags=inflight.FINAL)

        engine = inflight.InflightEngine(
            model,
            tokenizer,
            limits=inflight.Limits(max_running_requests=4),
            eos_ids=set(),  # the greedy stream runs to its max_tokens
            max_tokens=400,
            decode=lambda prompt, new: tokenizer.decode(new),
            decode_ids=tokenizer.decode,
            run_alone=run_alone,
            name="beside",
        )
        twin = engine.side_model
        assert twin is not model
        shared = {t.data_ptr() for t in model.parameters()}
        assert shared and {t.data_ptr() for t in twin.parameters()} == shared  # no copy
        engine.start(tokenizer("Hello")["input_ids"])
        try:
            assert model.config._attn_implementation == "paged|eager"  # the engine's own

            def prompts(settings):
                text = "Once upon a time"
                return inflight.Prompts(
                    (1,), [text], [tokenizer(text)["input_ids"]], settings, False, True
                )

            engine.submit(greedy, prompts(inflight.Settings(max_tokens=400)))
            wait_for(lambda: greedy.responses, 60, "the greedy stream's first piece")
            engine.submit(sampled, prompts(inflight.Settings(max_tokens=8, temperature=0.9)))
            assert sampled.final.wait(120), "the side lane did not answer"
            assert beside["pieces"] >= 3  # the stream went on beside it
            assert beside["attention"] == "eager" and beside["answer"] == before
            assert not greedy.final.is_set()  # still generating: it was never paused
        finally:
            engine.stop(timeout_s=30)
