"""Triton Python-backend model: retrieve, then generate, with business logic scripting (BLS).

One request, a question (``text_input``), and a streamed answer (``text_output``, one response
per piece, as ``smollm2_stream`` sends them): this model calls two other models of the same
server, in its own code, with ``pb_utils.InferenceRequest``:

1. it embeds the question through ``embedding_model`` (``minilm``), a BLS call;
2. it ranks the passages of ``corpus.json`` (beside this file; embedded through the same model
   once, at the first request) by cosine similarity, with numpy;
3. it builds a prompt from the ``passages`` best ones and the question (``prompt_template``);
4. it streams ``llm_model``'s (``smollm2_stream``, a decoupled model) answer back: a decoupled
   BLS call (``.exec`` with ``decoupled=True``) returns the responses as they come, and this model
   sends each on at once.

An ensemble could not do this: its steps are fixed, and nothing can rank or build a prompt
between them. A step that fails (an empty question refused by the embedding model, a model that
is not loaded) ends the stream with an error that names the step and carries its message.

The one request parameter it takes is ``max_tokens``, handed to ``llm_model`` (which judges its
value); any other is refused (HTTP 400), as ``minilm`` refuses its parameters.

It has one instance, so questions wait for it. A question whose client left (a closed HTTP
connection, a cancelled gRPC stream) is dropped: before any step if it left while waiting, and
at the next piece of its answer if it left during it. Triton 2.51's Python backend cannot cancel
a BLS call, so ``llm_model`` still finishes that answer (within its own ``max_tokens``), but
``ask`` takes the next question at once.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# Request parameters the server itself may attach, and ``stream`` (how a client asks an in-flight
# model for one response per piece: this model streams either way); never an error.
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


class TritonPythonModel:
    """Answer each question with a prompt built from the passages closest to it."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.embedding_model = params.get("embedding_model") or "minilm"
        self.llm_model = params.get("llm_model") or "smollm2_stream"
        self.top = int(params.get("passages") or 2)
        self.template = (
            params.get("prompt_template") or "{passages}\n\nQuestion: {question}\nAnswer:"
        )
        corpus = Path(__file__).with_name("corpus.json")
        self.passages = json.loads(corpus.read_text(encoding="utf-8"))
        self.vectors = None  # the passages' embeddings, made at the first request

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.answer(request, sender)
            except (StepError, RequestError) as exc:
                error = pb_utils.TritonError(str(exc), exc.code)
                sender.send(pb_utils.InferenceResponse(error=error))
            except Exception as exc:  # noqa: BLE001 (a fault fails this question alone)
                error = pb_utils.TritonError(f"ask: {exc!r}", pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=error))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def answer(self, request, sender) -> None:
        llm_parameters = read_parameters(request)
        if sender.is_cancelled():  # its client left while it waited for this instance
            pb_utils.Logger.log_info(
                "ask: a question was cancelled by its client before it ran; no step ran for it"
            )
            return
        raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)
        item = raw[0] if raw.size else b""
        question = item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
        if self.vectors is None:
            self.vectors = self.embed(self.passages)
        asked = self.embed([question])[0]
        best = np.argsort(-(self.vectors @ asked), kind="stable")[: self.top]
        prompt = self.template.format(
            passages="\n".join(f"- {self.passages[i]}" for i in best), question=question
        )
        text = pb_utils.Tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_))
        call = pb_utils.InferenceRequest(
            model_name=self.llm_model,
            inputs=[text],
            requested_output_names=["text_output"],
            # the answer, not the prompt again
            parameters={"return_full_text": False, **llm_parameters},
        )
        sent = 0
        for response in call.exec(decoupled=True):
            if sender.is_cancelled():
                pb_utils.Logger.log_info(
                    f"ask: a question was cancelled by its client after {sent} piece(s) of its "
                    f"answer; ask stopped reading it ({self.llm_model} finishes it: a BLS call "
                    "cannot be cancelled in Triton 2.51)"
                )
                return
            if response.has_error():
                raise StepError(self.llm_model, response.error())
            piece = pb_utils.get_output_tensor_by_name(response, "text_output")
            if piece is not None:  # the closing response of a stream carries no tensor
                out = pb_utils.Tensor("text_output", piece.as_numpy())
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                sent += 1

    def embed(self, texts: list[str]) -> np.ndarray:
        """The embedding model's vectors for ``texts`` (unit length), 32 texts per request."""
        vectors = []
        for start in range(0, len(texts), 32):
            batch = [[t.encode("utf-8")] for t in texts[start : start + 32]]
            tensor = pb_utils.Tensor("text_input", np.array(batch, dtype=np.object_))
            response = pb_utils.InferenceRequest(
                model_name=self.embedding_model,
                inputs=[tensor],
                requested_output_names=["embedding"],
            ).exec()
            if response.has_error():
                raise StepError(self.embedding_model, response.error())
            vectors.append(pb_utils.get_output_tensor_by_name(response, "embedding").as_numpy())
        return np.concatenate(vectors)

    def finalize(self) -> None:
        # Triton's stub frees its shared memory before Python's last garbage collection, and an
        # object owning some (a request, a sender) freed by it would crash the stub
        # (docs/known-issues.md)
        gc.collect()
        gc.freeze()


def read_parameters(request) -> dict:
    """The parameters to hand ``llm_model``: ``max_tokens`` if the request has it; any other
    parameter is a :class:`RequestError`."""
    asked = json.loads(request.parameters() or "{}")
    unknown = sorted(set(asked) - IGNORED_PARAMETERS - {"max_tokens"})
    if unknown:
        raise RequestError(
            f"ask: unknown parameter(s) {', '.join(map(repr, unknown))}: ask takes only "
            "max_tokens (its language model's; set the others in config.pbtxt)"
        )
    if "max_tokens" not in asked:
        return {}
    if type(asked["max_tokens"]) is not int:
        raise RequestError(
            f"ask: parameter 'max_tokens' must be an integer, got {asked['max_tokens']!r}"
        )
    return {"max_tokens": asked["max_tokens"]}


class RequestError(ValueError):
    """The request itself is not valid (HTTP 400); the message says why."""

    @property
    def code(self):
        return pb_utils.TritonError.INVALID_ARG


class StepError(Exception):
    """A step's model refused or failed: the message names the step and keeps its reason."""

    def __init__(self, model: str, error) -> None:
        message = error.message()
        if any(words in message for words in ("unknown model", "not found", "not ready")):
            message += f"; load {model} (ask calls it)"
        super().__init__(f"ask: step {model}: {message}")
        self.code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL
