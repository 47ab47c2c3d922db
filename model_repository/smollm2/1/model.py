"""Triton Python-backend model: text generation with any Hugging Face causal language model.

This folder is one model version. Triton imports ``model.py`` as a module of the package that
the folder is (``1``), so it brings in its siblings with ``from . import``:

- ``model.py``: the ``TritonPythonModel`` that Triton calls, and how it loads the weights;
- ``protocol.py``: how a request is read and checked, and how it is answered;
- ``streaming.py``: the decoupled mode's token-by-token responses;
- ``inflight.py``: in-flight batching, where requests join and leave a running batch at every
  generation step (``inflight_batching: "true"``).

Self-contained on purpose: the folder imports only the standard library, numpy, torch,
transformers and ``triton_python_backend_utils``, so it runs in the lab's bundled server and in an
NGC ``tritonserver`` container where labkit is not installed.

config.pbtxt parameters (all strings, as Triton stores them):

- ``huggingface_model`` (required): a hub id (``tiiuae/falcon-7b``), an absolute path, or a path
  relative to this model's folder (``weights``).
- ``max_tokens`` (new tokens, default 16), ``temperature`` (0 = greedy, the default), ``top_k``
  (0 = off), ``top_p`` (1 = off), ``repetition_penalty`` (1 = off), ``return_full_text``
  (``true``: the answer starts with the prompt, as in the tutorial): generation defaults that a
  request may override with request parameters of the same names, plus ``seed`` for sampling.
- ``gated`` (``true`` for models such as Llama 2 that need a token), ``dtype`` (``auto``: float16
  on a GPU, float32 on a CPU), ``num_threads`` (torch CPU threads; 0 = torch's default, or with
  in-flight batching on a CPU one less than the cores this process may use: see ``inflight.py``).
- ``inflight_batching`` (``true``: serve through the in-flight engine of ``inflight.py``; needs
  ``decoupled: true``) and its limits ``max_running_requests``, ``kv_page_size``, ``kv_blocks``,
  ``max_batch_tokens``, ``max_queue_size`` (see ``inflight.Limits``).

Input ``text_input`` holds one prompt per element, in any shape (``[1]``, ``[N]``; ``[1, 1]``,
``[N, 1]`` with batching); output ``text_output`` has the same shape, one answer per prompt. The
prompts of all requests in a batch that share generation settings go through ONE ``generate``
call (left padding, attention mask), so dynamic batching pays off and a prompt's greedy answer in
a batch equals its answer alone. A bad request gets an error response that names the problem
(HTTP 400), and the model keeps serving. With ``model_transaction_policy { decoupled: true }``
the same code streams (see ``streaming.py``); with ``inflight_batching`` too, ``execute`` hands
each request to a running engine and returns at once (see ``inflight.py``).

The hub token comes from ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN`` or ``PRIVATE_REPO_TOKEN`` (the
tutorial's name), in that order; it is never logged. Downloads are cached under ``HF_HOME``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from .inflight import InflightEngine, Limits, read_limits, serving_threads
from .protocol import (
    Member,
    Prompts,
    RequestError,
    RequestReader,
    Settings,
    answer,
    as_bool,
    as_int,
    cancelled_response,
    error_response,
    group_by_settings,
    parse_settings,
)
from .streaming import PieceStreamer, StreamCancelled

TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "PRIVATE_REPO_TOKEN")


class TritonPythonModel:
    """What Triton calls: ``initialize`` once per instance, ``execute`` for each batch."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.logger = pb_utils.Logger
        self.name = config.get("name", args.get("model_name", "model"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

        options = read_options(config, self.name)
        source, token = locate_weights(options, Path(args["model_repository"]))
        self.device = choose_device(args)
        threads = options.num_threads
        if not threads and options.inflight and self.device.type == "cpu":
            threads = serving_threads()
        if threads:
            torch.set_num_threads(threads)
        dtype = choose_dtype(options.dtype, self.device)
        self.tokenizer, self.model = load(source, token, self.device, dtype)

        self.eos_ids = end_of_sequence_ids(self.model, self.tokenizer)
        context = context_length(self.model, self.tokenizer)
        self.reader = RequestReader(self.tokenizer, options.defaults, options.full_text, context)
        self.engine = self._start_engine(options) if options.inflight else None
        mode = "in-flight batching" if self.engine else "streaming" if self.decoupled else ""
        self.logger.log_info(
            f"{self.name}: loaded {source} on {self.device} as {dtype}, context {context}, "
            f"defaults {options.defaults}, {mode or 'not streaming'}"
            + (f", {options.inflight}" if self.engine else "")
        )

    def _start_engine(self, options: Options) -> InflightEngine:
        if not self.decoupled:
            raise RequestError(
                f"model {self.name!r}: inflight_batching needs a decoupled model (its responses "
                "leave after execute has returned); add model_transaction_policy { decoupled: "
                "true } to config.pbtxt"
            )
        engine = InflightEngine(
            self.model,
            self.tokenizer,
            limits=options.inflight,
            eos_ids=self.eos_ids,
            max_tokens=options.defaults.max_tokens,
            decode=self.completion,
            run_alone=self._answer_alone,
            name=self.name,
        )
        engine.start(self.tokenizer("Hello")["input_ids"])
        return engine

    def execute(self, requests: list) -> list | None:
        if self.engine is not None:
            self._execute_inflight(requests)
            return None  # the engine's thread answers each request through its sender
        if self.decoupled:
            self._execute_streaming(requests)
            return None  # each request's responses went out through its own sender
        return self._execute_batch(requests)

    def _execute_batch(self, requests: list) -> list:
        """One response per request; each group of equal settings is one ``generate`` call."""
        responses = [None] * len(requests)

        def refuse(index: int, message: str) -> None:
            responses[index] = error_response(message)

        for settings, members in group_by_settings(requests, self.reader.read, refuse).items():
            try:
                completions = self.generate_ids(token_ids(members), settings)
            except Exception as exc:  # noqa: BLE001 (one bad batch must not stop the model)
                self.logger.log_error(f"{self.name}: generate failed: {exc!r}")
                for member in members:
                    responses[member.index] = error_response(
                        f"generation failed: {exc}", pb_utils.TritonError.INTERNAL
                    )
                continue
            start = 0
            for member in members:
                stop = start + len(member.prompts.texts)
                responses[member.index] = answer(member.prompts, completions[start:stop])
                start = stop
        return responses

    def _execute_streaming(self, requests: list) -> None:
        """Decoupled mode: each request's pieces go out through its own response sender."""
        senders, groups = self._read_decoupled(requests)
        for settings, members in groups.items():
            self._stream([senders[member.index] for member in members], members, settings)

    def _execute_inflight(self, requests: list) -> None:
        """In-flight mode: each valid request goes to the engine, which answers it. Returns at once."""
        senders, groups = self._read_decoupled(requests)
        for members in groups.values():
            for member in members:
                self.engine.submit(senders[member.index], member.prompts)

    def _read_decoupled(self, requests: list) -> tuple[list, dict[Settings, list[Member]]]:
        """Each request's response sender, and the valid requests grouped; the others refused."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        senders = [request.get_response_sender() for request in requests]

        def refuse(index: int, message: str) -> None:
            senders[index].send(error_response(message), flags=final)

        return senders, group_by_settings(requests, self.reader.read, refuse)

    def _stream(self, senders: list, members: list[Member], settings: Settings) -> None:
        """One ``generate`` for ``members``, each new token sent to its request as it comes."""
        streamer = PieceStreamer(
            senders, [member.prompts for member in members], self.completion, self.eos_ids
        )
        try:
            self.generate_ids(token_ids(members), settings, streamer)
            streamer.finish()
        except Exception as exc:  # noqa: BLE001 (one bad batch must not stop the model)
            self._end_streams(senders, exc)

    def _answer_alone(self, sender, prompts: Prompts) -> None:
        """One request through ``generate``, streamed if it asked: the in-flight engine's side
        lane for requests that sample or set a repetition penalty (see ``inflight.py``)."""
        if prompts.stream:
            self._stream([sender], [Member(0, prompts)], prompts.settings)
            return
        try:
            completions = self.generate_ids(prompts.ids, prompts.settings)
        except Exception as exc:  # noqa: BLE001 (one bad request must not stop the model)
            self._end_streams([sender], exc)
            return
        sender.send(
            answer(prompts, completions), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def _end_streams(self, senders: list, exc: Exception) -> None:
        """Tell each request of a failed (or cancelled) stream, in its final response."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        cancelled = isinstance(exc, StreamCancelled)
        if cancelled:
            self.logger.log_info(f"{self.name}: {exc}; generation stopped")
        else:
            self.logger.log_error(f"{self.name}: generate failed: {exc!r}")
        error, internal = f"generation failed: {exc}", pb_utils.TritonError.INTERNAL
        for sender in senders:
            try:
                response = cancelled_response() if cancelled else error_response(error, internal)
                sender.send(response, flags=final)
            except Exception as lost:  # noqa: BLE001 (the request is gone, e.g. cancelled)
                self.logger.log_warn(f"{self.name}: cannot send the error: {lost!r}")

    @torch.inference_mode()
    def generate_ids(
        self, ids: list[list[int]], settings: Settings, streamer: BaseStreamer | None = None
    ) -> list[str]:
        """Generate for all token sequences at once; return each one's new text.

        With a ``streamer``, generate() hands it each new token as it is made.
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
        output = self.model.generate(**batch, generation_config=config, streamer=streamer)
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
        if getattr(self, "engine", None) is not None:
            self.engine.stop()
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def token_ids(members: list[Member]) -> list[list[int]]:
    """The token ids of every prompt of ``members``, in order: one ``generate`` batch."""
    return [seq for member in members for seq in member.prompts.ids]


# -- the steps of initialize --------------------------------------------------------------------
class Options(NamedTuple):
    """config.pbtxt's parameters, read and checked."""

    huggingface_model: str
    defaults: Settings  # generation settings a request may override
    full_text: bool  # return_full_text
    gated: bool
    num_threads: int  # 0: torch's default
    dtype: str  # checked by choose_dtype, which knows the device
    inflight: Limits | None  # the in-flight engine's limits; None: no in-flight batching


def read_options(config: dict, name: str) -> Options:
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    if "huggingface_model" not in params:
        raise RequestError(
            f"model {name!r}: config.pbtxt has no parameter "
            "'huggingface_model'; name a hub id or a folder there"
        )
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
        inflight=read_limits(params),
    )


def locate_weights(options: Options, model_dir: Path) -> tuple[str, str | None]:
    """``(what to pass to from_pretrained, hub token or None)``."""
    source, local = resolve_source(options.huggingface_model, model_dir)
    token = None if local else require_token(source, options.gated, os.environ)
    return source, token


def choose_device(args: dict) -> torch.device:
    """The instance's GPU when Triton gave it one and CUDA works, else the CPU."""
    if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
        return torch.device(f"cuda:{int(args.get('model_instance_device_id', 0))}")
    return torch.device("cpu")


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise RequestError(
        f"parameter 'dtype' {name!r} is not a torch dtype; use auto, float32, float16 or bfloat16"
    )


def load(source: str, token: str | None, device: torch.device, dtype: torch.dtype) -> tuple:
    """``(tokenizer, model)``: the model in eval mode on ``device``, the tokenizer padding left."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, token=token, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(source, token=token, dtype=dtype)
    except OSError as exc:
        raise RuntimeError(explain_load_error(source, exc, os.environ)) from None
    model.to(device).eval()
    tokenizer.padding_side = "left"  # batched generation with a decoder-only model needs it
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


def end_of_sequence_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def context_length(model, tokenizer) -> int | None:
    """The longest sequence the model accepts (prompt plus new tokens), if it says."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


# -- where the weights come from ----------------------------------------------------------------
class TokenError(RuntimeError):
    """A gated model was asked for without a hub token."""


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
