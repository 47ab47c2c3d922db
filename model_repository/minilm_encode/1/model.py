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
"""

from __future__ import annotations

import gc
import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel

from .minilm import mean_pool, resolve_source, thread_budget


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
        self.model = AutoModel.from_pretrained(source).to(self.device).eval()
        pb_utils.Logger.log_info(
            f"{args['model_name']}: encoder from {source} on {self.device}, "
            f"{self.threads} torch thread(s)"
        )

    def execute(self, requests: list) -> list:
        ids, masks, shapes = [], [], []
        for request in requests:
            ids.append(pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy())
            masks.append(pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy())
            shapes.append(list(ids[-1].shape[:-1]))
        vectors = self.embed(ids, masks)
        responses, start = [], 0
        for shape in shapes:
            count = int(np.prod(shape)) if shape else 1
            out = vectors[start : start + count].reshape(shape + [vectors.shape[-1]])
            start += count
            tensor = pb_utils.Tensor("embedding", out)
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

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
        # object owning some (a request's tensors) freed by it would crash the stub (issue 40)
        gc.collect()
        gc.freeze()


def pad(rows: np.ndarray, length: int) -> np.ndarray:
    """``rows`` padded with zeros on the right to ``length`` columns ([PAD] is id 0)."""
    return np.pad(rows, ((0, 0), (0, length - rows.shape[-1])))
