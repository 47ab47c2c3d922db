"""The model's contract: what config.pbtxt may set, what a request may hold, how it is answered.

Every scheduler of this folder (``model.py``'s batches, the decoupled stream of ``decoupled.py``,
the in-flight engine of ``inflight.py``) reads requests with :class:`RequestReader` and answers
with the response functions at the end, so all of them accept and refuse the same requests with
the same words. A bad request is refused with :class:`RequestError` (HTTP 400) and serving goes
on; a bad config.pbtxt raises :class:`ConfigError` and the model does not load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import triton_python_backend_utils as pb_utils

from .engine_settings import Limits, read_limits

INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"
# Request parameters the server itself may attach; never generation settings, never errors.
# ``stream`` is how a client of the in-flight model asks for one response per token (as with
# Triton's vLLM backend): Triton does not tell a model whether a request came to ``/generate``,
# which takes exactly one response, or to ``/generate_stream``.
IGNORED_PARAMETERS = frozenset(
    {
        "stream",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "binary_data_output",
    }
)


class RequestError(ValueError):
    """A request is invalid; the message names the field and the fix."""


class ConfigError(ValueError):
    """A config.pbtxt parameter is invalid; the message names the parameter and the fix."""


@dataclass(frozen=True)
class Settings:
    """Generation settings. Requests whose settings differ only in ``max_tokens`` are generated
    together (see :func:`group_by_settings`)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None  # for sampling

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class Prompts:
    """One request, read and checked: its prompts and how to generate and answer them."""

    shape: tuple[int, ...]  # the shape of text_input (any); text_output gets the same
    texts: list[str]  # the prompts, in order
    ids: list[list[int]]  # each prompt's token ids
    settings: Settings
    full_text: bool  # the answer starts with the prompt (return_full_text)
    stream: bool = False  # the client asked for one response per token (in-flight model)


@dataclass(frozen=True)
class Member:
    """A valid request of a batch: its place in the batch's request list, and its prompts."""

    index: int
    prompts: Prompts


# -- config.pbtxt -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """config.pbtxt's parameters, read and checked (Triton stores them all as strings)."""

    huggingface_model: str  # a hub id, an absolute path or a path relative to the model's folder
    defaults: Settings  # max_tokens, temperature...: the settings a request may override
    full_text: bool  # return_full_text (default true, as in the tutorial)
    gated: bool  # the hub model needs a token (Llama 2)
    # torch threads per instance; 0 (default): the host's cores less one (Triton's threads and
    # the clients on the host) divided by the instances that share them (instance_group counts,
    # times the servers of LABKIT_SERVERS_ON_HOST), at least 1: engine_settings.thread_budget
    num_threads: int
    dtype: str  # auto: float16 on a GPU, float32 on a CPU; or a torch dtype's name
    inflight: Limits | None  # inflight_batching's limits; None: no in-flight batching


def read_options(config: dict) -> Options:
    """The options of a model config (Triton's JSON form); raises :class:`ConfigError`."""
    name = config.get("name", "model")
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    if "huggingface_model" not in params:
        raise ConfigError(
            f"model {name!r}: config.pbtxt has no parameter "
            "'huggingface_model'; name a hub id or a folder there"
        )
    inflight = None
    if as_bool("inflight_batching", params.get("inflight_batching", "false"), from_config=True):
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ConfigError(
                f"model {name!r}: inflight_batching needs a decoupled model (its responses "
                "leave after execute has returned); add model_transaction_policy { decoupled: "
                "true } to config.pbtxt"
            )
        try:
            inflight = read_limits(params)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return Options(
        huggingface_model=params["huggingface_model"],
        defaults=parse_settings(params, Settings(), from_config=True),
        full_text=as_bool(
            "return_full_text", params.get("return_full_text", "true"), from_config=True
        ),
        gated=as_bool("gated", params.get("gated", "false"), from_config=True),
        num_threads=as_int(
            "num_threads", params.get("num_threads", "0"), minimum=0, from_config=True
        ),
        dtype=params.get("dtype", "auto").strip() or "auto",
        inflight=inflight,
    )


