"""Talk to a text-generation model: ``infer`` (HTTP or gRPC), ``generate`` (HTTP), and curl.

Every function takes the server's address as ``host:port`` (``server.http_url``) or a full URL,
and raises :class:`labkit.errors.InferenceError` carrying the server's own reason when it refuses
a request (``error.status``: the HTTP status or gRPC code).
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tritonclient.utils import InferenceServerException

from labkit.errors import ConfigError, InferenceError
from labkit.settings import redact

INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"
PROTOCOLS = ("http", "grpc")


def server_address(url: str) -> str:
    """``host:port`` from ``host:port`` or ``http://host:port/``."""
    return url.split("://", 1)[-1].rstrip("/")


def _refused(model: str, status, message: str) -> InferenceError:
    if isinstance(status, str) and status.isdigit():  # tritonclient.http reports "400"
        status = int(status)
    message = redact(message)
    error = InferenceError(f"model {model!r} refused the request ({status}): {message}")
    error.status = status
    error.server_message = message
    return error


def _unreachable(url: str, exc: BaseException) -> InferenceError:
    error = InferenceError(
        f"cannot reach Triton at {url!r}: {exc}; is the server running? "
        "(start it with labkit.lab.start_server or `labkit serve`)"
    )
    error.status = None
    error.server_message = str(exc)
    return error


def error_text(exc: urllib.error.HTTPError) -> str:
    """The reason in a refused HTTP request: Triton's ``{"error": ...}`` field, else the body."""
    text = exc.read().decode("utf-8", "replace")
    try:
        return json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text


def _prompt_array(prompts: str | bytes | Sequence[str | bytes], batched: bool) -> np.ndarray:
    items = [prompts] if isinstance(prompts, (str, bytes)) else list(prompts)
    if not items:
        raise ConfigError("prompts is empty; pass a string or a list of strings")
    data = [p if isinstance(p, bytes) else str(p).encode("utf-8") for p in items]
    array = np.array(data, dtype=np.object_)
    return array.reshape(-1, 1) if batched else array


def _decode(array: np.ndarray) -> list[str]:
    return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)]


def _client(url: str, protocol: str, timeout_s: float = 600.0):
    """``(tritonclient module, client)`` for ``protocol``."""
    if protocol == "http":
        import tritonclient.http as module  # noqa: PLC0415 (each protocol's client pulls its own network stack; load the one in use)

        address = server_address(url)
        return module, module.InferenceServerClient(
            address, connection_timeout=timeout_s, network_timeout=timeout_s
        )
    if protocol == "grpc":
        import tritonclient.grpc as module  # noqa: PLC0415 (each protocol's client pulls its own network stack; load the one in use)

        return module, module.InferenceServerClient(server_address(url))
    raise ConfigError(f"protocol {protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}")


def _call(url: str, model: str, function, *args, **kwargs):
    """Run a tritonclient call; its refusals and connection errors become InferenceError."""

    try:
        return function(*args, **kwargs)
    except InferenceServerException as exc:
        status = exc.status()
        if status is None or "unavailable" in str(status).lower():
            raise _unreachable(url, exc) from None
        raise _refused(model, status, exc.message()) from None
    except OSError as exc:
        raise _unreachable(url, exc) from None


def model_batches(url: str, model: str, protocol: str = "http") -> bool:
    """Whether ``model``'s config has ``max_batch_size`` > 0 (requests then need ``[N, 1]``)."""
    _, client = _client(url, protocol)
    try:
        config = _call(url, model, client.get_model_config, model)
    finally:
        client.close()
    if protocol == "grpc":
        return config.config.max_batch_size > 0
    return int(config.get("max_batch_size", 0)) > 0


