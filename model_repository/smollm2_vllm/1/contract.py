"""The contract Triton's vLLM clients speak, on top of the lab's (``protocol.py``).

Triton's own ``vllm_backend``, and the OpenAI-compatible frontend that drives it
(``python/openai`` in Triton's server repository, ``_create_vllm_generate_request``), send:

- ``text_input``: the prompt (the lab's contract: any shape);
- ``sampling_parameters``: a JSON object of vLLM ``SamplingParams`` fields, as a string (BYTES,
  one element): ``{"max_tokens": 16, "temperature": 0, "n": 1, "stop": ["."], ...}``;
- ``stream``, ``exclude_input_in_output``: BOOL, one element; they take precedence over the lab's
  request parameters ``stream`` and ``return_full_text``;
- ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``,
  ``return_cumulative_logprob``, ``return_logprobs``: BOOL, one element, each switching on the
  output of that name.

The outputs beside ``text_output``, one element per answer: ``finish_reason`` (BYTES: "stop",
"length", or "" while the answer goes on), ``num_input_tokens`` (UINT32, the prompt's tokens),
``num_output_tokens`` (UINT32, the tokens this response adds: a stream's responses sum to the
answer's, as the OpenAI frontend adds them up), ``cumulative_logprob`` (FP32) and ``logprobs``
(BYTES: a JSON list, one ``{token id: {"logprob", "rank", "decoded_token"}}`` per token this
response adds, or ``null`` when the request asked for none). With ``n`` > 1 a request of P prompts
gets P x n answers, prompt by prompt, as a flat list.

A request names a LoRA adapter the model serves with ``lora_name`` (a string), in
``sampling_parameters`` or as a request parameter, as Triton's ``vllm_backend`` reads it; the
model serves the adapters its config names (``lora_adapters``, ``vllm_settings.py``). A name it
does not serve is a 400 that names it and the served ones.

The lab's request parameters keep working (max_tokens, temperature, top_k, top_p,
repetition_penalty, seed, return_full_text, stream), and any other scalar ``SamplingParams`` field
may be a request parameter too. ``sampling_parameters`` wins over the parameters, which win over
config.pbtxt. Every field is checked by name and type here, then by vLLM itself (a temperature
above 2...), before the request takes a place in the engine: each refusal is a 400 that names the
field. This module does not import vLLM: the engine passes vLLM's field types, a builder and the
classes of vLLM's refusals in.

Whose fault a failure is follows vLLM's own split (``vllm.exceptions``, v0.32): every check of a
request's values (each SamplingParams bound, a structured-output schema that does not parse, a
LoRA adapter it does not have) raises a ``VLLMClientError``, which vLLM's own server answers
4xx; ``AsyncLLM.generate`` passes those on as they are and wraps anything else in
``EngineGenerateError``, a server error. So only those (and this module's :class:`RequestError`)
are the client's: a 400. Any other exception, a ``ValueError`` included, is a fault of the server:
a 500 that says so, its traceback in the server's log (:func:`failure`).
"""

from __future__ import annotations

import json
import traceback
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace

import numpy as np
import triton_python_backend_utils as pb_utils

from .protocol import (
    IGNORED_PARAMETERS,
    OUTPUT_NAME,
    Prompts,
    RequestError,
    Settings,
    check_context,
)

SAMPLING_INPUT = "sampling_parameters"
SAMPLING_FIELD = "field {!r} of 'sampling_parameters'"  # how a refusal names one of its fields
LORA_FIELD = "lora_name"  # the adapter a request asks for (no SamplingParams field)
FLAG_INPUTS = ("stream", "exclude_input_in_output")
RETURNS = (
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "cumulative_logprob",
    "logprobs",
)
#: SamplingParams fields the model sets itself: how vLLM hands back its output.
MODEL_OWNED = frozenset(
    {
        "detokenize",
        "output_kind",
        "skip_clone",
        "output_text_buffer_length",
        "prompt_logprob_token_ids",
    }
)
#: The lab's own request parameters (protocol.py reads them).
LAB_PARAMETERS = (
    frozenset(Settings.__dataclass_fields__) | IGNORED_PARAMETERS | {"return_full_text"}
)