# -- reading a request --------------------------------------------------------------------------
class RequestReader:
    """Turns a Triton request into :class:`Prompts`, or raises :class:`RequestError`."""

    def __init__(
        self, tokenizer, defaults: Settings, return_full_text: bool, context: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.defaults = defaults  # config.pbtxt's settings; a request's parameters override them
        self.return_full_text = return_full_text
        self.context = context  # the most tokens a prompt plus its answer may have, if known

    def read(self, request) -> Prompts:
        prompts = self.prompts(request)
        check_context(prompts.ids, prompts.settings.max_tokens, self.context)
        return prompts

    def prompts(self, request) -> Prompts:
        """The request read and checked, except against the context: a reader that takes
        max_tokens from elsewhere too (``contract.py``'s sampling_parameters) checks the context
        with the max_tokens it settles on (:func:`check_context`)."""
        array = self._input(request)
        prompts = [_check_prompt(i, item) for i, item in enumerate(array.reshape(-1))]
        settings, full_text, stream = self._parameters(request)
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        return Prompts(
            shape=array.shape,
            texts=prompts,
            ids=ids,
            settings=settings,
            full_text=full_text,
            stream=stream,
        )

    def _input(self, request) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, INPUT_NAME)
        if tensor is None:
            raise RequestError(f"input {INPUT_NAME!r} is missing")
        array = tensor.as_numpy()
        if array.size == 0:
            raise RequestError(f"input {INPUT_NAME!r} holds no prompt (shape {list(array.shape)})")
        return array

    def _parameters(self, request) -> tuple[Settings, bool, bool]:
        """The request's settings, return_full_text and stream: its parameters over the defaults."""
        raw = json.loads(request.parameters() or "{}")
        unknown = sorted(
            set(raw)
            - set(Settings.__dataclass_fields__)
            - IGNORED_PARAMETERS
            - {"return_full_text"}
        )
        if unknown:
            raise RequestError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))}; this model accepts "
                "max_tokens, temperature, top_k, top_p, repetition_penalty, seed, "
                "return_full_text"
            )
        settings = parse_settings(raw, self.defaults)
        full_text = self.return_full_text
        if "return_full_text" in raw:
            full_text = as_bool("return_full_text", raw["return_full_text"], from_config=False)
        stream = as_bool("stream", raw["stream"], from_config=False) if "stream" in raw else False
        return settings, full_text, stream


def check_context(ids: list[list[int]], max_tokens: int, context: int | None) -> None:
    """Raise :class:`RequestError` if a prompt of ``ids`` plus ``max_tokens`` exceeds ``context``
    (None: unknown, nothing is checked)."""
    for i, seq in enumerate(ids):
        if context and len(seq) + max_tokens > context:
            raise RequestError(
                f"prompt {i} is {len(seq)} tokens; with max_tokens={max_tokens} that exceeds the "
                f"model's context of {context} tokens; shorten the prompt or lower max_tokens"
            )


def _check_prompt(i: int, item: object) -> str:
    if isinstance(item, bytes):
        try:
            item = item.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(
                f"prompt {i} of {INPUT_NAME!r} is not valid UTF-8 "
                f"(byte {exc.start}); send UTF-8 text"
            ) from None
    if not isinstance(item, str):
        raise RequestError(f"prompt {i} of {INPUT_NAME!r} is not text: {item!r}")
    if not item.strip():
        raise RequestError(
            f"prompt {i} of {INPUT_NAME!r} is empty or only whitespace; send some text"
        )
    if "\x00" in item:
        raise RequestError(
            f"prompt {i} of {INPUT_NAME!r} contains a NUL byte (at character "
            f"{item.index(chr(0))}); send plain text"
        )
    return item


def group_by_settings(
    requests: list, read: Callable[[object], Prompts], refuse: Callable[[int, str], None]
) -> dict[Settings, list[Member]]:
    """The valid requests, grouped by sampling settings; ``refuse(index, message)`` answers each
    other. Requests that differ only in ``max_tokens`` share a group: its settings ask for the
    largest, and each answer is cut at its own request's ``max_tokens`` (a greedy answer's first
    n tokens are its answer to n)."""
    groups: dict[Settings, list[Member]] = {}
    for index, request in enumerate(requests):
        try:
            prompts = read(request)
        except RequestError as exc:
            refuse(index, str(exc))
            continue
        sampling = replace(prompts.settings, max_tokens=0)
        groups.setdefault(sampling, []).append(Member(index=index, prompts=prompts))
    return {
        replace(key, max_tokens=max(m.prompts.settings.max_tokens for m in members)): members
        for key, members in groups.items()
    }