def infer(
    url: str,
    model: str,
    prompts: str | bytes | Sequence[str | bytes],
    protocol: str = "http",
    *,
    batched: bool | None = None,
    timeout_s: float = 600.0,
    **params: object,
) -> list[str]:
    """Send the prompts as ONE request to ``/v2/models/<model>/infer``; return one text each.

    ``batched`` says whether the model has a batch dimension (asked from the server when None);
    ``params`` are request parameters such as ``max_tokens=16, temperature=0.7``.
    """
    if batched is None:
        batched = model_batches(url, model, protocol)
    module, client = _client(url, protocol, timeout_s)
    array = _prompt_array(prompts, batched)
    tensor = module.InferInput(INPUT_NAME, list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    kwargs: dict = {"outputs": [module.InferRequestedOutput(OUTPUT_NAME)]}
    if params:
        kwargs["parameters"] = params
    if protocol == "grpc":
        kwargs["client_timeout"] = timeout_s
    try:
        result = _call(url, model, client.infer, model, [tensor], **kwargs)
    finally:
        client.close()
    return _decode(result.as_numpy(OUTPUT_NAME))


@dataclass
class Generation:
    """The answer of ``/generate``: the text, the server's JSON, and the round trip in seconds."""

    text: str
    raw: dict = field(repr=False)
    seconds: float


def generate(
    url: str, model: str, prompt: str, *, timeout_s: float = 600.0, **params: object
) -> Generation:
    """``POST /v2/models/<model>/generate`` with ``{"text_input": prompt, **params}``."""
    body = json.dumps({INPUT_NAME: prompt, **params}).encode("utf-8")
    request = urllib.request.Request(
        f"http://{server_address(url)}/v2/models/{model}/generate",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise _refused(model, exc.code, error_text(exc)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise _unreachable(url, exc) from None
    seconds = time.perf_counter() - started
    text = raw.get(OUTPUT_NAME)
    if isinstance(text, list):  # a model with several answers per request
        text = "\n".join(map(str, text))
    return Generation(text if text is not None else "", raw, seconds)


def infer_body(prompt: str, *, batched: bool = False, parameters: dict | None = None) -> dict:
    """The JSON body of ``/v2/models/<model>/infer`` for one prompt (KServe v2): ``text_input``
    as a BYTES tensor of shape ``[1]``, or ``[1, 1]`` for a model with a batch dimension, and the
    request's ``parameters`` when there are any."""
    shape = [1, 1] if batched else [1]
    body: dict = {
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": shape, "data": [prompt]}]
    }
    if parameters:
        body["parameters"] = dict(parameters)
    return body


def curl_command(
    url: str,
    model: str,
    prompt: str,
    *,
    endpoint: str = "infer",
    batched: bool = False,
    **params: object,
) -> str:
    """The tutorial's curl line for this request, ready to paste into a terminal.

    ``endpoint``: ``infer``, ``generate``, or ``generate_stream`` (a streaming model's
    server-sent events; ``-N`` makes curl print each event as it arrives).
    """
    if endpoint in ("generate", "generate_stream"):
        body: dict = {INPUT_NAME: prompt, **params}
    elif endpoint == "infer":
        body = infer_body(prompt, batched=batched, parameters=params)
    else:
        raise ConfigError(
            f"endpoint {endpoint!r} is not supported; use 'infer', 'generate' or 'generate_stream'"
        )
    target = f"{server_address(url)}/v2/models/{model}/{endpoint}"
    flags = "-N " if endpoint == "generate_stream" else ""
    return f"curl {flags}-X POST {target} -d {shlex.quote(json.dumps(body))}"


#: The tutorial's sample /infer answer (falcon-7b), as it printed it. Its output is named "text";
#: the tutorial's own config.pbtxt names it "text_output", which is what Triton really sends.
TUTORIAL_INFER_RESPONSE = {
    "model_name": "falcon7b",
    "model_version": "1",
    "outputs": [
        {
            "name": "text",
            "datatype": "BYTES",
            "shape": [1],
            "data": ["I am going to be in the market for a new laptop soon. I"],
        }
    ],
}


def infer_json(
    url: str, model: str, prompt: str, *, batched: bool = False, timeout_s: float = 600.0, **params
) -> dict:
    """The raw JSON answer of ``/v2/models/<model>/infer``: the tutorial's curl request, in Python.

    ``batched``: send the prompt as shape ``[1, 1]``, as a model with ``max_batch_size > 0``
    needs (the tutorial's ``[1]`` is then refused). Refusals raise :class:`InferenceError` with
    Triton's message.
    """
    body = infer_body(prompt, batched=batched, parameters=params)
    request = urllib.request.Request(
        f"http://{server_address(url)}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise _refused(model, exc.code, error_text(exc)) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise _unreachable(url, exc) from exc