@dataclass(frozen=True)
class Returns:
    """Which outputs beside ``text_output`` a request asked for."""

    finish_reason: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False


@dataclass(frozen=True)
class Request:
    """One request, read and checked: the lab's prompts, vLLM's sampling parameters, the outputs."""

    prompts: Prompts
    params: object  # vLLM's SamplingParams, built and validated by vLLM
    n: int  # answers per prompt
    returns: Returns
    vllm_text: bool  # vLLM's text is the answer (fields that change the text: vllm_text())
    lora_name: str | None = None  # the LoRA adapter that answers it; None: the base model

    @property
    def answers(self) -> int:
        return len(self.prompts.ids) * self.n

    @property
    def shape(self) -> tuple[int, ...]:
        """text_output's shape: the input's, or a flat list of every prompt's n answers."""
        return self.prompts.shape if self.n == 1 else (self.answers,)


@dataclass
class Answer:
    """What one answer (a prompt's completion) has reached, and what its responses told."""

    text: str = ""  # its text so far (including what was sent)
    tokens: int = 0  # tokens vLLM generated for it (an end-of-sequence token included)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None  # vLLM's, one dict per token
    counted: int = 0  # tokens already reported in num_output_tokens
    logged: int = 0  # logprobs entries already sent


class ContractReader:
    """Turns a Triton request into a :class:`Request`, or raises :class:`RequestError`.

    ``base`` is the lab's reader (its ``prompts()``: the prompts and the lab's parameters, not
    yet checked against the context: that is checked here, with the max_tokens that
    sampling_parameters may set); ``annotations`` are vLLM's ``SamplingParams`` field types;
    ``build(fields)`` makes vLLM's SamplingParams; ``context`` is the model's context in tokens.
    ``refusals`` are the exception classes vLLM raises for a request's own values
    (``VLLMClientError``): raised by ``build`` or by one of vLLM's own field types
    (StructuredOutputsParams), they are the client's, a 400 in vLLM's words. Anything else they
    raise is not the request's fault and is not answered as if it were: it propagates.
    ``adapters`` are the names of the LoRA adapters the model serves.
    """

    def __init__(
        self,
        base,
        annotations: Mapping[str, object],
        build: Callable[[dict], object],
        context: int | None,
        refusals: tuple[type[BaseException], ...],
        adapters: Sequence[str] = (),
    ) -> None:
        self.base = base
        self.annotations = {
            k: v for k, v in annotations.items() if not k.startswith("_") and k not in MODEL_OWNED
        }
        self.build = build
        self.context = context
        self.refusals = refusals
        self.adapters = tuple(adapters)

    def read(self, request) -> Request:
        raw = json.loads(request.parameters() or "{}")
        lora = raw.pop(LORA_FIELD, None)
        extra = {
            k: raw.pop(k) for k in list(raw) if k not in LAB_PARAMETERS and k in self.annotations
        }
        prompts = self.base.prompts(_WithParameters(request, raw))
        stream = _flag(request, "stream")
        exclude = _flag(request, "exclude_input_in_output")
        prompts = replace(
            prompts,
            stream=prompts.stream if stream is None else stream,
            full_text=prompts.full_text if exclude is None else not exclude,
        )
        chosen = {
            "max_tokens": prompts.settings.max_tokens,
            "temperature": prompts.settings.temperature,
            "top_k": prompts.settings.top_k,
            "top_p": prompts.settings.top_p,
            "repetition_penalty": prompts.settings.repetition_penalty,
            "seed": prompts.settings.seed,
        }
        chosen.update(self._checked(extra, "request parameter {!r}"))
        sampling = self._sampling_input(request)
        lora = sampling.pop(LORA_FIELD, lora)  # sampling_parameters win, as for every field
        lora_name = self._adapter(lora)
        chosen.update(self._checked(sampling, SAMPLING_FIELD))
        if self.context and isinstance(chosen.get("max_tokens"), int):
            check_context(prompts.ids, chosen["max_tokens"], self.context)
        vllm_text = vllm_decodes(chosen)
        try:
            params = self.build(dict(chosen, detokenize=vllm_text or wants_words(chosen)))
        except self.refusals as exc:  # vLLM's checks of the values: a temperature above 2...
            raise RequestError(f"vLLM refused the request: {exc}") from None
        returns = Returns(**{name: bool(_flag(request, f"return_{name}")) for name in RETURNS})
        n = getattr(params, "n", 1) or 1
        return Request(prompts, params, n, returns, vllm_text, lora_name)

    def _adapter(self, name: object) -> str | None:
        """The LoRA adapter a request named (None: none), checked against the served ones."""
        if name is None:
            return None
        if isinstance(name, str) and name in self.adapters:
            return name
        if not self.adapters:
            served = "no LoRA adapter (its config.pbtxt names none in parameter 'lora_adapters')"
        else:
            served = "the LoRA adapter(s) " + ", ".join(map(repr, self.adapters))
        what = f"unknown LoRA adapter {name!r}"
        if not isinstance(name, str):
            what = f"{LORA_FIELD!r} must be a string naming a LoRA adapter, got {name!r}"
        raise RequestError(
            f"{what}: this model serves {served}; leave {LORA_FIELD!r} out for the base model"
        )

    def _sampling_input(self, request) -> dict:
        tensor = pb_utils.get_input_tensor_by_name(request, SAMPLING_INPUT)
        if tensor is None:
            return {}
        items = tensor.as_numpy().reshape(-1)
        if items.size != 1:
            raise RequestError(
                f"input {SAMPLING_INPUT!r} must hold one JSON string, got {items.size} elements"
            )
        text = items[0].decode("utf-8", "replace") if isinstance(items[0], bytes) else str(items[0])
        return parse_sampling_parameters(text)

    def _checked(self, values: Mapping[str, object], where: str) -> dict:
        """``values`` checked by name and type; ``where`` names them: "field {!r} of ..."."""
        owned = sorted(set(values) & MODEL_OWNED)
        if owned:
            raise RequestError(
                f"{where.format(owned[0])} is set by the model, not by a request; leave it out"
            )
        unknown = sorted(set(values) - set(self.annotations))
        if unknown:
            raise RequestError(
                f"unknown {where.replace('{!r}', ', '.join(map(repr, unknown)))}: not a vLLM "
                "SamplingParams field; this model takes "
                f"{', '.join(sorted(self.annotations))}"
            )
        checked = {}
        for k, v in values.items():
            try:
                checked[k] = check_value(where.format(k), v, self.annotations[k])
            except self.refusals as exc:  # vLLM's own field type checked it (two schemas...)
                raise RequestError(f"vLLM refused {where.format(k)}: {exc}") from None
        return checked


