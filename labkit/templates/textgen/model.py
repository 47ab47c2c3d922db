"""Triton Python-backend model: text generation with any Hugging Face causal language model.

Self-contained on purpose: it imports only the standard library, numpy, torch, transformers and
``triton_python_backend_utils``, so the same file runs in the lab's bundled server and in an NGC
``tritonserver`` container where labkit is not installed.

config.pbtxt parameters (all strings, as Triton stores them):

- ``huggingface_model`` (required): a hub id (``tiiuae/falcon-7b``), an absolute path, or a path
  relative to this model's folder (``weights``).
- ``max_tokens`` (new tokens, default 16), ``temperature`` (0 = greedy, the default), ``top_k``
  (0 = off), ``top_p`` (1 = off), ``repetition_penalty`` (1 = off), ``return_full_text``
  (``true``: the answer starts with the prompt, as in the tutorial): generation defaults that a
  request may override with request parameters of the same names, plus ``seed`` for sampling.
- ``gated`` (``true`` for models such as Llama 2 that need a token), ``dtype`` (``auto``: float16
  on a GPU, float32 on a CPU), ``num_threads`` (torch CPU threads; 0 = torch's default).

Input ``text_input`` (TYPE_STRING) holds one prompt per element, in any shape: ``[1]`` and ``[N]``
without batching, ``[1, 1]`` and ``[N, 1]`` with it. Output ``text_output`` has the same shape, one
answer per prompt, in order. The prompts of all requests in a batch that share generation settings
go through ONE ``generate`` call (left padding, attention mask), so dynamic batching pays off and a
prompt's greedy answer in a batch equals its answer alone. A bad request gets an error response
that names the problem (HTTP 400), and the model keeps serving.

Streaming: when config.pbtxt has ``model_transaction_policy { decoupled: true }`` the same code
streams. Each request then gets one response per generated token, whose ``text_output`` holds
the text that token added (empty while a multi-byte character is incomplete), and a closing
response flagged final holding whatever text remains (usually empty); a request's pieces joined
are exactly its non-streaming answer (with ``return_full_text`` the prompt comes with the first
piece). Triton serves such a model over ``/v2/models/<m>/generate_stream`` (server-sent events)
and gRPC streaming. A bad request gets its error response, flagged final, as in the
non-streaming path. When every client of a batch has gone (HTTP connection closed, gRPC stream
cancelled), generation stops at the next token instead of running to ``max_tokens``.

The hub token comes from ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN`` or ``PRIVATE_REPO_TOKEN`` (the
tutorial's name), in that order; it is never logged. Downloads are cached under ``HF_HOME``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.streamers import BaseStreamer

TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "PRIVATE_REPO_TOKEN")
INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"
# Request parameters the server itself may attach; never generation settings, never errors.
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
    """A request (or a config default) is invalid; the message names the field and the fix."""


class TokenError(RuntimeError):
    """A gated model was asked for without a hub token."""


@dataclass(frozen=True)
class Settings:
    """Generation settings. Requests with equal settings are generated together."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0


def _as_int(name: str, value: object, *, minimum: int, from_config: bool) -> int:
    if from_config and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"parameter {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise RequestError(f"parameter {name!r} must be >= {minimum}, got {value}")
    return value


def _as_float(name: str, value: object, *, from_config: bool) -> float:
    if from_config and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"parameter {name!r} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise RequestError(f"parameter {name!r} must be a finite number, got {value!r}")
    return float(value)


def _as_bool(name: str, value: object, *, from_config: bool) -> bool:
    if from_config and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise RequestError(f"parameter {name!r} must be true or false, got {value!r}")
    return value


