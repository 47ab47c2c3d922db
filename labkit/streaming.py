"""Token streaming from a decoupled text-generation model: pieces as they arrive, and timings.

A model whose config says ``model_transaction_policy { decoupled: true }`` (the lab's
``smollm2_stream``: the same ``model.py`` and weights as ``smollm2``) answers a request with one
response per generated token and a closing one. Triton serves it two ways, both here:

- HTTP: ``POST /v2/models/<model>/generate_stream`` with the same JSON as ``/generate``; the
  answer is server-sent events (``data: {...}`` lines), one per response;
- gRPC: a bidirectional stream (``tritonclient.grpc`` ``start_stream`` / ``async_stream_infer``).

>>> for piece in stream(server.http_url, "smollm2_stream", "I am going"):
...     print(piece, end="", flush=True)
>>> measure(server.grpc_url, "smollm2_stream", "I am going", protocol="grpc")
StreamStats(16 tokens, first after 0.21 s, 9.8 tokens/s after it, 1.74 s in all)

Errors are :class:`labkit.errors.InferenceError` with the server's own reason, as in
:mod:`labkit.client`; a request the model refuses ends its stream, and the next one works.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from httpx_sse import SSEError, connect_sse
from tritonclient.utils import InferenceServerException

from labkit.client import (
    INPUT_NAME,
    OUTPUT_NAME,
    _client,
    _refused,
    _unreachable,
    model_batches,
    server_address,
)
from labkit.errors import ConfigError, InferenceError

log = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")
#: The name notebooks give the streaming twin of a model folder.


@dataclass(frozen=True)
class Response:
    """One response of a stream: its text piece (may be empty) and when it arrived."""

    text: str
    arrived_s: float  # seconds since the request was sent
    final: bool = False  # known over gRPC; over HTTP the last event is the final one


def _timed_out(url: str, model: str, timeout_s: float) -> InferenceError:
    error = InferenceError(
        f"model {model!r} at {url!r} sent nothing for {timeout_s:g} s; the server may be "
        "overloaded or the generation too long: pass a larger timeout_s or a smaller max_tokens"
    )
    error.status = None
    error.server_message = ""
    return error


def _sse_error(body: str) -> str:
    """The ``error`` text of an SSE or JSON error body (Triton sends ``data: {"error": ...}``)."""
    text = body.strip()
    if text.startswith("data:"):
        text = text[len("data:") :].strip()
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return body.strip()


def _pool_exhausted(url: str, model: str, timeout_s: float) -> InferenceError:
    error = InferenceError(
        f"no stream to model {model!r} at {url!r} was sent: for {timeout_s:g} s all "
        f"{STREAM_CONNECTIONS} connections of this process's HTTP streaming client were held by "
        "other streams (the server was not asked yet); stream fewer at once from one process, "
        "finish or close the streams left open, or stream over gRPC (protocol='grpc')"
    )
    error.status = None
    error.server_message = ""
    return error


def _not_events(url: str, model: str, exc: Exception) -> InferenceError:
    error = InferenceError(
        f"the answer of {url!r} to a stream of model {model!r} is not Triton's server-sent "
        f"events ({exc}); is {url!r} a Triton server's HTTP address?"
    )
    error.status = None
    error.server_message = str(exc)
    return error


#: Streams of one process open at once over HTTP: httpx's own default pool limit, named. A
#: stream past it waits for one to end, for at most its ``timeout_s``.
STREAM_CONNECTIONS = 100
_SESSION: httpx.Client | None = None
_SESSION_LOCK = threading.Lock()


def _session() -> httpx.Client:
    """The HTTP client every stream shares (one per process: making one costs 20-30 ms of CPU, its
    TLS context, on this lab's two cores). Each request brings its own timeout."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            limits = httpx.Limits(max_connections=STREAM_CONNECTIONS, max_keepalive_connections=20)
            _SESSION = httpx.Client(limits=limits)  # httpx's defaults, the pool's size named
        return _SESSION


def _http_responses(
    url: str, model: str, prompt: str, timeout_s: float, params: dict[str, Any]
) -> Iterator[Response]:
    """The server-sent events of ``/generate_stream``, read by httpx-sse. ``timeout_s`` bounds
    the connection and each wait for data; a body cut off before its closing chunk (the server
    went away) is an error, not a short answer."""
    body = json.dumps({INPUT_NAME: prompt, **params}).encode("utf-8")
    target = f"http://{server_address(url)}/v2/models/{model}/generate_stream"
    session = _session()
    started = time.perf_counter()
    try:
        with connect_sse(
            session,
            "POST",
            target,
            content=body,
            # one connection a stream, as urllib made: none is left open in the pool
            headers={"Content-Type": "application/json", "Connection": "close"},
            timeout=timeout_s,
        ) as source:
            answer = source.response
            if answer.status_code >= 400:
                text = answer.read().decode("utf-8", "replace")
                raise _refused(model, answer.status_code, _sse_error(text))
            for sse in source.iter_sse():
                event = _event(sse.data)
                if "error" in event:
                    raise _refused(model, "in stream", str(event["error"]))
                piece = event.get(OUTPUT_NAME, "")
                if isinstance(piece, list):  # a request of several prompts
                    piece = "\n".join(map(str, piece))
                yield Response(str(piece), time.perf_counter() - started)
    except httpx.PoolTimeout:  # a TimeoutException, but the server was never asked
        raise _pool_exhausted(url, model, timeout_s) from None
    except httpx.TimeoutException:
        raise _timed_out(url, model, timeout_s) from None
    except SSEError as exc:  # a TransportError, but the server answered: caught before those
        raise _not_events(url, model, exc) from None
    except httpx.RemoteProtocolError as exc:
        if "complete message body" not in str(exc):  # not a body cut off: no answer
            raise _unreachable(url, exc) from None
        raise InferenceError(
            f"the stream from model {model!r} at {url!r} ended before its last response; "
            "is the server still running?"
        ) from None
    except httpx.TransportError as exc:
        raise _unreachable(url, exc) from None


def _event(data: str) -> dict:
    """One server-sent event's JSON object; :class:`SSEError` names what came instead."""
    try:
        event = json.loads(data)
    except ValueError:
        raise SSEError(f"an event's data is not JSON: {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise SSEError(f"an event's data is not a JSON object: {data[:200]!r}")
    return event


def _grpc_responses(
    url: str,
    model: str,
    prompt: str,
    timeout_s: float,
    batched: bool | None,
    params: dict[str, Any],
) -> Iterator[Response]:

    if batched is None:
        batched = model_batches(url, model, "grpc")
    module, client = _client(url, "grpc")
    arrived: queue.Queue = queue.Queue()
    array = np.array([prompt.encode("utf-8")], dtype=np.object_)
    array = array.reshape(1, 1) if batched else array
    tensor = module.InferInput(INPUT_NAME, list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)

    def refused(exc: InferenceServerException) -> InferenceError:
        status = exc.status()
        if status is not None and "unavailable" in str(status).lower():
            return _unreachable(url, exc)
        # an error response on an open stream carries only its message, no status
        return _refused(model, status or "in stream", exc.message())

    final = False
    try:
        client.start_stream(callback=lambda result, error: arrived.put((result, error)))
        started = time.perf_counter()
        client.async_stream_infer(
            model,
            [tensor],
            outputs=[module.InferRequestedOutput(OUTPUT_NAME)],
            parameters=params or None,
            enable_empty_final_response=True,
        )
        while True:
            try:
                result, error = arrived.get(timeout=timeout_s)
            except queue.Empty:
                raise _timed_out(url, model, timeout_s) from None
            if error is not None:
                raise refused(error)
            final = result.get_response().parameters["triton_final_response"].bool_param
            output = result.as_numpy(OUTPUT_NAME)
            pieces = [] if output is None else output.reshape(-1).tolist()
            text = "\n".join(p.decode("utf-8") if isinstance(p, bytes) else str(p) for p in pieces)
            yield Response(text, time.perf_counter() - started, final)
            if final:
                return
    except InferenceServerException as exc:
        # a stream that broke (server gone) says only that; the callback got the real reason
        with contextlib.suppress(queue.Empty):
            _, first = arrived.get_nowait()
            exc = first or exc
        raise refused(exc) from None
    finally:
        try:
            # Cancel only a stream left mid-answer. Triton 2.51 can keep a request cancelled
            # after its final response forever: the model then never unloads (finalize is not
            # called) and the server waits out its whole exit timeout.
            client.stop_stream(cancel_requests=not final)
        finally:
            client.close()


def responses(
    url: str,
    model: str,
    prompt: str,
    protocol: str = "http",
    *,
    batched: bool | None = None,
    timeout_s: float = 600.0,
    **params: Any,
) -> Iterator[Response]:
    """Every response of the stream, empty pieces included, with its arrival time.

    ``timeout_s`` bounds the wait for each response; ``batched`` (gRPC only) says whether the
    model has a batch dimension, asked from the server when None. The request says
    ``"stream": true`` unless ``stream=False`` is passed: an in-flight model (like Triton's vLLM
    backend) answers per token only when asked, since Triton does not tell a model which endpoint
    a request came by; the plain decoupled model streams either way.
    """
    if not isinstance(prompt, str):
        raise ConfigError(f"prompt must be a string, got {type(prompt).__name__}")
    params = {"stream": True, **params}
    if protocol == "http":
        return _http_responses(url, model, prompt, timeout_s, params)
    if protocol == "grpc":
        return _grpc_responses(url, model, prompt, timeout_s, batched, params)
    raise ConfigError(f"protocol {protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}")


def stream(
    url: str,
    model: str,
    prompt: str,
    protocol: str = "http",
    *,
    batched: bool | None = None,
    timeout_s: float = 600.0,
    **params: Any,
) -> Iterator[str]:
    """Yield the text pieces of ``model``'s answer to ``prompt`` as they arrive.

    ``url`` is ``server.http_url`` or ``server.grpc_url`` to match ``protocol``; ``params`` are
    request parameters (``max_tokens=32, temperature=0.7``). Joined, the pieces are the answer
    the same model gives without streaming.
    """
    for response in responses(
        url, model, prompt, protocol, batched=batched, timeout_s=timeout_s, **params
    ):
        if response.text:
            yield response.text


@dataclass(frozen=True)
class StreamStats:
    """What one streamed answer took. ``tokens`` counts the responses that carried a token.

    ``tokens_per_s`` is the generation rate after the first token: ``(tokens - 1)`` divided by
    the time from the first to the last token (NaN with fewer than two tokens).
    """

    text: str
    tokens: int
    ttft_s: float
    total_s: float
    tokens_per_s: float
    pieces: list[str] = field(repr=False, default_factory=list)

    def __repr__(self) -> str:
        return (
            f"StreamStats({self.tokens} tokens, first after {self.ttft_s:.2f} s, "
            f"{self.tokens_per_s:.1f} tokens/s after it, {self.total_s:.2f} s in all)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "ttft_s": round(self.ttft_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "total_s": round(self.total_s, 4),
        }


def measure(
    url: str,
    model: str,
    prompt: str,
    protocol: str = "http",
    *,
    batched: bool | None = None,
    timeout_s: float = 600.0,
    **params: Any,
) -> StreamStats:
    """Stream one answer and time it: time to first token, tokens per second, the full text.

    Relies on the lab model's protocol: one response per token, then a closing response.
    """
    if protocol == "grpc" and batched is None:
        batched = model_batches(url, model, "grpc")  # asked before the clock starts
    started = time.perf_counter()
    got = list(
        responses(url, model, prompt, protocol, batched=batched, timeout_s=timeout_s, **params)
    )
    total = time.perf_counter() - started
    if not got:
        raise InferenceError(
            f"model {model!r} closed the stream without a response; is it a decoupled "
            "(streaming) model? Its config needs model_transaction_policy { decoupled: true }"
        )
    tokens = got[:-1]  # the last response closes the stream and carries no token
    first = tokens[0].arrived_s if tokens else got[0].arrived_s
    rate = (len(tokens) - 1) / (tokens[-1].arrived_s - first) if len(tokens) > 1 else float("nan")
    pieces = [r.text for r in got if r.text]
    return StreamStats("".join(pieces), len(tokens), first, total, rate, pieces)


def is_streaming(url: str, model: str, timeout_s: float = 10.0) -> bool | None:
    """Whether ``model``'s config is decoupled (it streams); None when it cannot be read."""
    try:
        with urllib.request.urlopen(
            f"http://{server_address(url)}/v2/models/{model}/config", timeout=timeout_s
        ) as response:
            config = json.loads(response.read())
    except (OSError, ValueError) as exc:
        log.debug("cannot read the config of %r from %s: %s", model, url, exc)
        return None
    return bool(config.get("model_transaction_policy", {}).get("decoupled", False))