def vllm_decodes(fields: Mapping[str, object]) -> bool:
    """Whether vLLM's own text is the answer: the request sets a field that changes the text of
    vLLM's server (stop strings and stop tokens end it before them, ``ignore_eos`` goes on past
    an end-of-sequence token, ``skip_special_tokens: false`` keeps special tokens, spaced as
    ``spaces_between_special_tokens`` says). Else the model decodes as ``smollm2`` does (the same
    text, from the tokens up to the first end-of-sequence token) and vLLM need not."""
    return (
        bool(fields.get("stop"))
        or bool(fields.get("stop_token_ids"))
        or bool(fields.get("include_stop_str_in_output"))
        or bool(fields.get("ignore_eos"))
        or fields.get("skip_special_tokens") is False
    )


def wants_words(fields: Mapping[str, object]) -> bool:
    """Whether vLLM must detokenize for the request's logprobs: each entry's ``decoded_token``
    is the token's text only when it does (else None, which Triton's OpenAI frontend cannot
    read). vLLM then decodes every logprob token (``logprobs`` + 1 per generated token) and
    the answer; without logprobs that work is skipped."""
    return fields.get("logprobs") is not None or fields.get("prompt_logprobs") is not None


@dataclass(frozen=True)
class Failure:
    """How a request that failed in vLLM is answered: ``client`` (its own values: a 400 in
    vLLM's words) or not (a fault of the server: a 500 that says so, logged with ``trace``)."""

    message: str
    client: bool
    trace: str = ""