def parse_settings(
    values: Mapping[str, object], base: Settings, *, from_config: bool = False
) -> Settings:
    """``base`` with the generation settings in ``values`` applied and checked.

    Config parameters are strings (``from_config=True`` parses them); request parameters must
    already have the right JSON type. Raises :class:`RequestError` naming the bad parameter.
    """
    changes: dict[str, object] = {}
    if "max_tokens" in values:
        changes["max_tokens"] = _as_int(
            "max_tokens", values["max_tokens"], minimum=1, from_config=from_config
        )
    if "temperature" in values:
        t = _as_float("temperature", values["temperature"], from_config=from_config)
        if t < 0:
            raise RequestError(f"parameter 'temperature' must be >= 0 (0 = greedy), got {t:g}")
        changes["temperature"] = t
    if "top_k" in values:
        changes["top_k"] = _as_int("top_k", values["top_k"], minimum=0, from_config=from_config)
    if "top_p" in values:
        p = _as_float("top_p", values["top_p"], from_config=from_config)
        if not 0 < p <= 1:
            raise RequestError(f"parameter 'top_p' must be in (0, 1], got {p:g}")
        changes["top_p"] = p
    if "repetition_penalty" in values:
        r = _as_float("repetition_penalty", values["repetition_penalty"], from_config=from_config)
        if r <= 0:
            raise RequestError(f"parameter 'repetition_penalty' must be > 0, got {r:g}")
        changes["repetition_penalty"] = r
    if "seed" in values:
        changes["seed"] = _as_int("seed", values["seed"], minimum=0, from_config=from_config)
    return replace(base, **changes)


def hub_token(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(variable name, token)`` of the first token variable set, or ``(None, None)``."""
    for name in TOKEN_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None, None


def require_token(model_id: str, gated: bool, environ: Mapping[str, str]) -> str | None:
    """The token to use for ``model_id``; a gated model without one raises :class:`TokenError`."""
    _, token = hub_token(environ)
    if gated and token is None:
        raise TokenError(
            f"model {model_id!r} is gated on the Hugging Face Hub and needs an access token, but "
            "none of HF_TOKEN, HUGGING_FACE_HUB_TOKEN, PRIVATE_REPO_TOKEN is set in the server's "
            "environment; accept the model's license on huggingface.co, then export HF_TOKEN="
            "<your token> before starting the server"
        )
    return token


def explain_load_error(model_id: str, exc: BaseException, environ: Mapping[str, str]) -> str:
    """A message for a failed load that says what to do; never contains the token."""
    text = str(exc)
    name, token = hub_token(environ)
    if token:
        text = text.replace(token, "***")
    lowered = text.lower()
    if any(s in lowered for s in ("gated repo", "401", "403", "restricted", "access to model")):
        if name is None:
            hint = (
                "it looks gated or private and no token is set: export HF_TOKEN=<your token> "
                "(or PRIVATE_REPO_TOKEN) in the server's environment"
            )
        else:
            hint = (
                f"the token in {name} was refused: check that it is valid and that your "
                "account accepted the model's license on huggingface.co"
            )
        return f"cannot load {model_id!r}: {hint}. ({text})"
    return (
        f"cannot load {model_id!r}: it is neither a local folder nor reachable on the "
        f"Hugging Face Hub (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}). "
        f"({text})"
    )


def resolve_source(value: str, model_dir: Path) -> tuple[str, bool]:
    """``(what to pass to from_pretrained, is_local)`` for the ``huggingface_model`` parameter."""
    value = value.strip()
    if not value:
        raise RequestError("parameter 'huggingface_model' is empty; name a hub id or a folder")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = model_dir / path
    if path.exists():
        return str(path.resolve()), True
    if value.startswith(("/", ".", "~")) or value.count("/") > 1:
        raise RequestError(
            f"huggingface_model {value!r}: folder {str(path)!r} does not exist; "
            "build it (labkit prepare) or fix the path"
        )
    return value, False


def context_length(model, tokenizer) -> int | None:
    """The longest sequence the model accepts (prompt plus new tokens), if it says."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


def _error(message: str, code=None):
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _texts(texts: list[str], shape) -> pb_utils.InferenceResponse:
    out = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(shape)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT_NAME, out)])