# -- settings -----------------------------------------------------------------------------------
def parse_settings(
    values: Mapping[str, object], base: Settings, *, from_config: bool = False
) -> Settings:
    """``base`` with the generation settings in ``values`` applied and checked.

    Config parameters are strings (``from_config=True`` parses them, and a bad one raises
    :class:`ConfigError`); request parameters must already have the right JSON type (a bad one
    raises :class:`RequestError`).
    """
    error = ConfigError if from_config else RequestError
    changes: dict[str, object] = {}
    if "max_tokens" in values:
        changes["max_tokens"] = as_int(
            "max_tokens", values["max_tokens"], minimum=1, from_config=from_config
        )
    if "temperature" in values:
        t = as_float("temperature", values["temperature"], from_config=from_config)
        if t < 0:
            raise error(f"parameter 'temperature' must be >= 0 (0 = greedy), got {t:g}")
        changes["temperature"] = t
    if "top_k" in values:
        changes["top_k"] = as_int("top_k", values["top_k"], minimum=0, from_config=from_config)
    if "top_p" in values:
        p = as_float("top_p", values["top_p"], from_config=from_config)
        if not 0 < p <= 1:
            raise error(f"parameter 'top_p' must be in (0, 1], got {p:g}")
        changes["top_p"] = p
    if "repetition_penalty" in values:
        r = as_float("repetition_penalty", values["repetition_penalty"], from_config=from_config)
        if r <= 0:
            raise error(f"parameter 'repetition_penalty' must be > 0, got {r:g}")
        changes["repetition_penalty"] = r
    if "seed" in values:
        changes["seed"] = as_int("seed", values["seed"], minimum=0, from_config=from_config)
    return replace(base, **changes)


def as_int(name: str, value: object, *, minimum: int, from_config: bool) -> int:
    error = ConfigError if from_config else RequestError
    if from_config and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"parameter {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise error(f"parameter {name!r} must be >= {minimum}, got {value}")
    return value


def as_float(name: str, value: object, *, from_config: bool) -> float:
    error = ConfigError if from_config else RequestError
    if from_config and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"parameter {name!r} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise error(f"parameter {name!r} must be a finite number, got {value!r}")
    return float(value)


def as_bool(name: str, value: object, *, from_config: bool) -> bool:
    error = ConfigError if from_config else RequestError
    if from_config and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise error(f"parameter {name!r} must be true or false, got {value!r}")
    return value


# -- writing a response -------------------------------------------------------------------------
def completion(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``, decoded together (spaces and merged characters
    come out as in the whole text), or alone when the prompt's own text changed."""
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    whole = tokenizer.decode(prompt + new, skip_special_tokens=True)
    if whole.startswith(head):
        return whole[len(head) :]
    return tokenizer.decode(new, skip_special_tokens=True)


def answer(prompts: Prompts, completions: list[str]) -> pb_utils.InferenceResponse:
    """The response to a request: each prompt's completion (after the prompt, if asked)."""
    texts = completions
    if prompts.full_text:
        texts = [p + t for p, t in zip(prompts.texts, completions, strict=True)]
    return text_response(texts, prompts.shape)


def text_response(texts: list[str], shape) -> pb_utils.InferenceResponse:
    """A response whose ``text_output`` holds ``texts`` in the request's input ``shape``."""
    out = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(shape)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT_NAME, out)])


def error_response(message: str, code=None) -> pb_utils.InferenceResponse:
    """An error response; the default code (INVALID_ARG) is HTTP 400."""
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def cancelled_response(message: str = "cancelled by the client") -> pb_utils.InferenceResponse:
    errors = pb_utils.TritonError  # set up by the stub after import: look it up when used
    return error_response(message, getattr(errors, "CANCELLED", errors.UNAVAILABLE))


def busy_response(message: str) -> pb_utils.InferenceResponse:
    """A refusal that a retry later may get past (a full queue, a stopped engine): UNAVAILABLE."""
    return error_response(message, pb_utils.TritonError.UNAVAILABLE)