def failure(exc: BaseException, refusals: tuple[type[BaseException], ...]) -> Failure:
    """The answer to a request whose generation raised ``exc``; ``refusals`` are vLLM's classes
    for a request's own values (``VLLMClientError``). Anything else, a ``ValueError`` or a
    ``TypeError`` included, is the server's fault: a bug, an engine that failed."""
    if isinstance(exc, refusals):
        return Failure(f"vLLM refused the request: {exc}", client=True)
    return Failure(
        f"generation failed on the server, not because of the request ({_named(exc)}); the "
        "server's log has the traceback",
        client=False,
        trace="".join(traceback.format_exception(exc)).rstrip(),
    )


def _named(exc: BaseException) -> str:
    """``Type: words`` of ``exc`` and of what caused it: vLLM's ``generate()`` raises an
    ``EngineGenerateError`` without words from the exception that made it fail."""
    parts = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        words = str(seen)
        parts.append(f"{type(seen).__name__}: {words}" if words else type(seen).__name__)
        seen = seen.__cause__
    return ", caused by ".join(parts)


def parse_sampling_parameters(text: str) -> dict:
    """The JSON object of ``sampling_parameters``; raises :class:`RequestError`."""
    example = 'e.g. {"temperature": 0.7, "max_tokens": 32, "stop": ["."]}'
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise RequestError(
            f"input {SAMPLING_INPUT!r} is not valid JSON ({exc}); send a JSON object of vLLM "
            f"SamplingParams fields, {example}"
        ) from None
    if not isinstance(values, dict):
        raise RequestError(
            f"input {SAMPLING_INPUT!r} must be a JSON object of vLLM SamplingParams fields, got "
            f"{type(values).__name__} {text[:80]!r}; {example}"
        )
    return values


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_value(name: str, value: object, annotation: object) -> object:
    """``value`` checked against a field's type (``int``, ``float | None``, ``list[str]``...),
    converted where JSON cannot say it (an int for a float, string keys of a dict of ints, a
    JSON object for a dataclass such as vLLM's StructuredOutputsParams)."""
    try:
        return _converted(value, annotation)
    except (TypeError, ValueError) as exc:
        raise RequestError(
            f"{name} must be {_described(annotation)}, got {value!r}{exc.args[0] if exc.args else ''}"
        ) from None