def stable_piece(text: str, emitted: str) -> str:
    """What of ``text`` (the answer so far) can be sent after ``emitted`` without taking back.

    A trailing U+FFFD is a character whose bytes have not all arrived yet: it waits. Text that
    no longer starts with what was sent (a tokenizer rewrote earlier text) waits for the end.
    """
    text = text.rstrip("\ufffd")
    return text[len(emitted) :] if text.startswith(emitted) else ""


class StreamCancelled(Exception):
    """Every request of a streamed batch was cancelled: generation stops early."""


def _cancelled(message: str = "cancelled by the client"):
    errors = pb_utils.TritonError  # set up by the stub after import: look it up when used
    return _error(message, getattr(errors, "CANCELLED", errors.UNAVAILABLE))


class PieceStreamer(BaseStreamer):
    """Sends each request of a generate batch the text each new token adds, as it is made.

    ``members``: ``(response sender, input shape, prompts, token ids, return_full_text)`` per
    request, in the order their prompts are in the batch. ``decode(prompt_ids, new_ids)`` is the
    same function that makes the non-streaming answer, so the pieces add up to that answer.
    """

    def __init__(self, members: list, decode) -> None:
        self.members = members
        self.decode = decode
        self.rows = [(m, i) for m, member in enumerate(members) for i in range(len(member[2]))]
        self.new: list[list[int]] = [[] for _ in self.rows]
        self.done = [False] * len(self.rows)
        self.emitted = [""] * len(self.rows)
        self.sent = [False] * len(members)
        self.cancelled = [False] * len(members)
        self.eos_ids: set[int] = set()
        self.prompt_seen = False

    def _prefix(self, m: int, i: int) -> str:
        _sender, _shape, prompts, _ids, full = self.members[m]
        return prompts[i] if full and not self.sent[m] else ""

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt batch
            self.prompt_seen = True
            return
        for m, member in enumerate(self.members):
            if not self.cancelled[m] and member[0].is_cancelled():
                self.cancelled[m] = True
                self.done = [d or self.rows[r][0] == m for r, d in enumerate(self.done)]
        if all(self.cancelled):  # every client went away: stop generating for them
            raise StreamCancelled(f"{len(self.members)} request(s) cancelled by their clients")
        tokens = value.reshape(-1).tolist()
        pieces: dict[int, list[str]] = {}
        for row, token in enumerate(tokens):
            if self.done[row]:
                continue
            m, i = self.rows[row]
            if token in self.eos_ids:
                self.done[row] = True
                continue
            self.new[row].append(token)
            text = self.decode(self.members[m][3][i], self.new[row])
            piece = stable_piece(text, self.emitted[row])
            self.emitted[row] += piece
            pieces.setdefault(m, [""] * len(self.members[m][2]))[i] = piece
        for m, texts in pieces.items():
            texts = [self._prefix(m, i) + t for i, t in enumerate(texts)]
            self.members[m][0].send(_texts(texts, self.members[m][1]))
            self.sent[m] = True

    def end(self) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for m, (sender, shape, prompts, ids, _full) in enumerate(self.members):
            if self.cancelled[m]:
                try:
                    sender.send(_cancelled(), flags=final)
                except Exception as exc:  # noqa: BLE001 (the request may be gone already)
                    pb_utils.Logger.log_info(f"cancelled request not told: {exc!r}")
                continue
            texts = []
            for i in range(len(prompts)):
                row = self.rows.index((m, i))
                whole = self.decode(ids[i], self.new[row])
                if not whole.startswith(self.emitted[row]):  # cannot happen with HF tokenizers
                    pb_utils.Logger.log_warn(f"streamed text diverged from {whole!r}")
                rest = (
                    whole[len(self.emitted[row]) :] if whole.startswith(self.emitted[row]) else ""
                )
                texts.append(self._prefix(m, i) + rest)
            sender.send(_texts(texts, shape), flags=final)


