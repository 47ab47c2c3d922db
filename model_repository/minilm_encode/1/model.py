"""Triton Python-backend model: the second step of ``minilm_pipeline``, token ids to embeddings.

Token ids in (``input_ids`` and ``attention_mask``, INT64, one row per text, as
``minilm_tokenize`` writes them), one float32 vector out per text (``embedding``): the encoder's
last hidden states, **mean-pooled** over the real tokens and scaled to unit length, exactly as the
single ``minilm`` model does. Its loading, thread budget and pooling are ``minilm``'s own code
(``minilm.py`` links to ``minilm/1/model.py``), so the two cannot drift apart.

Pooling is done here rather than as a third step: a pooling step would receive every token's
hidden state (384 floats per token, about 25 times the pooled vector for a 25-token text) through
shared memory and pay one more stub round trip, to do a sum and a division that take microseconds.
On a GPU the whole step (encoder and pooling) becomes one TensorRT or ONNX graph.

A ``KIND_GPU`` instance runs the encoder on its GPU (``cuda:<device id>``), as ``minilm`` does;
the ids cross to the GPU and only the pooled vectors come back.

The inputs allow ragged batches (``allow_ragged_batch``): requests whose texts have different
token counts are batched together by Triton's dynamic batcher, padded here to the longest one
(the mask keeps the padding out of the mean) and encoded in one forward pass.

The step is a model of its own, so any client can send it ids. A request is refused (HTTP 400,
the message names the input and the limit) before anything reaches the encoder when its
``input_ids`` hold an id outside the model's vocabulary (``vocab_size`` of its config, 30522) or
a negative one, have no positions or more than the model's ``max_position_embeddings`` (512),
when ``attention_mask`` has another shape than ``input_ids``, or when it carries a request
parameter (this step takes none). The other requests of the batch are answered. Unchecked, such
an id raised inside the encoder and failed the whole batch; on a GPU it is a device-side assert
that fails the instance until it is reloaded.
"""

from __future__ import annotations

import gc
import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel

from .minilm import IGNORED_PARAMETERS, RequestError, Span, mean_pool, resolve_source, thread_budget


class TritonPythonModel:
    """Encode the ids of every request of a batch in one forward pass."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.normalize = (params.get("normalize") or "true").strip().lower() in ("true", "1", "yes")
        source = resolve_source(params.get("huggingface_model", ""), args["model_repository"])
        if args.get("model_instance_kind") == "GPU":
            self.device = torch.device(f"cuda:{args.get('model_instance_device_id', 0)}")
        else:
            self.device = torch.device("cpu")
        self.threads = int(params.get("num_threads") or 0) or thread_budget(config)
        torch.set_num_threads(self.threads)
        self.name = args["model_name"]
        self.model = AutoModel.from_pretrained(source).to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size  # ids are 0 .. vocab_size - 1
        self.max_positions = self.model.config.max_position_embeddings
        pb_utils.Logger.log_info(
            f"{args['model_name']}: encoder from {source} on {self.device}, "
            f"{self.threads} torch thread(s)"
        )

    def execute(self, requests: list) -> list:
        ids, masks = [], []  # the valid requests' rows, encoded in one forward pass
        spans: list[Span | str] = []  # per request: where its rows are, or why it is refused
        rows = 0
        for request in requests:
            try:
                request_ids, mask = self.read_request(request)
            except RequestError as exc:
                spans.append(f"{self.name}: {exc}")
                continue
            shape = list(request_ids.shape[:-1])
            count = int(np.prod(shape)) if shape else 1
            spans.append(Span(rows, rows + count, shape))
            rows += count
            ids.append(request_ids)
            masks.append(mask)
        vectors = self.embed(ids, masks) if ids else None
        responses = []
        for span in spans:
            if isinstance(span, str):
                error = pb_utils.TritonError(span, pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            out = vectors[span.start : span.stop].reshape(span.shape + [vectors.shape[-1]])
            tensor = pb_utils.Tensor("embedding", out)
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def read_request(self, request) -> tuple[np.ndarray, np.ndarray]:
        """The request's ``input_ids`` and ``attention_mask``, checked (:class:`RequestError`)."""
        unknown = sorted(set(json.loads(request.parameters() or "{}")) - IGNORED_PARAMETERS)
        if unknown:
            raise RequestError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))}: this step takes no "
                "request parameters"
            )
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
        mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
        if ids.shape != mask.shape:
            raise RequestError(
                f"input_ids has shape {list(ids.shape)} and attention_mask {list(mask.shape)}; "
                "send one mask value per id (the same shape)"
            )
        positions = ids.shape[-1] if ids.ndim else 0
        if positions == 0:
            raise RequestError("input_ids has no positions; send at least one token id per text")
        if positions > self.max_positions:
            raise RequestError(
                f"input_ids has {positions} positions, over the model's max_position_embeddings "
                f"of {self.max_positions}; send at most {self.max_positions} ids per text"
            )
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise RequestError(
                    f"input_ids holds id {bad}, outside the model's vocabulary of "
                    f"{self.vocab_size} (ids 0 to {self.vocab_size - 1}); send its tokenizer's ids"
                )
        return ids, mask

    def embed(self, ids: list[np.ndarray], masks: list[np.ndarray]) -> np.ndarray:
        """Pad every request's rows to the longest, encode them at once, pool, normalise."""
        length = max(a.shape[-1] for a in ids)
        rows = [pad(a.reshape(-1, a.shape[-1]), length) for a in ids]
        mask_rows = [pad(m.reshape(-1, m.shape[-1]), length) for m in masks]
        batch_ids = torch.from_numpy(np.concatenate(rows)).to(self.device)
        batch_mask = torch.from_numpy(np.concatenate(mask_rows)).to(self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids=batch_ids, attention_mask=batch_mask).last_hidden_state
            vectors = mean_pool(hidden, batch_mask)
            if self.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.float().cpu().numpy()

    def finalize(self) -> None:
        self.model = None
        # Triton's stub frees its shared memory before Python's last garbage collection, and an
        # object owning some (a request's tensors) freed by it would crash the stub
        # (docs/known-issues.md)
        gc.collect()
        gc.freeze()


def pad(rows: np.ndarray, length: int) -> np.ndarray:
    """``rows`` padded with zeros on the right to ``length`` columns ([PAD] is id 0)."""
    return np.pad(rows, ((0, 0), (0, length - rows.shape[-1])))