def _converted(value: object, annotation: object) -> object:
    """``value`` as ``annotation``; raises TypeError (or ValueError, with words to add)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _union(value, typing.get_args(annotation))
    if annotation is typing.Any:
        return value
    if annotation in _KINDS:
        return _scalar(value, annotation)
    if origin in (list, set):
        (item,) = typing.get_args(annotation) or (typing.Any,)
        if not isinstance(value, list):
            raise TypeError()
        return [_converted(v, item) for v in value]
    if origin is dict:
        return _mapping(value, *(typing.get_args(annotation) or (typing.Any, typing.Any)))
    if isinstance(annotation, type) and is_dataclass(annotation):
        return _record(value, annotation)
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise TypeError()
    return value


def _union(value: object, options: tuple) -> object:
    if value is None and type(None) in options:
        return None
    reason: Exception = TypeError()
    for option in options:
        if option is type(None):
            continue
        try:
            return _converted(value, option)
        except TypeError:
            continue
        except ValueError as exc:  # the right kind, with a wrong part: say which
            reason = exc
    raise reason


def _scalar(value: object, kind: type) -> object:
    if isinstance(value, bool) != (kind is bool):  # JSON's true is no number, 1 no boolean
        raise TypeError()
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise TypeError()
    if kind is float and (value != value or value in (float("inf"), float("-inf"))):
        raise ValueError(" (not finite)")
    return value


def _mapping(value: object, key: object, item: object) -> dict:
    if not isinstance(value, dict):
        raise TypeError()
    converted = {}
    for k, v in value.items():
        if key is int and isinstance(k, str):  # JSON's keys are strings: logit_bias {"42": 5}
            try:
                k = int(k)
            except ValueError:
                raise ValueError(f" (key {k!r} is not an integer)") from None
        converted[_converted(k, key)] = _converted(v, item)
    return converted


def _record(value: object, kind: type) -> object:
    """A dataclass (vLLM's StructuredOutputsParams) from a JSON object, or its JSON string (the
    OpenAI frontend sends structured_outputs as a string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise TypeError() from None
    if not isinstance(value, dict):
        raise TypeError()
    unknown = sorted(set(value) - {f.name for f in fields(kind)})
    if unknown:
        raise ValueError(f" (unknown key(s) {', '.join(map(repr, unknown))})")
    return kind(**value)


def _described(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = " or ".join(_described(a) for a in options)
        return f"{words} or null" if len(options) < len(typing.get_args(annotation)) else words
    if origin in (list, set):
        (item,) = typing.get_args(annotation) or (typing.Any,)
        return f"a list of {_described(item).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a JSON object"
    if isinstance(annotation, type) and is_dataclass(annotation):
        return f"a JSON object of {annotation.__name__}'s fields"
    return _KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _flag(request, name: str) -> bool | None:
    """A BOOL input of one element, or None when the request has none."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    items = tensor.as_numpy().reshape(-1)
    if items.size != 1 or items.dtype != np.bool_:
        raise RequestError(
            f"input {name!r} must be one BOOL, got {items.size} element(s) of {items.dtype}"
        )
    return bool(items[0])


class _WithParameters:
    """A request whose ``parameters()`` are ``values`` (the lab's reader reads its own)."""

    def __init__(self, request, values: dict) -> None:
        self._request = request
        self._parameters = json.dumps(values)

    def parameters(self) -> str:
        return self._parameters

    def __getattr__(self, name: str):
        return getattr(self._request, name)


# -- writing a response -------------------------------------------------------------------------
def response(request: Request, texts: list[str], answers: list[Answer], prompt_tokens: list[int]):
    """A response: each answer's ``texts`` in text_output, and the outputs the request asked for
    (``num_output_tokens`` and ``logprobs`` count what this response adds: each answer's
    ``counted`` and ``logged`` move on)."""
    out = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(request.shape)
    tensors = [pb_utils.Tensor(OUTPUT_NAME, out)]
    asked = request.returns
    if asked.finish_reason:
        reasons = [(a.finish_reason or "").encode() for a in answers]
        tensors.append(pb_utils.Tensor("finish_reason", np.array(reasons, dtype=np.object_)))
    if asked.num_input_tokens:
        counts = [prompt_tokens[i // request.n] for i in range(len(answers))]
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array(counts, dtype=np.uint32)))
    if asked.num_output_tokens:
        counts = [a.tokens - a.counted for a in answers]
        for a in answers:
            a.counted = a.tokens
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array(counts, dtype=np.uint32)))
    if asked.cumulative_logprob:
        values = [np.nan if a.cumulative_logprob is None else a.cumulative_logprob for a in answers]
        tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(values, dtype=np.float32)))
    if asked.logprobs:
        tensors.append(pb_utils.Tensor("logprobs", np.array(_logprobs(answers), dtype=np.object_)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _logprobs(answers: list[Answer]) -> list[bytes]:
    """Each answer's new logprobs entries as JSON (``null`` when vLLM computed none)."""
    texts = []
    for a in answers:
        if a.logprobs is None:
            texts.append(b"null")
            continue
        new = [
            {
                str(token): {"logprob": p.logprob, "rank": p.rank, "decoded_token": p.decoded_token}
                for token, p in entry.items()
            }
            for entry in a.logprobs[a.logged :]
        ]
        a.logged = len(a.logprobs)
        texts.append(json.dumps(new).encode())
    return texts