class _NoEnd(BaseStreamer):
    """Passes generate()'s tokens on and leaves ``end`` to the caller."""

    def __init__(self, streamer: BaseStreamer) -> None:
        self.streamer = streamer

    def put(self, value) -> None:
        self.streamer.put(value)

    def end(self) -> None:
        pass


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.logger = pb_utils.Logger
        config = json.loads(args["model_config"])
        self.name = config.get("name", args.get("model_name", "model"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if "huggingface_model" not in params:
            raise RequestError(
                f"model {self.name!r}: config.pbtxt has no parameter "
                "'huggingface_model'; name a hub id or a folder there"
            )
        self.defaults = parse_settings(params, Settings(), from_config=True)
        self.return_full_text = _as_bool(
            "return_full_text", params.get("return_full_text", "true"), from_config=True
        )
        gated = _as_bool("gated", params.get("gated", "false"), from_config=True)
        threads = _as_int(
            "num_threads", params.get("num_threads", "0"), minimum=0, from_config=True
        )
        if threads:
            torch.set_num_threads(threads)

        model_dir = Path(args["model_repository"])
        source, local = resolve_source(params["huggingface_model"], model_dir)
        token = None if local else require_token(source, gated, os.environ)

        if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
            self.device = torch.device(f"cuda:{int(args.get('model_instance_device_id', 0))}")
        else:
            self.device = torch.device("cpu")
        dtype_name = params.get("dtype", "auto").strip() or "auto"
        if dtype_name == "auto":
            dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        elif isinstance(getattr(torch, dtype_name, None), torch.dtype):
            dtype = getattr(torch, dtype_name)
        else:
            raise RequestError(
                f"parameter 'dtype' {dtype_name!r} is not a torch dtype; use auto, "
                "float32, float16 or bfloat16"
            )

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, token=token, padding_side="left")
            self.model = AutoModelForCausalLM.from_pretrained(source, token=token, dtype=dtype)
        except OSError as exc:
            raise RuntimeError(explain_load_error(source, exc, os.environ)) from None
        self.model.to(self.device).eval()
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.context = context_length(self.model, self.tokenizer)
        self.logger.log_info(
            f"{self.name}: loaded {source} on {self.device} as {dtype}, context {self.context}, "
            f"defaults {self.defaults}, {'streaming' if self.decoupled else 'not streaming'}"
        )

    # -- requests ----------------------------------------------------------------------------
    def _read_request(self, request) -> tuple:
        """``(input array, prompts, token ids, settings, return_full_text)`` or RequestError."""
        tensor = pb_utils.get_input_tensor_by_name(request, INPUT_NAME)
        if tensor is None:
            raise RequestError(f"input {INPUT_NAME!r} is missing")
        array = tensor.as_numpy()
        if array.size == 0:
            raise RequestError(f"input {INPUT_NAME!r} holds no prompt (shape {list(array.shape)})")
        prompts = []
        for i, item in enumerate(array.reshape(-1)):
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
            prompts.append(item)

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
        full = self.return_full_text
        if "return_full_text" in raw:
            full = _as_bool("return_full_text", raw["return_full_text"], from_config=False)

        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        for i, seq in enumerate(ids):
            if self.context and len(seq) + settings.max_tokens > self.context:
                raise RequestError(
                    f"prompt {i} is {len(seq)} tokens; with max_tokens={settings.max_tokens} that "
                    f"exceeds the model's context of {self.context} tokens; shorten the prompt "
                    "or lower max_tokens"
                )
        return array, prompts, ids, settings, full

    def _group(self, requests, refuse) -> dict:
        """Valid requests grouped by settings; ``refuse(r, message)`` answers each invalid one."""
        groups: dict[Settings, list] = {}
        for r, request in enumerate(requests):
            try:
                array, prompts, ids, settings, full = self._read_request(request)
            except RequestError as exc:
                refuse(r, str(exc))
                continue
            groups.setdefault(settings, []).append((r, array.shape, prompts, ids, full))
        return groups

    def execute(self, requests):
        if self.decoupled:
            self._execute_streaming(requests)
            return None
        responses = [None] * len(requests)

        def refuse(r: int, message: str) -> None:
            responses[r] = _error(message)

        for settings, members in self._group(requests, refuse).items():
            all_ids = [seq for m in members for seq in m[3]]
            try:
                completions = self.generate_ids(all_ids, settings)
            except Exception as exc:  # noqa: BLE001 (one bad batch must not stop the model)
                self.logger.log_error(f"{self.name}: generate failed: {exc!r}")
                for r, *_ in members:
                    responses[r] = _error(
                        f"generation failed: {exc}", pb_utils.TritonError.INTERNAL
                    )
                continue
            start = 0
            for r, shape, prompts, _ids, full in members:
                texts = completions[start : start + len(prompts)]
                start += len(prompts)
                if full:
                    texts = [p + t for p, t in zip(prompts, texts, strict=True)]
                responses[r] = _texts(texts, shape)
        return responses

    def _execute_streaming(self, requests) -> None:
        """Decoupled mode: each request's pieces go out through its own response sender."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        senders = [request.get_response_sender() for request in requests]

        def refuse(r: int, message: str) -> None:
            senders[r].send(_error(message), flags=final)

        for settings, members in self._group(requests, refuse).items():
            streamer = PieceStreamer([(senders[r], *rest) for r, *rest in members], self.completion)
            streamer.eos_ids = self.eos_ids
            try:
                self.generate_ids([seq for m in members for seq in m[3]], settings, streamer)
                streamer.end()
            except Exception as exc:  # noqa: BLE001 (one bad batch must not stop the model)
                cancelled = isinstance(exc, StreamCancelled)
                if cancelled:
                    self.logger.log_info(f"{self.name}: {exc}; generation stopped")
                else:
                    self.logger.log_error(f"{self.name}: generate failed: {exc!r}")
                error, internal = f"generation failed: {exc}", pb_utils.TritonError.INTERNAL
                for r, *_ in members:
                    try:
                        response = _cancelled() if cancelled else _error(error, internal)
                        senders[r].send(response, flags=final)
                    except Exception as lost:  # noqa: BLE001 (the request is gone, e.g. cancelled)
                        self.logger.log_warn(f"{self.name}: cannot send the error: {lost!r}")

    # -- generation --------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_ids(
        self, ids: list[list[int]], settings: Settings, streamer: BaseStreamer | None = None
    ) -> list[str]:
        """Generate for all token sequences at once; return each one's new text.

        With a ``streamer``, generate() hands it each new token as it is made; the streamer's
        ``end`` is left to the caller, so that a failed generate sends errors, not a last piece.
        """
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        config = GenerationConfig(
            max_new_tokens=settings.max_tokens,
            do_sample=settings.do_sample,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(self.eos_ids) or None,
            repetition_penalty=settings.repetition_penalty,
        )
        if settings.do_sample:
            config.temperature = settings.temperature
            config.top_k = settings.top_k or None
            config.top_p = settings.top_p
            if settings.seed is not None:
                torch.manual_seed(settings.seed)
        hook = None if streamer is None else _NoEnd(streamer)
        output = self.model.generate(**batch, generation_config=config, streamer=hook)
        width = batch["input_ids"].shape[1]
        texts = []
        for seq, prompt in zip(output, ids, strict=True):
            new = seq[width:].tolist()
            for i, token in enumerate(new):
                if token in self.eos_ids:
                    new = new[:i]
                    break
            texts.append(self.completion(prompt, new))
        return texts

    def completion(self, prompt: list[int], new: list[int]) -> str:
        """The text ``new`` adds after ``prompt`` (decoded together: spaces come out right)."""
        head = self.tokenizer.decode(prompt, skip_special_tokens=True)
        whole = self.tokenizer.decode(prompt + new, skip_special_tokens=True)
        if whole.startswith(head):
            return whole[len(head) :]
        return self.tokenizer.decode(new, skip_special_tokens=True)

    def finalize(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
